"""The chat completions body: messages, tools, the template's switches, and an assistant message
to continue, validated into a :class:`~aiollama.server.neutral_request.ChatRequest` or an OpenAI-style 400."""

from __future__ import annotations

from typing import Any

from aiollama.errors import InvalidRequestError
from aiollama.formats.toolcalls import tool_names
from aiollama.server.bad_request import BadRequest
from aiollama.server.neutral_request import MAX_TOOLS, REASONING_EFFORTS, ChatRequest, checked, json_object
from aiollama.server.openai_request import CHAT_FIELDS, REASONING_FORMATS, common_request, names_of


def chat_request(body: Any) -> ChatRequest:
    """``/v1/chat/completions``: ``messages`` with string content, or text parts."""
    body = json_object(body, CHAT_FIELDS)
    request = common_request(body, default_max_tokens=None)  # until the model ends its turn
    chat_switches(body, request)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest("'logprobs' must be a boolean", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None and not logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if logprobs:
        request.params.update(logprobs=True, top_logprobs=0 if top is None else top)
    checked(request.params, {**names_of(body), "top_logprobs": "top_logprobs"})
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise BadRequest("'tools' must be a list of tool objects", param="tools")
        if len(tools) > MAX_TOOLS:
            raise BadRequest(f"at most {MAX_TOOLS} tools", param="tools")
        try:
            tool_names(tools)
        except InvalidRequestError as exc:
            raise BadRequest(str(exc), param="tools") from None
        request.tools = tools or None
    if "tool_choice" in body:
        request.tool_choice = body["tool_choice"]
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image_url", ...}]
            content = _parts(content, f"messages[{i}].content")
        if content is None:
            content = ""
        if not isinstance(content, (str, list)):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts", param=f"messages[{i}].content")
        item = {"role": message["role"], "content": content}
        for key in ("tool_calls", "tool_call_id", "name", "reasoning_content"):
            if message.get(key) is not None:
                item[key] = message[key]
        if message.get("content") is None and item.get("tool_calls"):
            item["content"] = None  # as the template sees a call without text
        out.append(item)
    request.messages = out
    prefill(body, request)
    return request


def chat_switches(body: dict[str, Any], request: ChatRequest) -> None:
    """The template's variables and switches of a chat body: ``chat_template_kwargs``,
    ``reasoning_effort``, llama-server's ``reasoning_format``, ``parallel_tool_calls``."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    request.template_kwargs = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise BadRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning_effort")
    request.reasoning_effort = effort
    form = body.get("reasoning_format")
    if form is not None and form not in REASONING_FORMATS:
        raise BadRequest(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}", param="reasoning_format")
    request.reasoning_format = form
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    request.parallel_tool_calls = parallel


def prefill(body: dict[str, Any], request: ChatRequest) -> None:
    """``continue_final_message`` and ``add_generation_prompt`` (vLLM's and llama-server's): a chat
    whose last message is the assistant's is continued, as llama-server's assistant prefill."""
    messages = request.messages or []
    add = body.get("add_generation_prompt")
    go_on = body.get("continue_final_message")
    for name, value in (("add_generation_prompt", add), ("continue_final_message", go_on)):
        if value is not None and not isinstance(value, bool):
            raise BadRequest(f"'{name}' must be a boolean", param=name)
    last_is_reply = bool(messages) and messages[-1]["role"] == "assistant"
    if go_on is None:
        go_on = last_is_reply and add is not True
    if go_on and add:
        raise BadRequest("'add_generation_prompt' and 'continue_final_message' cannot both be true",
                         param="continue_final_message")
    if add is False and not go_on:
        raise BadRequest("'add_generation_prompt': false needs a final assistant message to continue",
                         param="add_generation_prompt")
    if go_on:
        if not last_is_reply:
            raise BadRequest("'continue_final_message' needs the last message to be the assistant's",
                             param="continue_final_message")
        if len(messages) > 1 and messages[-2]["role"] == "assistant":
            raise BadRequest("cannot have 2 or more assistant messages at the end of the list", param="messages")
        if messages[-1].get("tool_calls"):
            raise BadRequest("an assistant message with tool calls cannot be continued", param="messages")
    request.continue_final_message = bool(go_on)


def _parts(content: list[Any], where: str) -> str | list[dict[str, Any]]:
    """A content list: its text, or (with pictures) the parts, each image_url's URL checked."""
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("text", "image_url"):
            raise BadRequest(f"{where}[{j}]: a part is text or image_url", param=f"{where}[{j}]")
        if p["type"] == "text" and not isinstance(p.get("text"), str):
            raise BadRequest(f"{where}[{j}].text must be a string", param=f"{where}[{j}]")
        if p["type"] == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith(("data:", "http://", "https://")):
                raise BadRequest(f"{where}[{j}].image_url.url must be a data:, http: or https: URL",
                                 param=f"{where}[{j}].image_url")
            content[j] = {"type": "image_url", "image_url": {"url": url}}
    if all(p["type"] == "text" for p in content):
        return "".join(p["text"] for p in content)
    return content
