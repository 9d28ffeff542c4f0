"""Chat messages as llama.cpp's chat layer takes them: checked, with caller text kept apart from
what templates write as their own (roles, tool calls, tool definitions), and a template without a
place for tools told of them in a system message. Pure: no engine, no I/O."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from aiollama.errors import ChatTemplateError
from aiollama.formats.toolcalls import describe

_CONTENT = "\ue000{}\ue001"  # private-use characters: no tokenizer or template gives them meaning
_CONTENT_RE = re.compile("\ue000([0-9]+)\ue001")
REPLY = "\ue002"  # stands for the previous assistant reply, which is already in the conversation
IMAGE = "\ue003"  # stands for a picture in a message's content (its tokens come from the projector)
_RESERVED_CHARS = ("\ue000", "\ue001", REPLY)

Messages = str | Mapping[str, Any] | Sequence[Mapping[str, Any]]


def _reserved(text: str, what: str) -> str:
    if any(c in text for c in _RESERVED_CHARS):
        raise ChatTemplateError(f"{what} holds characters U+E000..U+E002, which aiollama reserves")
    return text


def normalize(messages: Messages) -> list[dict[str, Any]]:
    """``messages`` as a list of OpenAI-style messages for the chat layer: a str is one user message.
    A content is text, None, or a list of parts ({"type": "text", "text": ...}, and pictures as
    {"type": "media_marker", "text": IMAGE}); an assistant message may have ``tool_calls`` (arguments
    as JSON text or an object) and ``reasoning_content``; a tool message ``tool_call_id`` and
    ``name``. ChatTemplateError for anything else."""
    if isinstance(messages, str):
        messages = {"role": "user", "content": messages}
    if isinstance(messages, Mapping):
        messages = [messages]
    if not isinstance(messages, Sequence) or isinstance(messages, (bytes, bytearray)):
        raise ChatTemplateError(f"messages must be a str, a message or a list of messages, got "
                                f"{type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    return [_message(i, message) for i, message in enumerate(messages)]


def _message(i: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"message {i} must be a mapping with 'role' and 'content'")
    role, content, calls = message.get("role"), message.get("content"), message.get("tool_calls")
    if not isinstance(role, str) or not role:
        raise ChatTemplateError(f"message {i} needs a non-empty str 'role'")
    _reserved(role, f"message {i}'s role")
    item: dict[str, Any] = {"role": role, "content": _content(i, content, calls)}
    if calls:
        item["tool_calls"] = _tool_calls(i, calls)
    for key in ("reasoning_content", "tool_call_id", "name"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise ChatTemplateError(f"message {i}: {key} must be a str")
            item[key] = _reserved(value, f"message {i}'s {key}")
    return item


def _content(i: int, content: Any, calls: Any) -> Any:
    if content is None:
        if not calls:
            raise ChatTemplateError(f"message {i} needs a str 'content' (or tool_calls)")
        return None
    if isinstance(content, str):
        return _reserved(content, f"message {i}")
    if not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
        raise ChatTemplateError(f"message {i}: content must be a str or a list of parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        text = part.get("text") if isinstance(part, Mapping) else None
        if kind not in ("text", "media_marker") or not isinstance(text, str) or \
                (kind == "media_marker" and text != IMAGE):
            raise ChatTemplateError(f"message {i}: a content part is {{'type': 'text', 'text': ...}} or a picture, "
                                    f"got {part!r:.80}")
        parts.append({"type": kind, "text": _reserved(text, f"message {i}") if kind == "text" else text})
    return parts


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise ChatTemplateError(f"message {i}: tool_calls must be a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"message {i}: each tool call needs a function with a name")
        arguments = function.get("arguments", {})
        value = arguments
        if isinstance(arguments, str):  # kept as given: llama.cpp reads it as templates want it
            try:
                value = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise ChatTemplateError(f"message {i}: tool call arguments are not JSON: {arguments!r:.80}") from None
            arguments = arguments if arguments.strip() else "{}"
        if not isinstance(value, Mapping):
            raise ChatTemplateError(f"message {i}: tool call arguments must be a JSON object")
        entry: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def caller_texts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The caller's contents, in the order :func:`protect` numbers them."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            out.append(content)
        elif content is not None:
            out += [p["text"] for p in content if p["type"] == "text"]
        if "reasoning_content" in m:
            out.append(m["reasoning_content"])
    return out


def protect(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages with each content (and reasoning) replaced by a placeholder; an empty one stays
    empty, for templates that test it. REPLY stays as it is."""
    n = 0

    def mark(text: str) -> str:
        nonlocal n
        n += 1
        return _CONTENT.format(n - 1) if text and text != REPLY else text

    out = []
    for m in messages:
        item = dict(m)
        content = m["content"]
        if isinstance(content, str):
            item["content"] = mark(content)
        elif content is not None:
            item["content"] = [{**p, "text": mark(p["text"])} if p["type"] == "text" else p for p in content]
        if "reasoning_content" in m:
            item["reasoning_content"] = mark(m["reasoning_content"])
        out.append(item)
    return out


def template_texts(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None) -> list[str]:
    """The caller's text that templates write as they are, not as content: roles, tool calls and
    tool definitions. None of it may hold special-token text."""
    parts = [m["role"] for m in messages]
    for m in messages:
        for call in m.get("tool_calls", ()):
            arguments = call["function"]["arguments"]
            parts += [call["function"]["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)]
    if tools:
        parts.append(json.dumps(tools, ensure_ascii=False))
    return parts


def tools_as_text(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]], *, first: bool,
                  json_calls: bool = True) -> list[dict[str, Any]]:
    """Messages for a template without a place for tools: (``first``: the conversation's first
    turn) the tools described in the system message; with ``json_calls`` (a template that cannot
    write calls either) told to answer a call in JSON, and earlier calls written so in their
    message."""
    out = []
    for message in messages:
        if json_calls and message.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _object(c["function"]["arguments"])}
                     for c in message["tool_calls"]]
            text = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            content = message["content"] if isinstance(message["content"], str) else ""
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = (content + "\n" + text).strip()
        out.append(message)
    if first:
        told = describe(tools, json_calls=json_calls)
        if out and out[0]["role"] == "system" and isinstance(out[0]["content"], str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + told}
        else:
            out.insert(0, {"role": "system", "content": told})
    return out


def _object(arguments: Any) -> Any:
    """Tool call arguments as an object (given as JSON text or as one)."""
    return json.loads(arguments) if isinstance(arguments, str) else arguments
