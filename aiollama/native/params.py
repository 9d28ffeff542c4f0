"""The parameters of a llama.cpp context, checked: what :class:`~aiollama.native.context.Context`
creates its context with, and what fitting a model to the devices measures."""

from __future__ import annotations

from typing import Any

from aiollama._validate import integer
from aiollama.errors import InvalidRequestError
from aiollama.native.batch import MAX_SEQ
from aiollama.native.binding import lib
from aiollama.native.threads import math_cpus

# Recurrent-state snapshots per sequence (each as large as the state): drafts are never longer.
MAX_ROLLBACK = 32

POOLING = {"none": lib.LLAMA_POOLING_TYPE_NONE, "mean": lib.LLAMA_POOLING_TYPE_MEAN,
           "cls": lib.LLAMA_POOLING_TYPE_CLS, "last": lib.LLAMA_POOLING_TYPE_LAST, "rank": lib.LLAMA_POOLING_TYPE_RANK}


# KV cache element types (llama-server's --cache-type-k/-v): a quantized V cache needs flash attention
CACHE_TYPES = {"f32": lib.GGML_TYPE_F32, "f16": lib.GGML_TYPE_F16, "bf16": lib.GGML_TYPE_BF16,
               "q8_0": lib.GGML_TYPE_Q8_0, "q4_0": lib.GGML_TYPE_Q4_0, "q4_1": lib.GGML_TYPE_Q4_1,
               "q5_0": lib.GGML_TYPE_Q5_0, "q5_1": lib.GGML_TYPE_Q5_1}


def context_params(*, n_ctx: int = 4096, n_batch: int = 512, n_ubatch: int | None = None, n_seq_max: int = 1,
                   n_threads: int | None = None, n_threads_batch: int | None = None, kv_unified: bool = True,
                   flash_attn: bool | None = None, embeddings: bool = False, pooling: str | None = None,
                   cache_type_k: str = "f16", cache_type_v: str = "f16", mtp: bool = False, rollback: int = 0) -> Any:
    """A checked ``llama_context_params`` (what :class:`Context` creates its context with); ``mtp``:
    a context that runs the model's multi-token-prediction (NextN) layers, not its trunk.
    ``rollback``: how many tokens of its last decode a sequence's recurrent state can be cut back
    by (llama.cpp keeps that many snapshots per sequence; 0 for none, and for models it cannot).

    Raises InvalidRequestError for a value out of range or a cache type not in ``CACHE_TYPES``.
    """
    integer("n_ctx", n_ctx, low=0)
    integer("n_batch", n_batch, low=1)
    integer("n_seq_max", n_seq_max, low=1, high=MAX_SEQ)
    integer("rollback", rollback, low=0, high=MAX_ROLLBACK)
    if n_ubatch is not None:
        integer("n_ubatch", n_ubatch, low=1)
    threads = math_cpus() if n_threads is None else integer("n_threads", n_threads, low=1)
    threads_batch = threads if n_threads_batch is None else integer("n_threads_batch", n_threads_batch, low=1)
    for name, kind in (("cache_type_k", cache_type_k), ("cache_type_v", cache_type_v)):
        if kind not in CACHE_TYPES:
            raise InvalidRequestError(f"{name} must be one of {', '.join(CACHE_TYPES)}, got {kind!r}")
    if flash_attn is False and cache_type_v not in ("f32", "f16", "bf16"):
        raise InvalidRequestError(f"a {cache_type_v} V cache needs flash attention: give flash_attn=True or None")

    params = lib.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_ubatch if n_ubatch is not None else min(n_batch, 512)
    params.n_seq_max = n_seq_max
    params.n_rs_seq = rollback
    params.n_threads = threads
    params.n_threads_batch = threads_batch
    params.kv_unified = kv_unified
    params.no_perf = False
    params.embeddings = embeddings
    params.type_k = CACHE_TYPES[cache_type_k]
    params.type_v = CACHE_TYPES[cache_type_v]
    if mtp:
        params.ctx_type = lib.LLAMA_CONTEXT_TYPE_MTP
    if pooling is not None:
        if pooling not in POOLING:
            raise InvalidRequestError(f"pooling must be one of {sorted(POOLING)}, got {pooling!r}")
        params.pooling_type = POOLING[pooling]
    if flash_attn is not None:
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return params
