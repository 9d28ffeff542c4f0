"""llama-server's own answer shapes: its native completion results (final and streamed), its
``timings``, ``completion_probabilities``, ``generation_settings`` and ``/props``, field for
field, so that the clients written for llama-server read aiollama's answers unchanged."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiollama import (
    FinishReason,
    GenerationStats,
    SamplingParams,
    TokenLogprob,
    __version__,
)

BUILD_INFO = f"aiollama-{__version__}"  # llama-server's build_info and system_fingerprint
RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a seed drawn at random
SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
DRY_BREAKERS = ["\n", ":", "\"", "*"]
# generation_settings' keys that /props leaves out of its default settings
NOT_IN_PROPS = ("dry_sequence_breakers", "stop", "logit_bias", "grammar", "grammar_lazy", "grammar_triggers",
                "preserved_tokens")
STOP_TYPES = {FinishReason.EOG: "eos", FinishReason.STOP: "word", FinishReason.LENGTH: "limit"}

TokenBytes = Callable[[int], bytes]


def _rate(n: int, ms: float) -> tuple[float, float]:
    """Milliseconds per token and tokens per second."""
    return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)


def timings_of(cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> dict[str, Any]:
    prompt_per_token, prompt_per_second = _rate(prompt_n, prompt_ms)
    per_token, per_second = _rate(predicted_n, predicted_ms)
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": prompt_per_token,
            "prompt_per_second": prompt_per_second, "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": per_token, "predicted_per_second": per_second}


@dataclass
class Clock:
    """One generation's ``timings`` as it streams (taken at the server, from its chunks) and at its
    end (from the engine's own measurements)."""

    started: float = field(default_factory=time.perf_counter)
    prompt: int = 0
    cached: int = 0
    evaluated: int = 0
    prompt_done: float = 0.0  # when the prompt's last part was evaluated
    first: float = 0.0  # when the first token came
    predicted: int = 0

    def progress(self, progress: tuple[int, int, int]) -> dict[str, Any]:
        """Record a progress chunk; llama-server's ``prompt_progress`` for it."""
        self.prompt, self.cached, self.evaluated = progress
        now = time.perf_counter()
        if self.evaluated >= self.prompt - 1:
            self.prompt_done = now
        return {"total": self.prompt, "cache": self.cached, "processed": self.evaluated,
                "time_ms": int((now - self.started) * 1e3)}

    def tokens(self, n: int) -> None:
        if n and not self.first:
            self.first = time.perf_counter()
        self.predicted += n

    def timings(self, stats: GenerationStats | None = None) -> dict[str, Any]:
        if stats is not None:
            return timings_of(stats.cached_tokens, max(0, stats.prompt_tokens - stats.cached_tokens),
                              stats.prefill_seconds * 1e3, self.predicted, stats.decode_seconds * 1e3)
        now = time.perf_counter()
        prompt_end = self.first or self.prompt_done or now
        return timings_of(self.cached, max(0, self.evaluated - self.cached), (prompt_end - self.started) * 1e3,
                          self.predicted, (now - self.first) * 1e3 if self.first else 0.0)


def probabilities(logprobs: Sequence[TokenLogprob], token_bytes: TokenBytes) -> list[dict[str, Any]]:
    """``completion_probabilities`` (and the ``logprobs.content`` of the OpenAI routes given
    ``n_probs``): each token with its id, text, bytes, log-probability and the most likely ones."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(token)
        return {"id": token, "token": raw.decode("utf-8", "replace"), "bytes": list(raw), "logprob": logprob}

    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]} for lp in logprobs]


def generation_settings(sp: SamplingParams, *, stream: bool, n_probs: int, samplers: Sequence[str] = SAMPLERS,
                        timings_per_token: bool = False, reasoning_format: str = "none", chat_format: str = "Content-only",
                        backend_sampling: bool = False, speculative: bool = False,
                        tuning: dict[str, Any] | None = None, lora: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """llama-server's ``generation_settings``: the request's effective sampling settings, those of
    samplers aiollama does not have at the values that turn them off."""
    n_predict = -1 if sp.max_tokens is None else sp.max_tokens
    grammar = sp.grammar or ""
    settings: dict[str, Any] = {
        "seed": RANDOM_SEED if sp.seed is None else sp.seed, "temperature": sp.temperature, "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0, "top_k": sp.top_k, "top_p": sp.top_p, "min_p": sp.min_p, "top_n_sigma": -1.0,
        "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": sp.typical_p, "repeat_last_n": sp.penalty_last_n,
        "repeat_penalty": sp.repeat_penalty, "presence_penalty": sp.presence_penalty,
        "frequency_penalty": sp.frequency_penalty, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
        "dry_penalty_last_n": -1, "dry_sequence_breakers": list(DRY_BREAKERS), "mirostat": 0, "mirostat_tau": 5.0,
        "mirostat_eta": 0.1, "adaptive_target": -1.0, "adaptive_decay": 0.9, "stop": list(sp.stop),
        "max_tokens": n_predict, "n_predict": n_predict, "n_keep": sp.n_keep or 0, "n_discard": 0,
        "ignore_eos": sp.ignore_eos, "stream": stream,
        "logit_bias": [{"bias": b, "token": t} for t, b in sp.logit_bias.items()], "n_probs": n_probs, "min_keep": 0,
        "grammar": grammar, "grammar_lazy": False, "grammar_triggers": [], "preserved_tokens": list(sp.preserved_tokens),
        "chat_format": chat_format, "reasoning_format": reasoning_format, "reasoning_in_content": False,
        "generation_prompt": "", "samplers": list(samplers), "speculative.types": "draft" if speculative else "none",
        "timings_per_token": timings_per_token, "post_sampling_probs": False, "backend_sampling": backend_sampling,
        "lora": list(lora)}
    for name, value in (tuning or {}).items():  # what only tunes a sampler that is off, echoed as given
        if name in settings:
            settings[name] = value
    return settings


@dataclass
class Outcome:
    """What a finished generation gives llama-server's final result."""

    text: str
    tokens: list[int]
    finish_reason: FinishReason | None
    stop: str | None
    stats: GenerationStats | None
    truncated: bool
    logprobs: list[TokenLogprob]


def final_result(outcome: Outcome, *, index: int, id_slot: int, model: str, prompt: str, n_prompt: int,
                 settings: dict[str, Any], clock: Clock, token_bytes: TokenBytes, return_tokens: bool,
                 stream: bool, n_probs: int) -> dict[str, Any]:
    """llama-server's final result of ``/completion`` (and ``/infill``; the ``__verbose`` of its
    OpenAI routes). Streamed, its text and tokens have gone in the chunks before it."""
    n_predicted = len(outcome.tokens)
    result: dict[str, Any] = {
        "index": index, "content": "" if stream else outcome.text,
        "tokens": list(outcome.tokens) if return_tokens and not stream else [], "id_slot": id_slot, "stop": True,
        "model": model, "tokens_predicted": n_predicted, "tokens_evaluated": n_prompt,
        "generation_settings": settings, "prompt": prompt, "has_new_line": "\n" in outcome.text,
        "truncated": outcome.truncated, "stop_type": STOP_TYPES.get(outcome.finish_reason or FinishReason.EOG, "none"),
        "stopping_word": outcome.stop or "", "tokens_cached": n_prompt + max(0, n_predicted - 1),
        "timings": clock.timings(outcome.stats)}
    if not stream and n_probs and outcome.logprobs:
        result["completion_probabilities"] = probabilities(outcome.logprobs, token_bytes)
    return result


def partial_result(*, index: int, id_slot: int, text: str, tokens: list[int], n_predicted: int, n_prompt: int,
                   timings: dict[str, Any] | None = None, progress: dict[str, Any] | None = None,
                   probs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A streamed chunk of ``/completion``: its text and tokens, or the prompt's progress."""
    result: dict[str, Any] = {"index": index, "content": text, "tokens": tokens, "stop": False, "id_slot": id_slot,
                              "tokens_predicted": n_predicted, "tokens_evaluated": n_prompt}
    if timings is not None:
        result["timings"] = timings
    if progress is not None:
        result["prompt_progress"] = progress
    if probs:
        result["completion_probabilities"] = probs
    return result


def pick_fields(result: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama-server's ``response_fields``: only these fields of the result, a path ``a/b`` read
    inside ``a`` and answered under its full path."""
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = result
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            out[path] = value
    return out
