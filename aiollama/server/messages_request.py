"""Anthropic Messages API request bodies: validated into chat messages, tools and sampling, or a 400.

``system`` becomes a system message. A user message's ``tool_result`` blocks become ``tool``
messages (in their order, before the message's text); an assistant message's ``tool_use`` blocks
become its ``tool_calls``. ``thinking`` blocks of earlier turns are accepted and left out of the
prompt, as Anthropic's API leaves them out. ``cache_control`` is accepted anywhere: every prompt
is cached here. ``thinking`` switches the template's ``enable_thinking`` and its ``budget_tokens``
bound the thinking block (the engine closes it); ``output_config.effort`` goes to a template that
reads ``reasoning_effort``, ``output_config.format`` constrains the reply to its JSON schema.
Blocks this server cannot read (images, documents, server tools) are refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiollama.server.bad_request import BadRequest
from aiollama.server.neutral_request import MAX_STOP, ChatRequest, checked, json_object, sampling_fields, tool_list

ANTHROPIC_CEILINGS = {"temperature": 1.0}  # the Messages API's temperature is in [0, 1]
NAMES = {"stop": "stop_sequences", "reasoning_budget": "thinking.budget_tokens", "json_schema": "output_config.format"}
INFORMATIONAL = ("metadata", "service_tier", "inference_geo", "user_profile_id", "workspace_id")  # change nothing here
MESSAGES_FIELDS = frozenset({
    "model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
    "tools", "tool_choice", "thinking", "output_config", "cache_control", "speed", *INFORMATIONAL,
})
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                          "cache_control"})


@dataclass
class MessagesRequest(ChatRequest):
    """The neutral request, and how a Messages reply shows its thinking."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    show_thinking: bool = True  # False: thinking blocks come back empty (display "omitted")


def messages_request(body: Any, *, count_only: bool = False) -> MessagesRequest:
    """``/v1/messages``, or ``/v1/messages/count_tokens`` (no sampling fields)."""
    body = json_object(body, COUNT_FIELDS if count_only else MESSAGES_FIELDS)
    if not isinstance(body.get("model"), str):
        raise BadRequest("'model' must be a string", param="model")
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    tools = tool_list(body.get("tools"), _tool)
    choice = _tool_choice(body.get("tool_choice"), tools)
    thinking, budget, show = _thinking(body.get("thinking"))
    schema, effort = _output_config(body.get("output_config"))
    cache = body.get("cache_control")
    if cache is not None and (not isinstance(cache, dict) or cache.get("type") != "ephemeral"):
        raise BadRequest("cache_control must be {'type': 'ephemeral'}", param="cache_control")
    prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    request = MessagesRequest(messages=messages, tools=tools, tool_choice=choice, thinking=thinking,
                              reasoning_effort=effort, effort_param="output_config.effort",
                              continue_final_message=prefill, show_thinking=show)
    if count_only:
        return request
    if body.get("speed", "standard") not in ("standard", None):
        raise BadRequest("'speed' 'fast' is not offered by this server", param="speed", code="unsupported_parameter")
    if body.get("max_tokens") is None:  # the Messages API asks for it; its value is checked once, below
        raise BadRequest("'max_tokens' is required", param="max_tokens")
    if body.get("service_tier", "auto") not in ("auto", "standard_only"):
        raise BadRequest("'service_tier' must be 'auto' or 'standard_only'", param="service_tier")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or len(stops) > MAX_STOP):
        raise BadRequest(f"'stop_sequences' must be a list of at most {MAX_STOP} non-empty strings",
                         param="stop_sequences")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    fields = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k") if k in body}  # same names
    if stops:
        fields["stop"] = stops
    if budget is not None:
        fields["reasoning_budget"] = budget
    if schema is not None:
        fields["json_schema"] = schema
    request.params = checked(sampling_fields(fields, ANTHROPIC_CEILINGS), NAMES)
    request.stream = stream
    return request


def _text_blocks(value: Any, where: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, block in enumerate(value):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                kind = block.get("type") if isinstance(block, dict) else None
                raise BadRequest(f"{where}[{i}]: only text blocks can be read here, not {kind!r}",
                                 param=f"{where}[{i}]", code="unsupported_parameter")
            texts.append(block["text"])
        return "".join(texts)
    raise BadRequest(f"{where} must be a string or a list of text blocks", param=where)


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None or value == "" or value == []:
        return []
    return [{"role": "system", "content": _text_blocks(value, "system")}]


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise BadRequest(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += (_user if role == "user" else _assistant)(content, f"{where}.content")
        else:
            raise BadRequest(f"{where}.content must be a string or a list of content blocks",
                             param=f"{where}.content")
    return out


def _blocks(blocks: list[Any], where: str) -> Iterator[tuple[Any, Any, str]]:
    """(type, block, where it is) of each content block."""
    for i, block in enumerate(blocks):
        yield (block.get("type") if isinstance(block, dict) else None), block, f"{where}[{i}]"


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    results, texts = [], []
    for kind, block, at in _blocks(blocks, where):
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "image":
            texts.append(_image(block, at))
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            content = block.get("content")
            text = "" if content is None else _text_blocks(content, f"{at}.content")
            if block.get("is_error", False) is True:
                text = "Error: " + text  # the model is told, in words, that the call failed
            elif block.get("is_error", False) is not False:
                raise BadRequest(f"{at}.is_error must be a boolean", param=f"{at}.is_error")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise BadRequest(f"{at}: a user message holds text, image and tool_result blocks here, not {kind!r}",
                             param=at, code="unsupported_parameter")
    # with pictures, the chat API's content parts
    parts: Any = ([t if isinstance(t, dict) else {"type": "text", "text": t} for t in texts]
                  if any(isinstance(t, dict) for t in texts) else "".join(texts))
    return results + ([{"role": "user", "content": parts}] if texts or not results else [])


def _image(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An image block as an image_url part: a base64 source becomes a data: URL."""
    source: Any = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str) and source["url"].startswith(("http://", "https://")):
        url = source["url"]
    else:
        raise BadRequest(f"{at}.source must be a base64 source (media_type, data) or a url source",
                         param=f"{at}.source")
    return {"type": "image_url", "image_url": {"url": url}}


def _assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts, calls = [], []
    for kind, block, at in _blocks(blocks, where):
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str) \
                and isinstance(block.get("input"), dict):
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier turns' thinking is not part of the prompt
        else:
            raise BadRequest(f"{at}: an assistant message holds text, tool_use and thinking blocks, not {kind!r}",
                             param=at, code="unsupported_parameter")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """A client tool in the chat shape."""
    ok = isinstance(tool, dict) and tool.get("type", "custom") == "custom" and isinstance(tool.get("name"), str) \
        and isinstance(tool.get("input_schema"), dict)
    if not ok:
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise BadRequest(f"tools[{i}]: only client tools ({{'name', 'input_schema'}}) are supported"
                         + (f", not {kind!r}" if kind not in (None, "custom") else ""),
                         param=f"tools[{i}]", code="unsupported_parameter")
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> Any:
    """The chat-shaped tool choice. A forced call ("any" or a named tool) is always one call, so
    ``disable_parallel_tool_use`` holds there; with "auto" it cannot be kept, and is refused."""
    if value is None:
        return "auto"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise BadRequest("tool_choice.type must be 'auto', 'any', 'tool' or 'none'", param="tool_choice")
    if value.get("disable_parallel_tool_use", False) is not False and kind == "auto":
        raise BadRequest("disable_parallel_tool_use with tool_choice 'auto' is not supported: a reply may make "
                         "several calls", param="tool_choice.disable_parallel_tool_use", code="unsupported_parameter")
    if kind != "none" and not tools and kind != "auto":
        raise BadRequest(f"tool_choice {kind!r} needs tools", param="tool_choice")
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise BadRequest("tool_choice of type 'tool' needs a 'name'", param="tool_choice.name")
        return {"type": "function", "function": {"name": value["name"]}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


def _thinking(value: Any) -> tuple[bool | None, int | None, bool]:
    """(thinking on or off, None: as the template does; its budget in tokens; whether its text is
    shown). "adaptive" leaves how long to think to the model."""
    if value is None:
        return None, None, True
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return False, None, True
    display = value.get("display") or "summarized"
    if display not in ("summarized", "omitted"):
        raise BadRequest("thinking.display must be 'summarized' or 'omitted'", param="thinking.display")
    if kind == "adaptive":
        return True, None, display == "summarized"
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise BadRequest("thinking.budget_tokens must be an integer >= 1", param="thinking.budget_tokens")
        return True, budget, display == "summarized"
    raise BadRequest("thinking.type must be 'enabled', 'adaptive' or 'disabled' here", param="thinking",
                     code="unsupported_parameter")


def _output_config(value: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(the JSON schema of ``format``, the ``effort``)."""
    if value is None:
        return None, None
    if not isinstance(value, dict) or set(value) - {"effort", "format"}:
        raise BadRequest("output_config must be an object of 'effort' and 'format'", param="output_config")
    effort = value.get("effort")
    if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
        raise BadRequest("output_config.effort must be 'low', 'medium', 'high', 'xhigh' or 'max'",
                         param="output_config.effort")
    fmt = value.get("format")
    if fmt is None:
        return None, effort
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise BadRequest("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                         param="output_config.format")
    return fmt["schema"], effort
