"""OpenAI request bodies: validated into what the engine takes, or an OpenAI-style 400."""

from __future__ import annotations

import math
import uuid
from typing import Any

from aiollama.server.bad_request import BadRequest
from aiollama.server.neutral_request import ChatRequest, checked, integer_field, json_object, sampling_fields

MAX_N = 16
MAX_INPUTS = 2048  # texts of one embeddings request (OpenAI's limit)
MAX_PROMPTS = 64  # generations of one native completion request: its prompts times n_cmpl


OPENAI_CEILINGS = {"temperature": 2.0}  # OpenAI's own bound; every other range is SamplingParams'
NAMES = {"top_logprobs": "logprobs"}  # a legacy completion's ``logprobs`` is its number of alternatives


def openai_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields of an OpenAI body in their neutral names (``max_completion_tokens`` over
    ``max_tokens``, ``response_format`` as a JSON schema), unchecked: the codec checks them once."""
    fields = dict(body)
    if body.get("max_completion_tokens") is not None:
        fields["max_tokens"] = body["max_completion_tokens"]
    response_format = body.get("response_format")
    if response_format is not None:
        schema = _response_format(response_format)
        if schema is not None:
            if body.get("grammar") is not None or body.get("json_schema") is not None:
                raise BadRequest("give either response_format or grammar/json_schema", param="response_format")
            fields["json_schema"] = schema
    return sampling_fields(fields, OPENAI_CEILINGS)


def names_of(body: dict[str, Any]) -> dict[str, str]:
    """The body's name of each sampling parameter where it is not the neutral one."""
    names = dict(NAMES)
    if body.get("max_completion_tokens") is not None:
        names["max_tokens"] = "max_completion_tokens"
    if body.get("response_format") is not None:
        names["json_schema"] = "response_format"
    return names


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
REASONING_FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


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


def common_request(body: dict[str, Any], default_max_tokens: int | None) -> ChatRequest:
    """The fields chat and legacy completions share; the sampling is checked by the caller, once,
    with :func:`names_of` the body."""
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
    params = openai_sampling(body)
    if body.get("ignore_eos"):
        params["ignore_eos"] = True
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("'cache_salt' must be a non-empty string", param="cache_salt")
    if body.get("cache_prompt") is False and salt is None:
        salt = uuid.uuid4().hex  # llama-server's cache_prompt false: no cached prefix is shared
    scored = integer_field(body, "prompt_logprobs", 0)
    if scored is not None:
        params["prompt_logprobs"] = scored
    return ChatRequest(n=n or 1, stream=stream, include_usage=options.get("include_usage", False),
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


def completion_request(body: Any) -> ChatRequest:
    """``/v1/completions``: ``prompt`` is a string or a list of token ids."""
    body = json_object(body, COMPLETION_FIELDS)
    request = common_request(body, default_max_tokens=16)  # OpenAI's default for completions
    logprobs = integer_field(body, "logprobs", 0)  # the legacy API: how many alternatives
    if logprobs is not None:
        request.params.update(logprobs=True, top_logprobs=logprobs)
    checked(request.params, names_of(body))
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
