"""The shape of an engine's context, and what the engine tells of its model: its sizes, what it
is for, and the bytes its context holds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aiollama._validate import MAX_SEQ
from aiollama.config import CACHE_TYPE_BYTES, EngineConfig
from aiollama.errors import UnsupportedModel
from aiollama.native import Context, Model
from aiollama.native.footprint import footprints
from aiollama.runner.embedder import embed_pooling


def context_options(config: EngineConfig, model: Model) -> dict[str, Any]:
    """The generation context an engine of ``config`` makes over ``model`` (what a plan simulates)."""
    # deterministic: every row computed by the same kernels whatever the batch holds, and attention
    # summed cell by cell (flash attention's reference path), each sequence's cells in position
    # order (aiollama.runner.ordered: one more seq id). Each seq id takes an output row, and
    # llama.cpp has n_batch of them (at most n_ctx)
    ids = min(config.context_seq_ids(model.vocab.n_tokens), config.n_batch, config.n_ctx)
    if config.deterministic:
        ids = min(ids, MAX_SEQ - 1) + 1
    return {"n_ctx": config.n_ctx, "n_batch": config.n_batch, "n_seq_max": ids, "n_threads": config.n_threads,
            "kv_unified": config.kv_unified, "flash_attn": True if config.deterministic else config.flash_attn,
            "cache_type_k": config.cache_type_k, "cache_type_v": config.cache_type_v,
            "reference_kernels": config.deterministic, "rollback": config.draft_tokens if model.is_recurrent else 0}


def check_rollback(config: EngineConfig, ctx: Context, name: str) -> None:
    """Drafts on a recurrent or hybrid model drop their rejected tokens by rolling the state back
    within its last decode; UnsupportedModel where llama.cpp keeps no snapshots for the model."""
    if ctx.model.is_recurrent and config.draft_tokens and ctx.rollback < config.draft_tokens:
        what = "give no mtp" if config.mtp else "no draft_model, draft_tokens=0"
        raise UnsupportedModel(f"{name} is a recurrent or hybrid model whose state llama.cpp cannot roll back: "
                               f"rejected draft tokens cannot be dropped from it ({what})")


def kv_bytes_per_cell(model: Model, config: EngineConfig) -> int:
    """What one KV cell (a token's keys and values in every layer) takes in the cache's types;
    an estimate from the heads' sizes (a recurrent state is per sequence, not per cell)."""
    if model.n_head <= 0:
        return 0
    per_head = model.n_embd // model.n_head
    each = model.n_layer * max(model.n_head_kv, 1) * per_head
    return round(each * (CACHE_TYPE_BYTES[config.cache_type_k] + CACHE_TYPE_BYTES[config.cache_type_v]))


def model_info(model: Model, config: EngineConfig, embeds_only: bool, ctx: Context,
               beside: Sequence[Context] = ()) -> Mapping[str, str | int]:
    """What the engine tells of its model: its description, sizes, the KV bytes a cell takes, how
    ``embed()`` pools, what it is for (a reranker, pooled by rank; an embedding model, which cannot
    generate; or chat), and the bytes its context holds as llama.cpp accounts them (weights,
    memory, compute buffers: what a plan foresees), with those of the contexts ``beside`` it (an
    MTP context)."""
    pooling = embed_pooling(model, config.pooling)
    held = footprints(ctx, *beside)
    return {"description": model.description(), "ftype": model.ftype, "n_params": model.n_params,
            "size": model.size, "n_embd": model.n_embd, "n_ctx_train": model.n_ctx_train,
            "n_vocab": model.vocab.n_tokens, "kv_bytes_per_cell": kv_bytes_per_cell(model, config), "pooling": pooling,
            "kind": "rerank" if pooling == "rank" else "embedding" if embeds_only else "chat",
            "weights_bytes": sum(b.weights for b in held), "memory_bytes": sum(b.memory for b in held),
            "compute_bytes": sum(b.compute for b in held)}
