"""Requests as llama-server's own clients send them, and the shape of an answer: its fields and
their JSON types, which ``tests/data/server/llama_server.json`` records for llama-server's answers
(``tests/data/server/make_goldens.py``) and ``tests/server/test_llama_server_api.py`` holds aiollama's to."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

CHAT = [{"role": "user", "content": "Hi"}]
CHAT_BODY = {"messages": CHAT, "max_tokens": 2, "temperature": 0}

# name -> (model, server options, method, path, body, headers)
RERANK_BODY = {"query": "what is a cat", "top_n": 3,
               "documents": ["a cat is an animal", "paris is in france", "cats meow", "The quick brown fox."]}
REQUESTS: dict[str, tuple[str, tuple[str, ...], str, str, Any, dict[str, str] | None]] = {
    "completion": ("tiny", (), "POST", "/completion",
                   {"prompt": "Hello", "n_predict": 3, "temperature": 0, "n_probs": 2, "return_tokens": True}, None),
    "completions_mixed_prompt": ("tiny", (), "POST", "/completions",
                                 {"prompt": [19556, " world"], "n_predict": 2, "temperature": 0}, None),
    "completion_stream": ("tiny", (), "POST", "/completion",
                          {"prompt": "Hello", "n_predict": 2, "temperature": 0, "stream": True, "n_probs": 1,
                           "return_progress": True, "timings_per_token": True}, None),
    "infill": ("fim", ("-c", "8192"), "POST", "/infill",
               {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 3, "temperature": 0,
                "input_extra": [{"filename": "x.py", "text": "import os\n"}]}, None),
    "embedding": ("tiny", ("--embeddings", "--pooling", "mean"), "POST", "/embedding", {"content": "Hello"}, None),
    "embedding_per_token": ("tiny", ("--embeddings", "--pooling", "none"), "POST", "/embedding",
                            {"content": ["Hello world", "Hi"]}, None),
    "props": ("tiny", (), "GET", "/props", None, None),
    "tokenize": ("tiny", (), "POST", "/tokenize", {"content": "Hello", "with_pieces": True}, None),
    "health": ("tiny", (), "GET", "/health", None, None),
    "chat_without_v1": ("tiny", (), "POST", "/chat/completions", CHAT_BODY, None),
    "oai_completions_llama_fields": ("tiny", (), "POST", "/v1/completions",
                                     {"prompt": "Hi", "n_predict": 2, "temperature": 0, "n_probs": 2}, None),
    "chat_stream_timings": ("tiny", (), "POST", "/v1/chat/completions",
                            {**CHAT_BODY, "stream": True, "timings_per_token": True}, None),
    "chat_verbose": ("tiny", (), "POST", "/v1/chat/completions", {**CHAT_BODY, "verbose": True}, None),
    "wrong_key": ("tiny", ("--api-key", "right"), "POST", "/v1/chat/completions", CHAT_BODY,
                  {"Authorization": "Bearer wrong"}),
    "context_overflow": ("tiny", (), "POST", "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 2}, None),
    "rerank": ("rerank", ("--reranking",), "POST", "/v1/rerank", RERANK_BODY, None),
    "rerank_tei": ("rerank", ("--reranking",), "POST", "/rerank",
                   {"query": RERANK_BODY["query"], "texts": RERANK_BODY["documents"][:2], "return_text": True}, None),
}

# The values compared besides the shapes, where both engines must agree (the same model and greedy
# sampling): per request, paths into the answer ("a/b/0": key a, key b, item 0).
VALUES: dict[str, tuple[str, ...]] = {
    "completion": ("content", "tokens", "tokens_predicted", "tokens_evaluated", "stop_type", "prompt",
                   "completion_probabilities/0/id", "completion_probabilities/0/logprob",
                   "completion_probabilities/0/top_logprobs/1/id"),
    "completions_mixed_prompt": ("content", "prompt", "tokens_evaluated"),
    "infill": ("content", "prompt", "tokens_evaluated"),
    "embedding": ("0/embedding/0",),
    "embedding_per_token": ("0/embedding", "1/embedding"),
    "props": ("default_generation_settings/n_ctx", "default_generation_settings/params/temperature",
              "default_generation_settings/params/top_k", "default_generation_settings/params/n_predict",
              "total_slots", "model_ftype", "chat_template", "bos_token", "eos_token"),
    "tokenize": ("tokens",),
    "health": ("status",),
    "chat_without_v1": ("choices/0/message/content", "usage/prompt_tokens", "object"),
    "oai_completions_llama_fields": ("choices/0/text", "choices/0/logprobs/content/0/id"),
    "chat_verbose": ("__verbose/prompt", "__verbose/tokens_evaluated"),
    "wrong_key": ("error/type",),
    "context_overflow": ("error/n_prompt_tokens", "error/n_ctx"),
    "rerank": ("results/0/index", "results/0/relevance_score", "results/1/index", "results/1/relevance_score",
               "results/2/index", "results/2/relevance_score", "usage/prompt_tokens"),
    "rerank_tei": ("0/index", "0/score", "0/text", "1/score"),
}

# The answers of llama-server's own endpoints must have its fields exactly; those of the OpenAI
# routes may have more (OpenAI's own: ``param`` in an error, ``logprobs`` in a choice...).
NATIVE = ("completion", "completions_mixed_prompt", "completion_stream", "infill", "embedding",
          "embedding_per_token", "props", "tokenize", "health", "rerank", "rerank_tei")
# Where the shapes differ by design (docs/llama-server.md): per request, the paths whose types may.
# An OpenAI route's error code is OpenAI's string code, where llama-server repeats the status; a
# chat stream's first delta has OpenAI's empty content, where llama-server's has null.
DIFFERENT = {"wrong_key": {"error/code"}, "context_overflow": {"error/code"},
             "chat_stream_timings": {"choices/delta/content"}}
# Maps of which any keys may be answered (a template's capabilities, as each engine detects them)
OPEN = {"props": {"chat_template_caps"}}


def value_at(value: Any, path: str) -> Any:
    """The value at ``path`` ("a/b/0"); KeyError where there is none."""
    for part in path.split("/"):
        if isinstance(value, list):
            value = value[int(part)]
        elif isinstance(value, dict):
            value = value[part]
        else:
            raise KeyError(path)
    return value


def shape(value: Any) -> Any:
    """The fields of a JSON value and their types: a dict's keys, a list's first item (a stream's
    events one by one), a scalar's type name."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def events_shape(events: list[Any]) -> list[Any]:
    """A stream's events, each one's shape, with consecutive repeats of one shape kept once."""
    out: list[Any] = []
    for event in events:
        s = shape(event)
        if not out or out[-1] != s:
            out.append(s)
    return out


def call(url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """A request as llama-server's clients send it: its status and JSON answer (a stream's events,
    in order, for server-sent events)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw, status = response.read().decode(), response.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    if raw.startswith("data: "):
        return status, [json.loads(line[6:]) for line in raw.splitlines()
                        if line.startswith("data: ") and line[6:] != "[DONE]"]
    return status, json.loads(raw) if raw else None
