"""Tool calls: the OpenAI shape of one, the checks of tool definitions, and what a model whose
template has no place for tools is told.

Calls in a model's own format are read by llama.cpp's parser of that format
(:mod:`aiollama.formats.reply`). A template with no place for tools gets them described in a system
message (:func:`describe`), and the model answers with a JSON call, read by :func:`json_calls`: an
object with ``name`` and ``arguments`` (or ``parameters``), or a list of them, possibly in a
```json fence. ``tool_choice`` "required" or a named function then constrains the reply to the
JSON schema of :func:`call_schema`.

Only names among the tools offered count as calls. Pure: no engine, no I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiollama.errors import InvalidRequestError

# Marker texts the stream of a plain prompt (no chat turn) shows even where the vocabulary makes
# them control tokens; a chat turn shows those of its model's format instead.
PRESERVED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|tool_calls_section_begin|>",
             "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (as OpenAI gives them)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The function names of OpenAI-style tools; InvalidRequestError for a malformed one."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise InvalidRequestError("tools must be a list of {'type': 'function', 'function': {...}}")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name or tool.get("type", "function") != "function":
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        assert isinstance(function, Mapping)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(name)
    return names


def _call(obj: Any, names: Collection[str]) -> ToolCall | None:
    if not isinstance(obj, Mapping) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return ToolCall(str(obj["name"]), args)
    return ToolCall(str(obj["name"]), json.dumps(args, ensure_ascii=False))


def json_calls(text: str, names: Collection[str]) -> list[ToolCall] | None:
    """The calls a reply of only JSON makes (an object, or a list of them, possibly fenced), or
    None where it is not such a reply."""
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, names) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def might_be_call(text: str) -> bool:
    """Whether streamed text so far could be the start of a JSON call (hold it back until known)."""
    stripped = text.lstrip()
    return not stripped or any(stripped.startswith(m) or m.startswith(stripped) for m in ("{", "[", "```"))


TOOL_CHOICES = ("auto", "none", "required")


def read_tool_choice(tools: Sequence[Mapping[str, Any]] | None, choice: Any) -> tuple[list[str], str]:
    """The names of the tools and what ``tool_choice`` asks: "auto", "none", "required" or "named"
    (the one name then first). InvalidRequestError for a choice that means nothing here: the one
    reading of ``tool_choice``, for the chat template and the JSON schema of a call alike."""
    names = tool_names(tools) if tools else []
    if choice is None or (isinstance(choice, str) and choice in TOOL_CHOICES):
        if choice == "required" and not names:
            raise InvalidRequestError("tool_choice 'required' needs tools", param="tool_choice")
        return names, choice or "auto"
    function = choice.get("function") if isinstance(choice, Mapping) else None
    if isinstance(function, Mapping) and choice.get("type", "function") == "function":
        name = function.get("name")
        if name not in names:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return [name, *(n for n in names if n != name)], "named"
    raise InvalidRequestError(f"tool_choice must be 'auto', 'none', 'required' or "
                              f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r:.80}",
                              param="tool_choice")


def call_schema(tools: Sequence[Mapping[str, Any]], choice: Any) -> dict[str, Any] | None:
    """The JSON schema a ``tool_choice`` of "required" or a named function constrains a JSON call
    to (None for "auto" and "none")."""
    names, kind = read_tool_choice(tools, choice)
    if kind in ("auto", "none"):
        return None
    by_name = {tool["function"]["name"]: tool["function"] for tool in tools}
    wanted = names if kind == "required" else names[:1]
    options = [{"type": "object", "properties": {
        "name": {"const": name},
        "arguments": by_name[name].get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"]} for name in wanted]
    return options[0] if len(options) == 1 else {"anyOf": options}


def describe(tools: Sequence[Mapping[str, Any]], *, json_calls: bool = True) -> str:
    """A system message that offers ``tools`` to a model whose template has no place for them;
    ``json_calls``: it is told to answer a call as JSON (where its template writes calls of a
    syntax of its own, it writes those)."""
    listed = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    told = "You can call these tools:\n" + listed
    if json_calls:
        told += ("\n\nTo call one, answer only with a JSON object: "
                 '{"name": <the tool\'s name>, "arguments": <an object of its arguments>}.')
    return told
