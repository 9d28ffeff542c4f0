"""llama-server's own request fields: its native ``/completion`` and ``/infill`` bodies, and the
llama.cpp fields its OpenAI routes take besides OpenAI's (``n_predict``, ``n_probs``, ``id_slot``,
``timings_per_token``, ``return_progress``, ``verbose``). Each is honoured, mapped to what aiollama
has, or refused with a 400 that names it; none is dropped. docs/llama-server.md lists them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from aiollama.sampling import MAX_TOP_LOGPROBS, wrap_seed
from aiollama.server.bad_request import BadRequest
from aiollama.server.neutral_request import MAX_STOP, checked, integer_field, number_field
from aiollama.server.openai_request import MAX_PROMPTS, lora_list

# Samplers of llama-server's that aiollama does not have: taken at the value that turns them off
# (the documented default), refused otherwise.
OFF = {"dynatemp_range": 0.0, "xtc_probability": 0.0, "mirostat": 0, "dry_multiplier": 0.0, "top_n_sigma": -1.0,
       "min_keep": 0, "n_indent": 0, "n_cache_reuse": 0, "t_max_predict_ms": 0, "post_sampling_probs": False,
       "n_discard": 0, "adaptive_target": -1.0}
# ... and what only tunes such a sampler: any value, since it changes nothing while it is off
TUNING = ("dynatemp_exponent", "xtc_threshold", "mirostat_tau", "mirostat_eta", "dry_base", "dry_allowed_length",
          "dry_penalty_last_n", "dry_sequence_breakers", "adaptive_decay")
# the order llama-server applies samplers in; a request may name a subset, in this order
SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
ALIASES = {"typical_p": "typ_p", "typical": "typ_p", "top-k": "top_k", "top-p": "top_p", "min-p": "min_p",
           "temp": "temperature"}

NATIVE_FIELDS = frozenset({
    "prompt", "temperature", "top_k", "top_p", "min_p", "typical_p", "n_predict", "max_tokens", "n_keep", "n_cmpl",
    "stream", "stop", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "grammar",
    "json_schema", "seed", "ignore_eos", "logit_bias", "n_probs", "id_slot", "cache_prompt", "return_tokens",
    "samplers", "timings_per_token", "return_progress", "response_fields", "lora", *OFF, *TUNING,
    "model", "cache_salt", "priority",
})
INFILL_FIELDS = NATIVE_FIELDS | {"input_prefix", "input_suffix", "input_extra"}


@dataclass
class Native:
    """What llama.cpp's fields of a request ask for, besides the stream parameters."""

    params: dict[str, Any] = field(default_factory=dict)  # stream parameters
    n_probs: int = 0
    stream: bool = False
    return_tokens: bool = False
    timings_per_token: bool = False
    return_progress: bool = False
    verbose: bool = False
    response_fields: list[str] | None = None
    n_cmpl: int = 1
    samplers: list[str] | None = None  # as the request named them
    fresh: bool = False  # cache_prompt false: no prefix of the cache is reused
    settings: dict[str, Any] = field(default_factory=dict)  # the request's own values, for generation_settings
    lora: list[tuple[str | int, float]] = field(default_factory=list)  # adapters by name or index, scales
    cache_salt: str | None = None  # shares cached cells only with requests of the same salt


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return value


def llama_fields(body: dict[str, Any], *, n_slots: int) -> Native:
    """The llama.cpp fields that the OpenAI routes take as llama-server does."""
    out = Native(n_probs=integer_field(body, "n_probs", 0, MAX_TOP_LOGPROBS) or 0,
                 timings_per_token=_flag(body, "timings_per_token"), return_progress=_flag(body, "return_progress"),
                 verbose=_flag(body, "verbose"))
    n_predict = integer_field(body, "n_predict", -1, 2**31 - 1)
    if n_predict is not None:  # 0 samples one token, as llama-server does
        out.params["max_tokens"] = None if n_predict < 0 else max(1, n_predict)
    integer_field(body, "id_slot", -1, n_slots - 1)  # every slot shares one prefix cache here: any is the same
    if out.return_progress or out.timings_per_token:  # the progress chunks are what timings count from
        out.params["prompt_progress"] = True
    if out.n_probs:
        out.params.update(logprobs=True, top_logprobs=out.n_probs)
    return out


def native_request(body: dict[str, Any], *, n_slots: int, tokenize: Any) -> Native:
    """A ``/completion`` or ``/infill`` body's sampling and answer options (llama-server's defaults:
    temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, no length limit). ``tokenize`` makes token
    ids of a ``logit_bias`` given as text."""
    for name, off in OFF.items():
        if name in body and body[name] != off and not (name == "top_n_sigma" and number_field(body, name) is not None
                                                        and float(body[name]) <= 0):
            raise BadRequest(f"'{name}' is not supported by this server (its sampler is not there); "
                             f"leave it at {off!r}", param=name, code="unsupported_parameter")
    native = llama_fields(body, n_slots=n_slots)
    params = native.params
    temperature = body.get("temperature")
    if temperature is not None:  # below 0: greedy
        params["temperature"] = max(0.0, temperature) if isinstance(temperature, (int, float)) else temperature
    for name in ("top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None:
            params[name] = 1.0 if name == "repeat_penalty" and value == 0 else value  # llama-server's 0: off
    top_k = body.get("top_k")
    if top_k is not None:  # 0 or less: the whole vocabulary
        params["top_k"] = max(0, top_k) if isinstance(top_k, int) and not isinstance(top_k, bool) else top_k
    last_n = integer_field(body, "repeat_last_n", -1)
    if last_n is not None:
        params["penalty_last_n"] = last_n
    n_keep = integer_field(body, "n_keep", -1)
    if n_keep is not None and n_keep >= 0:
        params["n_keep"] = n_keep
    if "n_predict" not in body:
        n_predict = integer_field(body, "max_tokens", -1, 2**31 - 1)
        if n_predict is not None:
            params["max_tokens"] = None if n_predict < 0 else max(1, n_predict)
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise BadRequest("'seed' must be an integer", param="seed")
        if seed != -1 and seed != 2**32 - 1:  # -1 (or its unsigned form): a random seed
            params["seed"] = wrap_seed(seed)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4 * MAX_STOP:
            raise BadRequest("'stop' must be a list of non-empty strings", param="stop")
        if stops:
            params["stop"] = stops
    for name in ("grammar", "json_schema"):
        value = body.get(name)
        if value is not None:
            if (name == "grammar" and not isinstance(value, str)) or (name == "json_schema" and not isinstance(value, dict)):
                raise BadRequest(f"'{name}' must be a {'string' if name == 'grammar' else 'JSON object'}", param=name)
            if value != "":
                params[name] = value
    if _flag(body, "ignore_eos"):
        params["ignore_eos"] = True
    bias = logit_bias(body.get("logit_bias"), tokenize)
    if bias:
        params["logit_bias"] = bias
    native.samplers = _samplers(body.get("samplers"), params)
    native.stream = _flag(body, "stream")
    native.return_tokens = _flag(body, "return_tokens")
    native.fresh = body.get("cache_prompt", True) is False
    if not isinstance(body.get("cache_prompt", True), bool):
        raise BadRequest("'cache_prompt' must be a boolean", param="cache_prompt")
    native.n_cmpl = integer_field(body, "n_cmpl", 1, 16) or 1
    fields = body.get("response_fields")
    if fields is not None:
        if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
            raise BadRequest("'response_fields' must be a list of field names", param="response_fields")
        native.response_fields = fields
    native.settings = {k: body[k] for k in body if k in TUNING}
    native.lora = lora_list(body.get("lora"))
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("'cache_salt' must be a non-empty string", param="cache_salt")
    native.cache_salt = salt
    priority = integer_field(body, "priority", -(2**31), 2**31 - 1)  # vLLM's: lower values first
    if priority is not None:
        params["priority"] = priority
    checked(params, {"max_tokens": "n_predict" if "n_predict" in body else "max_tokens", "top_logprobs": "n_probs",
                     "penalty_last_n": "repeat_last_n"})
    return native


def logit_bias(value: Any, tokenize: Any) -> dict[int, float]:
    """llama-server's ``logit_bias``: ``[[token or text, bias or false], ...]`` or ``{"token": bias}``;
    a text biases each of its tokens, ``false`` bans the token."""
    if value is None or value == [] or value == {}:
        return {}
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, list):
        raise BadRequest("'logit_bias' must be a list of [token, bias] pairs or an object", param="logit_bias")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise BadRequest("'logit_bias' pairs are [token or text, bias]", param="logit_bias")
        key, bias = pair
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
            raise BadRequest("a 'logit_bias' bias is a number or false", param="logit_bias")
        if isinstance(key, str) and key.lstrip("-").isdigit() and isinstance(value, dict):
            tokens = [int(key)]
        elif isinstance(key, str):
            tokens = tokenize(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            tokens = [key]
        else:
            raise BadRequest("a 'logit_bias' token is an id or a text", param="logit_bias")
        for token in tokens:
            if token < 0:
                raise BadRequest(f"'logit_bias' token {token} is not a token id", param="logit_bias")
            out[token] = max(-1e30, float(bias))
    return out


def _samplers(value: Any, params: dict[str, Any]) -> list[str] | None:
    """llama-server's ``samplers``: those named run, in its order; the others are off."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest("'samplers' must be a list of sampler names", param="samplers")
    names = [str(ALIASES.get(s, s)) for s in value]
    unknown = [s for s in names if s not in SAMPLERS]
    if unknown:
        raise BadRequest(f"unknown sampler {unknown[0]!r}; these are: {', '.join(SAMPLERS)}", param="samplers")
    order = [SAMPLERS.index(s) for s in names]
    if order != sorted(set(order)):
        raise BadRequest(f"samplers run in this order here: {', '.join(SAMPLERS)}; name a subset of them in it",
                         param="samplers", code="unsupported_parameter")
    off = {"penalties": ("repeat_penalty", 1.0), "top_k": ("top_k", 0), "typ_p": ("typical_p", 1.0),
           "top_p": ("top_p", 1.0), "min_p": ("min_p", 0.0)}
    for name, (key, value_off) in off.items():
        if name not in names:
            params[key] = value_off
            if name == "penalties":
                params.update(presence_penalty=0.0, frequency_penalty=0.0)
    if "temperature" not in names:
        params["temperature"] = 1.0
    return names


def native_prompts(value: Any, tokenize: Any, check_token: Any, limit: int = MAX_PROMPTS) -> list[list[int]]:
    """llama-server's ``prompt``: a text, token ids, a list mixing both (one prompt), an object
    ``{"prompt_string": ...}``, or a list of those (several prompts). Text is tokenized with its
    special tokens parsed, the first part with BOS where the model takes one (``tokenize(text,
    add_special)``)."""
    if isinstance(value, list) and value and not any(isinstance(p, int) and not isinstance(p, bool) for p in value):
        if len(value) > limit:
            raise BadRequest(f"'prompt' holds {len(value)} prompts; at most {limit} a request", param="prompt")
        return [_one_prompt(p, tokenize, check_token, f"prompt[{i}]") for i, p in enumerate(value)]
    return [_one_prompt(value, tokenize, check_token, "prompt")]


def _one_prompt(value: Any, tokenize: Any, check_token: Any, where: str) -> list[int]:
    if isinstance(value, dict):
        if "multimodal_data" in value:
            raise BadRequest(f"'{where}.multimodal_data' is not supported by this server: send pictures as "
                             "image parts to /v1/chat/completions", param=f"{where}.multimodal_data",
                             code="unsupported_parameter")
        value = value.get("prompt_string")
        if not isinstance(value, str):
            raise BadRequest(f"'{where}.prompt_string' must be a string", param=where)
    tokens: list[int]
    if isinstance(value, str):
        tokens = tokenize(value, True)
    elif isinstance(value, list):
        tokens = []
        for i, part in enumerate(value):
            if isinstance(part, str):
                tokens += tokenize(part, i == 0)
            elif isinstance(part, int) and not isinstance(part, bool):
                tokens.append(check_token(part))
            else:
                raise BadRequest(f"'{where}' parts are texts or token ids", param=where)
    else:
        raise BadRequest(f"'{where}' must be a string, token ids, or a list of them", param=where)
    if not tokens:
        raise BadRequest(f"'{where}' is empty", param=where)
    return tokens
