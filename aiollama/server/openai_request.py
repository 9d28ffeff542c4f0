"""OpenAI request bodies: validated into what the engine takes, or an OpenAI-style 400."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiollama.sampling import wrap_seed

MAX_N = 16
MAX_STOP = 4
MAX_INPUTS = 2048  # texts of one embeddings request (OpenAI's limit)
MAX_PROMPTS = 64  # generations of one native completion request: its prompts times n_cmpl


# llama-server's error types by status (its native endpoints answer them with the status as code)
LLAMA_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                     501: "not_supported_error", 503: "unavailable_error"}


class BadRequest(Exception):
    """A request the API refuses: its status, message, parameter and OpenAI error code; ``extra``
    fields go into the error object (llama-server's ``n_prompt_tokens`` and ``n_ctx`` of a prompt
    that does not fit)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        kind = "authentication_error" if self.status == 401 else \
            "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code,
                          **self.extra}}

    def llama_body(self) -> dict[str, Any]:
        """llama-server's error object, for its native endpoints."""
        kind = "exceed_context_size_error" if self.code == "context_length_exceeded" else \
            LLAMA_ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"code": self.status, "message": self.message, "type": kind, **self.extra}}


@dataclass
class Request:
    """One completion request: the prompt (text, token ids or chat messages), how to sample, and
    what to answer with (log-probabilities, tool calls)."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    obfuscate: bool = False  # stream_options.include_obfuscation: chunks padded to random lengths
    params: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "auto"
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # for the chat template
    reasoning_effort: str | None = None
    reasoning_format: str | None = None  # None: the server's
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    cache_salt: str | None = None  # shares cached cells only with requests of the same salt
    echo: bool = False  # legacy completions: the prompt comes back before the completion
    prompt_logprobs: int | None = None  # vLLM's: the prompt's tokens scored, in the response
    lora: list[tuple[str | int, float]] = field(default_factory=list)  # adapters by name or index, scales
    defaults: dict[str, Any] = field(default_factory=dict)  # the API's own, under the server's (--temp, -n)
    suffix: str | None = None  # legacy completions: the text after the completion (fill-in-the-middle)
    llama: Any = None  # llama.cpp's fields (native_request.Native), set by the route

    def chat_options(self) -> dict[str, Any]:
        """What ``Conversation.append_chat`` takes besides the messages."""
        options = {"tools": self.tools, "tool_choice": self.tool_choice, "chat_template_kwargs": self.template_kwargs,
                   "reasoning_effort": self.reasoning_effort, "parallel_tool_calls": self.parallel_tool_calls,
                   "continue_final_message": self.continue_final_message}
        if self.reasoning_format is not None:
            options["reasoning_format"] = self.reasoning_format
        return options


def number_field(body: dict[str, Any], name: str, low: float = -math.inf, high: float = math.inf) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number in [{low}, {high}], got {value!r}", param=name)
    return float(value)


def integer_field(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise BadRequest(f"'{name}' must be an integer {bound}, got {value!r}", param=name)
    return value


# the numbers of the sampling fields, as OpenAI bounds them (llama-server's: top_k, min_p, repeat_penalty)
RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
          "frequency_penalty": (-2.0, 2.0), "top_k": (0.0, math.inf), "min_p": (0.0, 1.0), "repeat_penalty": (0.0, 10.0)}


def sampling_fields(body: dict[str, Any], ranges: dict[str, tuple[float, float]] = RANGES) -> dict[str, Any]:
    """The sampling parameters of a body whose fields bear their neutral names (``max_tokens``,
    ``temperature``, ``stop``...), each checked once, in ``ranges`` (OpenAI's by default); a 400
    names the field."""
    params: dict[str, Any] = {}
    max_tokens = integer_field(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = integer_field(body, "max_tokens", 1)
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    for name, (low, high) in ranges.items():  # temperature... then llama-server's extensions
        value = integer_field(body, name, int(low)) if name == "top_k" else number_field(body, name, low, high)
        if value is not None:
            if value == 0.0 and name in ("top_p", "repeat_penalty"):
                raise BadRequest(f"'{name}' must be > 0", param=name)
            params[name] = value
    for name in ("grammar", "json_schema"):
        value = body.get(name)
        if value is not None:
            if (name == "grammar" and not isinstance(value, str)) or (name == "json_schema" and not isinstance(value, dict)):
                raise BadRequest(f"'{name}' must be a {'string' if name == 'grammar' else 'JSON object'}", param=name)
            params[name] = value
    response_format = body.get("response_format")
    if response_format is not None:
        schema = _response_format(response_format)
        if schema is not None:
            if "grammar" in params or "json_schema" in params:
                raise BadRequest("give either response_format or grammar/json_schema", param="response_format")
            params["json_schema"] = schema
    seed = integer_field(body, "seed", -(2**63))
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
    priority = integer_field(body, "priority", -(2**31), 2**31 - 1)  # vLLM's extension: lower values first
    if priority is not None:
        params["priority"] = priority
    budget = integer_field(body, "reasoning_budget", 0)  # tokens of thinking before the engine closes the block
    if budget is not None:
        params["reasoning_budget"] = budget
    message = body.get("reasoning_budget_message")
    if message is not None:
        if not isinstance(message, str) or budget is None:
            raise BadRequest("'reasoning_budget_message' must be a string, given with 'reasoning_budget'",
                             param="reasoning_budget_message")
        params["reasoning_budget_message"] = message
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            params["logit_bias"] = {int(k): float(v) for k, v in dict(bias).items()}
        except (TypeError, ValueError):
            raise BadRequest("'logit_bias' must map token ids to numbers", param="logit_bias") from None
    return params


def _response_format(value: Any) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` asks for (None: plain text)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":  # llama-server's: a "schema" beside it constrains the object further
        schema = value.get("schema")
        if schema is None:
            return {"type": "object"}
        if not isinstance(schema, dict):
            raise BadRequest("response_format.schema must be a JSON object", param="response_format.schema")
        return schema
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format.json_schema.schema must be a JSON object",
                             param="response_format.json_schema.schema")
        return schema
    raise BadRequest("response_format.type must be 'text', 'json_object' or 'json_schema'", param="response_format")


UNSUPPORTED = ("functions",)  # refused rather than ignored: the answer would differ
# llama.cpp's fields that llama-server's OpenAI routes take besides OpenAI's (native_request.llama_fields)
LLAMA_FIELDS = ("n_predict", "n_probs", "id_slot", "timings_per_token", "return_progress", "verbose")

# The fields each endpoint reads. Any other field is refused with a 400 naming it, never dropped.
COMMON_FIELDS = frozenset({
    "model", "n", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "presence_penalty", "frequency_penalty", "seed", "stop", "logit_bias", "response_format", "best_of",
    "top_k", "min_p", "repeat_penalty", "grammar", "json_schema", "priority", "ignore_eos", "cache_prompt",
    "reasoning_budget", "reasoning_budget_message", "cache_salt", "prompt_logprobs", "lora",
    *UNSUPPORTED, *LLAMA_FIELDS,
    "user", "metadata",  # informational: they change nothing in the answer
})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                               "chat_template_kwargs", "reasoning_effort", "reasoning_format", "continue_final_message",
                               "add_generation_prompt"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
REASONING_FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
MAX_TOOLS = 128


def tool_list(value: Any, convert: Callable[[int, Any], dict[str, Any]]) -> list[dict[str, Any]] | None:
    """A request's tools in the chat shape (None for none): a list of at most ``MAX_TOOLS``, each
    made by ``convert(index, tool)``, which raises BadRequest for one it cannot take."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    return [convert(i, tool) for i, tool in enumerate(value)]


def json_object(body: Any, known: frozenset[str]) -> dict[str, Any]:
    """``body`` as an endpoint's object: a 400 unless it is a JSON object, and one naming the first
    field the endpoint does not read."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"'{unknown[0]}' is not a field this server reads", param=unknown[0],
                         code="unsupported_parameter")
    return body


STREAM_OPTIONS = ("include_usage", "include_obfuscation")


def stream_options(value: Any, stream: bool) -> dict[str, bool]:
    """OpenAI's ``stream_options``: each key it defines, a boolean, and only with ``stream``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    if value and not stream:
        raise BadRequest("'stream_options' is only taken with 'stream': true", param="stream_options")
    for key, flag in value.items():
        if key not in STREAM_OPTIONS:
            raise BadRequest(f"'stream_options.{key}' is not an option this server reads "
                             f"({', '.join(STREAM_OPTIONS)})", param=f"stream_options.{key}",
                             code="unsupported_parameter")
        if not isinstance(flag, bool):
            raise BadRequest(f"'stream_options.{key}' must be a boolean", param=f"stream_options.{key}")
    return dict(value)


def common_request(body: dict[str, Any], default_max_tokens: int | None) -> Request:
    for name in UNSUPPORTED:
        value = body.get(name)
        if value not in (None, False, [], {}):
            raise BadRequest(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    if (body.get("best_of") or 1) != 1:
        raise BadRequest("'best_of' is not supported by this server; use 'n'", param="best_of",
                         code="unsupported_parameter")
    n = integer_field(body, "n", 1, MAX_N)
    for flag in ("ignore_eos", "cache_prompt"):  # llama-server's; every prompt is cached here anyway
        if not isinstance(body.get(flag, False), bool):
            raise BadRequest(f"'{flag}' must be a boolean", param=flag)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    options = stream_options(body.get("stream_options"), stream)
    params = sampling_fields(body)
    if body.get("ignore_eos"):
        params["ignore_eos"] = True
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("'cache_salt' must be a non-empty string", param="cache_salt")
    if body.get("cache_prompt") is False and salt is None:
        salt = uuid.uuid4().hex  # llama-server's cache_prompt false: no cached prefix is shared
    scored = integer_field(body, "prompt_logprobs", 0, 20)
    if scored is not None:
        params["prompt_logprobs"] = scored
    return Request(n=n or 1, stream=stream, include_usage=options.get("include_usage", False),
                   obfuscate=options.get("include_obfuscation", False), params=params,
                   cache_salt=salt, prompt_logprobs=scored, lora=lora_list(body.get("lora")),
                   defaults={"max_tokens": default_max_tokens})  # None: to the turn's end


def lora_list(value: Any) -> list[tuple[str | int, float]]:
    """llama-server's ``lora``: ``[{"id": index, "scale": s}]``, or ``{"name": ..., "scale": s}``."""
    bad = BadRequest("'lora' must be a list of {'id' or 'name', 'scale'} objects", param="lora")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise bad
    out: list[tuple[str | int, float]] = []
    for item in value:
        key, scale = item.get("name", item.get("id")), item.get("scale", 1.0)
        if isinstance(key, bool) or not isinstance(key, (str, int)) \
                or isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise bad
        out.append((key, float(scale)))
    return out


def completion_request(body: Any) -> Request:
    """``/v1/completions``: ``prompt`` is a string or a list of token ids."""
    body = json_object(body, COMPLETION_FIELDS)
    request = common_request(body, default_max_tokens=16)  # OpenAI's default for completions
    logprobs = integer_field(body, "logprobs", 0, 20)  # the legacy API: how many alternatives
    if logprobs is not None:
        request.params.update(logprobs=True, top_logprobs=logprobs)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest("'echo' must be a boolean", param="echo")
    request.echo = echo
    suffix = body.get("suffix")
    if suffix is not None:
        if not isinstance(suffix, str):
            raise BadRequest("'suffix' must be a string", param="suffix")
        if echo:
            raise BadRequest("'suffix' and 'echo' cannot be combined", param="suffix")
        request.suffix = suffix
    if echo and logprobs is not None:  # the prompt's tokens get log-probabilities too
        request.params["prompt_logprobs"] = max(logprobs, request.prompt_logprobs or 0)
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


def message_text(message: dict[str, Any]) -> str:
    """The text of a message's content (without its pictures)."""
    content = message.get("content") or ""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def embeddings_request(body: Any) -> tuple[Any, str]:
    """``/v1/embeddings``: the texts (or token id lists) and the encoding asked for."""
    body = json_object(body, EMBEDDING_FIELDS)
    value = body.get("input")
    tokens = isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    if isinstance(value, str) or tokens:
        value = [value]
    ok = isinstance(value, list) and bool(value) and (
        all(isinstance(t, str) and t for t in value)
        or all(isinstance(t, list) and t and all(isinstance(x, int) and not isinstance(x, bool) for x in t)
               for t in value))
    if not ok:
        raise BadRequest("'input' must be a non-empty string, a list of them, or token ids", param="input")
    if len(value) > MAX_INPUTS:
        raise BadRequest(f"'input' holds {len(value)} texts; at most {MAX_INPUTS} a request", param="input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise BadRequest("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    if body.get("dimensions") is not None:
        raise BadRequest("'dimensions' is not supported by this server", param="dimensions",
                         code="unsupported_parameter")
    return value, encoding
