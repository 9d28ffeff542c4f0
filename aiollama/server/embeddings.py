"""Embeddings over HTTP: OpenAI's ``/v1/embeddings`` and llama-server's native ``/embedding``.

``/embeddings`` (no prefix) answers in OpenAI's shape a body with OpenAI's ``input``, which is
what the OpenAI client sends given a base URL without ``/v1``, and in llama-server's a body with
its ``content``.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

import numpy as np
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from aiollama.errors import AiollamaError
from aiollama.server.bad_request import BadRequest
from aiollama.server.native_request import native_prompts
from aiollama.server.neutral_request import json_object
from aiollama.server.openai_request import MAX_INPUTS, embeddings_request
from aiollama.server.state import State, serving_engine, translate

NATIVE_FIELDS = frozenset({"content", "input", "embd_normalize", "model", "encoding_format"})


async def openai_route(state: State, request: HttpRequest) -> Response:
    return await _openai(state, await state.guard.read_json(request))


async def native_route(state: State, request: HttpRequest) -> Response:
    return await _native(state, await state.guard.read_json(request))


async def either_route(state: State, request: HttpRequest) -> Response:
    body = await state.guard.read_json(request)
    if isinstance(body, dict) and "input" in body and "content" not in body and "embd_normalize" not in body:
        return await _openai(state, body)
    return await _native(state, body)


async def _openai(state: State, body: Any) -> Response:
    """``input`` is a string, a list of them, or token ids; ``encoding_format`` "float" or "base64"
    (little-endian float32, as OpenAI's clients decode it)."""
    texts, encoding = embeddings_request(body)
    engine = serving_engine(state)
    if engine.config.pooling == "none":
        raise BadRequest("Pooling type 'none' is not OAI compatible: use /embedding, or another pooling")
    try:
        vectors = await engine.embed(texts)
        n_tokens = sum(len(engine.tokenize(t, add_special=True)) if isinstance(t, str) else len(t) for t in texts)
    except AiollamaError as exc:
        raise translate(exc) from None
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if encoding == "base64" else v}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": state.name(),
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


async def _native(state: State, body: Any) -> Response:
    """``content`` (or ``input``) as a text, token ids, or a list of them; each answered as
    ``{"index", "embedding": [[...]]}``: one pooled vector, or without pooling one per token.
    ``embd_normalize``: -1 none, 0 max-abs, 1 taxicab, 2 euclidean (the default), p > 2."""
    body = json_object(body, NATIVE_FIELDS)
    engine = serving_engine(state)
    value = body.get("input", body.get("content"))
    if value is None:
        raise BadRequest("\"input\" or \"content\" must be provided", param="content")
    norm = body.get("embd_normalize", state.embd_normalize)
    if isinstance(norm, bool) or not isinstance(norm, int) or norm < -1:
        raise BadRequest("'embd_normalize' must be an integer >= -1", param="embd_normalize")
    if body.get("encoding_format", "float") != "float":
        raise BadRequest("/embedding answers floats; base64 is /v1/embeddings'", param="encoding_format")
    try:
        prompts = native_prompts(value, lambda text, first: engine.tokenize(text, add_special=True, special=True),
                                 engine.tokenizer.check_token, MAX_INPUTS)
        vectors = await engine.embed(prompts, normalize=False)
    except AiollamaError as exc:
        raise translate(exc) from None
    per_token = engine.config.pooling == "none"  # unnormalised, as llama-server's
    return JSONResponse([{"index": i, "embedding": v if per_token else [normalized(v, norm)]}
                         for i, v in enumerate(vectors)])


def normalized(vector: list[float], norm: int) -> list[float]:
    """llama.cpp's ``common_embd_normalize``: -1 none, 0 max-abs (to int16's range), 1 taxicab,
    2 euclidean, p > 2 the p-norm."""
    if norm < 0:
        return vector
    array = np.asarray(vector, dtype=np.float64)
    if norm == 0:
        scale = float(np.abs(array).max()) / 32760.0
    elif norm == 2:
        scale = float(np.sqrt(np.sum(array * array)))
    else:
        scale = float(np.sum(np.abs(array) ** norm) ** (1.0 / norm))
    out: list[float] = (array / scale).tolist() if scale > 0 else vector
    return out
