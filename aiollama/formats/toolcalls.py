"""Tool calls in generated text, and what a model without tool support is told.

Models write tool calls in a few formats; :func:`parse` reads them into OpenAI-style calls:

- Hermes and Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block a call;
- Qwen3-Coder, Qwen3.5 and later: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
  </function></tool_call>``;
- GLM-4.5 and later: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``;
- gpt-oss (Harmony): a ``commentary`` message ``to=functions.NAME``, which
  :mod:`aiollama.formats.harmony` writes into the content in the Hermes form;
- Kimi-K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
  {...}<|tool_call_end|>...<|tool_calls_section_end|>``;
- Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``;
- Llama 3: ``<|python_tag|>{"name": ..., "parameters": {...}}``, or that JSON alone;
- plain JSON: an object with ``name`` and ``arguments`` (or ``parameters``), or a list of them,
  possibly in a code fence. This is also what ``tool_choice="required"`` or a named function
  constrains the output to, so even a small model returns arguments that parse.

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
from aiollama.formats.text import partial_tail

# Markers that open a call anywhere in a reply (text before them is content); JSON opens one only
# at the start of the reply.
OPENERS = ("<tool_call>", "<function=", "[TOOL_CALLS]", "<|python_tag|>", "<|tool_calls_section_begin|>",
           "<|tool_call_begin|>")
MARKERS = (*OPENERS, "{", "[", "```")
# Marker tokens the stream shows as text even where the vocabulary makes them control tokens
PRESERVED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|tool_calls_section_begin|>",
             "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
_KIMI = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([^\s:<]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*?)"
                   r"(?:<\|tool_call_end\|>|$)", re.S)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.S)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.S)


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
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name or tool.get("type", "function") != "function":
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        names.append(name)
    return names


def tool_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each tool's name and its parameters schema, checked as :func:`tool_names` checks them: what
    :func:`parse` takes to read XML-format arguments by their types."""
    return {name: (tool["function"].get("parameters") or {}) for name, tool in zip(tool_names(tools), tools)}


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


def _json_calls(text: str, names: Collection[str]) -> list[ToolCall] | None:
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


def _value(text: str, schema: Any) -> Any:
    """An XML-format argument: kept as text where the tool's schema says string (or nothing can be
    read), else read as JSON (numbers, booleans, objects, arrays)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _xml_calls(body: str, names: Collection[str]) -> list[ToolCall] | None:
    """Qwen3-Coder's ``<function=NAME><parameter=KEY>`` and GLM's ``NAME<arg_key>`` calls."""
    schemas = names if isinstance(names, Mapping) else {}
    pairs: list[tuple[str, list[tuple[str, str]]]] = []
    functions = _FUNCTION.findall(body)
    if functions:
        pairs = [(name.strip(), [(k.strip(), v) for k, v in _PARAMETER.findall(inner)]) for name, inner in functions]
    elif "<arg_key>" in body:
        pairs = [(body[:body.index("<arg_key>")].strip(), [(k.strip(), v.strip()) for k, v in _ARG.findall(body)])]
    elif body.strip() in names:  # GLM's call of a function without arguments
        pairs = [(body.strip(), [])]
    calls = []
    for name, args in pairs:
        if name not in names:
            return None
        properties = (schemas.get(name) or {}).get("properties") or {}
        values = {key: _value(value, properties.get(key)) for key, value in args}
        calls.append(ToolCall(name, json.dumps(values, ensure_ascii=False)))
    return calls or None


def parse(text: str, names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """Split generated text into its plain content and the tool calls it makes (none: the content
    is the whole text). ``names`` may map each name to the tool's parameters schema, which says
    which XML-format arguments stay text."""
    stripped = text.strip()
    if "<|tool_call_begin|>" in stripped:
        return _kimi_calls(stripped, names)
    if "<tool_call>" in stripped or stripped.startswith("<function="):
        start = stripped.index("<tool_call>") if "<tool_call>" in stripped else 0
        bodies = _HERMES.findall(stripped) if "<tool_call>" in stripped else [stripped]
        calls = []
        for body in bodies:
            found = _json_calls(body, names)
            if found is None:
                found = _xml_calls(body, names)
            if found is None:
                return text, []
            calls += found
        return stripped[:start].strip(), calls
    for marker in ("[TOOL_CALLS]", "<|python_tag|>"):
        if marker in stripped:
            before, _, after = stripped.partition(marker)
            found = _json_calls(after.strip(), names)
            return (before.strip(), found) if found else (text, [])
    found = _json_calls(stripped, names)
    return ("", found) if found else (text, [])


def _kimi_calls(text: str, names: Collection[str]) -> tuple[str, list[ToolCall]]:
    start = min(i for i in (text.find("<|tool_calls_section_begin|>"), text.find("<|tool_call_begin|>")) if i >= 0)
    calls = []
    for name, arguments in _KIMI.findall(text):
        call = _call({"name": name, "arguments": arguments.strip() or "{}"}, names)
        if call is None:
            return text, []
        calls.append(call)
    return (text[:start].strip(), calls) if calls else (text, [])


def held_from(text: str) -> int:
    """Where streamed content must stop for now: at a marker that opens a tool call, or at a tail
    that could become one (the end of ``text`` when there is neither)."""
    found = [i for i in (text.find(m) for m in OPENERS) if i >= 0]
    return min(found) if found else len(text) - partial_tail(text, OPENERS)


def might_be_call(text: str) -> bool:
    """Whether streamed text so far could be the start of a tool call (hold it back until known)."""
    stripped = text.lstrip()
    return not stripped or any(stripped.startswith(m) or m.startswith(stripped) for m in MARKERS)


def call_schema(tools: Sequence[Mapping[str, Any]], choice: Any) -> dict[str, Any] | None:
    """The JSON schema a ``tool_choice`` of "required" or a named function constrains the output to
    (None for "auto" and "none")."""
    if choice in (None, "auto", "none"):
        return None
    by_name = {tool["function"]["name"]: tool["function"] for tool in tools}
    if choice == "required":
        wanted = list(by_name)
    elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        if name not in by_name:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools")
        wanted = [name]
    else:
        raise InvalidRequestError(f"tool_choice must be 'auto', 'none', 'required' or "
                                  f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
    options = [{"type": "object", "properties": {
        "name": {"const": name},
        "arguments": by_name[name].get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"]} for name in wanted]
    return options[0] if len(options) == 1 else {"anyOf": options}


def describe(tools: Sequence[Mapping[str, Any]]) -> str:
    """A system message that offers ``tools`` to a model whose template has no place for them."""
    listed = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return ("You can call these tools:\n" + listed + "\n\nTo call one, answer only with a JSON object: "
            '{"name": <the tool\'s name>, "arguments": <an object of its arguments>}.')
