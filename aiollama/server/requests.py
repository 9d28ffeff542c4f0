"""OpenAI request bodies: validated into what the engine takes, or an OpenAI-style 400."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from aiollama.sampling import wrap_seed

MAX_N = 16
MAX_STOP = 4


class BadRequest(Exception):
    """A request the API refuses: its status, message, parameter and OpenAI error code."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """One completion request: the prompt (text, token ids or chat messages) and how to sample."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    params: dict[str, Any] = field(default_factory=dict)


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number in [{low}, {high}], got {value!r}", param=name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise BadRequest(f"'{name}' must be an integer {bound}, got {value!r}", param=name)
    return value


def _sampling(body: dict[str, Any], default_max_tokens: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    temperature = _number(body, "temperature", 0.0, 2.0)
    params["temperature"] = 1.0 if temperature is None else temperature
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p is not None:
        if top_p == 0.0:
            raise BadRequest("'top_p' must be in (0, 1]", param="top_p")
        params["top_p"] = top_p
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, -2.0, 2.0)
        if value is not None:
            params[name] = value
    seed = _integer(body, "seed", -(2**63))
    if seed is not None:
        params["seed"] = wrap_seed(seed)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
            raise BadRequest(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them",
                             param="stop")
        if stops:
            params["stop"] = stops
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            params["logit_bias"] = {int(k): float(v) for k, v in dict(bias).items()}
        except (TypeError, ValueError):
            raise BadRequest("'logit_bias' must map token ids to numbers", param="logit_bias") from None
    return params


UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "functions", "echo", "suffix", "response_format")


def _common(body: Any, default_max_tokens: int | None) -> Request:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in UNSUPPORTED:  # refused rather than silently ignored: the answer would not be what was asked
        value = body.get(name)
        if value not in (None, False, [], {}) and not (name == "response_format" and value == {"type": "text"}):
            raise BadRequest(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    if (body.get("best_of") or 1) != 1:
        raise BadRequest("'best_of' is not supported by this server; use 'n'", param="best_of",
                         code="unsupported_parameter")
    n = _integer(body, "n", 1, MAX_N)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    return Request(n=n or 1, stream=stream, include_usage=bool(options.get("include_usage")),
                   params=_sampling(body, default_max_tokens))


def completion_request(body: Any) -> Request:
    """``/v1/completions``: ``prompt`` is a string or a list of token ids."""
    request = _common(body, default_max_tokens=16)  # OpenAI's default for completions
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        request.prompt = list(prompt)
    else:
        raise BadRequest("'prompt' must be a non-empty string or list of token ids (one prompt per request)",
                         param="prompt")
    return request


def chat_request(body: Any) -> Request:
    """``/v1/chat/completions``: ``messages`` with string content, or text parts."""
    request = _common(body, default_max_tokens=None)  # until the model ends its turn
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported",
                                 param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        out.append({"role": message["role"], "content": content})
    request.messages = out
    return request
