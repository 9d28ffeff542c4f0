"""OpenAI Responses API request bodies: validated into chat messages, tools and sampling, or a 400.

Input items become chat messages: a string is one user message; ``message`` items keep their role
(their ``input_text`` / ``output_text`` parts joined); ``function_call`` items become an assistant
message's ``tool_calls``; ``function_call_output`` items become ``tool`` messages. Function tools
come flat (``{"type": "function", "name", "parameters"}``) and are given to the engine in the chat
shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiollama.server.bad_request import BadRequest
from aiollama.server.neutral_request import (
    REASONING_EFFORTS,
    ChatRequest,
    checked,
    json_object,
    sampling_fields,
    tool_list,
)
from aiollama.server.openai_request import OPENAI_CEILINGS

RESPONSE_FIELDS = frozenset({
    "model", "input", "instructions", "previous_response_id", "store", "stream", "max_output_tokens",
    "temperature", "top_p", "tools", "tool_choice", "text", "parallel_tool_calls", "metadata", "user",
    "seed", "top_k", "min_p", "repeat_penalty", "stop", "truncation", "include", "reasoning", "background",
})


@dataclass
class ResponsesRequest(ChatRequest):
    """The neutral request, and what only a response keeps: the turn it continues, its
    instructions, whether it is stored, and the request fields it repeats."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    previous_response_id: str | None = None
    instructions: str | None = None
    store: bool = True
    background: bool = False  # run detached from the connection, to be polled, rejoined or cancelled
    echo_fields: dict[str, Any] = field(default_factory=dict)  # request fields the response repeats


NAMES = {"max_tokens": "max_output_tokens", "json_schema": "text.format"}


def responses_request(body: Any) -> ResponsesRequest:
    """``/v1/responses``."""
    body = json_object(body, RESPONSE_FIELDS)
    for name, allowed in (("truncation", ("disabled", None)), ("parallel_tool_calls", (True, None))):
        if body.get(name) not in allowed:
            raise BadRequest(f"'{name}' {body[name]!r} is not supported by this server", param=name,
                             code="unsupported_parameter")
    if body.get("include") not in (None, []):
        raise BadRequest("'include' is not supported by this server", param="include", code="unsupported_parameter")
    fields = {k: body[k] for k in ("temperature", "top_p", "seed", "top_k", "min_p", "repeat_penalty", "stop")
              if k in body}  # same names
    if "max_output_tokens" in body:
        fields["max_tokens"] = body["max_output_tokens"]
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or not isinstance(text.get("format", {}), dict):
            raise BadRequest("'text' must be an object with a 'format' object", param="text")
        fmt = text.get("format") or {"type": "text"}
        if fmt.get("type") == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise BadRequest("text.format.schema must be a JSON object", param="text.format.schema")
            fields["json_schema"] = fmt["schema"]
        elif fmt.get("type") == "json_object":
            fields["json_schema"] = {"type": "object"}
        elif fmt.get("type") != "text":
            raise BadRequest("text.format.type must be 'text', 'json_object' or 'json_schema'", param="text.format")
    params = checked(sampling_fields(fields, OPENAI_CEILINGS), NAMES)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise BadRequest("'store' must be a boolean", param="store")
    background = body.get("background", False)
    if not isinstance(background, bool):
        raise BadRequest("'background' must be a boolean", param="background")
    if background and not store:
        raise BadRequest("a background response must be stored: 'background' needs 'store': true", param="background")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise BadRequest("'previous_response_id' must be a string", param="previous_response_id")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    effort = _effort(body.get("reasoning"))
    messages = input_messages(body.get("input"))
    if instructions:  # this turn's instructions (a continuation does not inherit earlier ones)
        messages = [{"role": "system", "content": instructions}, *messages]
    tools = tool_list(body.get("tools"), _tool)
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "text": text or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
            "store": store, "previous_response_id": previous, "parallel_tool_calls": True,
            "reasoning": {"effort": effort, "summary": None}, "background": background}
    return ResponsesRequest(messages=messages, params=params, stream=stream, tools=tools, tool_choice=choice,
                            reasoning_effort=effort, effort_param="reasoning.effort", previous_response_id=previous,
                            instructions=instructions, store=store, background=background, echo_fields=echo)


def _effort(value: Any) -> str | None:
    """``reasoning.effort``, for a template that reads ``reasoning_effort``; summaries are not made."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"effort", "summary", "generate_summary"}:
        raise BadRequest("'reasoning' must be an object of 'effort' (and 'summary')", param="reasoning")
    if value.get("summary") is not None or value.get("generate_summary") is not None:
        raise BadRequest("reasoning summaries are not made by this server; the reasoning comes whole",
                         param="reasoning.summary", code="unsupported_parameter")
    effort = value.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise BadRequest(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning.effort")
    return effort


def _text(content: Any, where: str) -> Any:
    """A message's text, or with pictures (``input_image`` parts) the chat API's content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        parts = []
        for j, p in enumerate(content):
            url = p.get("image_url")
            if p.get("type") in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": p["text"]})
            elif p.get("type") == "input_image" and isinstance(url, str) and url.startswith(("data:", "http")):
                parts.append({"type": "image_url", "image_url": {"url": url}})
            else:
                raise BadRequest(f"{where}.content[{j}]: a part is text or input_image (with image_url; "
                                 "file_id is not supported)", param=f"{where}.content[{j}]")
        return parts
    raise BadRequest(f"{where}.content must be a string or a list of text and image parts", param=f"{where}.content")


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The chat messages of ``input``."""
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("'input' must be a non-empty string or list of items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item.get("role"), str):
            out.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output, where)})
        else:
            raise BadRequest(f"{where} must be a message, function_call or function_call_output item", param=where)
    return out


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """A flat function tool in the chat shape."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise BadRequest(f"tools[{i}]: only function tools ({{'type': 'function', 'name': ...}}) are "
                         f"supported, not {kind!r}", param=f"tools[{i}]", code="unsupported_parameter")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}
