"""A plan before loading: what an engine of a model and its options will take, per device, found
by llama.cpp itself without allocating anything.

The model is loaded with ``no_alloc`` (its metadata and the placement of its tensors, no data) and
the engine's context is made over it, which simulates its allocations; llama.cpp's own accounting
then gives, per buffer type, the weights, the context's memory (KV cells, recurrent states) and
its compute buffers (with ``mtp``, the MTP context's too). With ``n_gpu_layers="auto"`` the
placement is llama.cpp's own fitting, as the engine's. Not counted: a draft model, an image
projector, LoRA adapters, and the host cache of parked states (its bound is the
``host_cache_bytes`` option).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from aiollama.config import EngineConfig
from aiollama.models import default_model
from aiollama.native import Context
from aiollama.native.footprint import Buffer, footprints
from aiollama.runner.embedder import embed_pooling, embedder_options, is_embedding_model
from aiollama.runner.executor import load_model, recurrent_config
from aiollama.runner.mtp import head_options
from aiollama.runner.shape import check_rollback, context_options


@dataclass(frozen=True)
class Plan:
    """What an engine will take. ``buffers`` are llama.cpp's buffer types ("CPU", "CPU_REPACK",
    "CUDA0"...), each with its bytes of weights, memory and compute; the totals sum them.
    ``kv_bytes_per_cell`` is the memory of one cell (a token of every layer), ``kv_bytes_per_stream``
    that of one stream's share of the context (``n_ctx_seq`` cells; a recurrent model's state per
    stream is in ``memory_bytes``)."""

    model: str
    description: str
    n_gpu_layers: int
    n_ctx: int
    n_ctx_seq: int
    n_seq_max: int
    buffers: tuple[Buffer, ...]
    weights_bytes: int
    memory_bytes: int
    compute_bytes: int
    kv_bytes_per_cell: int
    kv_bytes_per_stream: int
    kind: str = "chat"  # what the model is for: "chat", "embedding" or "rerank" (a reranker)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.memory_bytes + self.compute_bytes

    def by_device(self) -> dict[str, int]:
        """The bytes on each device: its buffer types together ("CPU" holds "CPU_Mapped",
        "CPU_REPACK" and a GPU's pinned host buffers; "CUDA0" its split buffers)."""
        out: dict[str, int] = {}
        for b in self.buffers:
            out[device_of(b.name)] = out.get(device_of(b.name), 0) + b.weights + b.memory + b.compute
        return out

    def fits(self, memory_bytes: int) -> dict[str, int]:
        """What ``memory_bytes`` holds besides the weights and compute buffers: its ``cells`` (a
        context of that many tokens for one stream), the ``streams`` of this plan's context each
        (``n_ctx_seq``), and the context each of this plan's ``n_seq_max`` streams could have."""
        room = memory_bytes - self.weights_bytes - self.compute_bytes
        cells = max(0, room // self.kv_bytes_per_cell) if self.kv_bytes_per_cell else 0
        return {"cells": cells, "streams": cells // max(1, self.n_ctx_seq),
                "context_per_stream": cells // max(1, self.n_seq_max)}

    def as_dict(self, memory_bytes: int | None = None) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["buffers"] = [dataclasses.asdict(b) for b in self.buffers]
        out["total_bytes"] = self.total_bytes
        out["by_device"] = self.by_device()
        if memory_bytes is not None:
            out["fits"] = {"memory_bytes": memory_bytes, **self.fits(memory_bytes)}
        return out


def device_of(buffer: str) -> str:
    """The device a llama.cpp buffer type is on ("CUDA0_Split": CUDA0; "CUDA_Host", "CPU_REPACK": CPU)."""
    name = buffer.split("_")[0]
    return "CPU" if name == "CPU" or buffer.endswith("_Host") else name


def plan(model_path: str | os.PathLike[str] | None = None, **options: Any) -> Plan:
    """The plan of ``Engine(model_path, **options)``: nothing is allocated, no weight is read.
    Raises as the engine would for a model or options it cannot take."""
    config = EngineConfig.from_options(model_path, **options)
    path = config.model_path if config.model_path is not None else default_model()
    with load_model(config, path, no_alloc=True) as model:  # placed as the engine's ("auto": llama.cpp's fitting)
        pooling = embed_pooling(model, config.pooling)
        kind = "rerank" if pooling == "rank" else "embedding" if is_embedding_model(model) else "chat"
        if is_embedding_model(model):
            shape = embedder_options(model, config.n_threads, config.pooling)
        else:
            if model.is_recurrent:
                config = recurrent_config(config, path.name, model.metadata("general.architecture"))
            shape = {**context_options(config, model), "reference_kernels": False}
        with Context(model, **shape) as ctx, contextlib.ExitStack() as stack:
            if kind == "chat":
                check_rollback(config, ctx, path.name)
            beside = [stack.enter_context(Context(model, **head_options(model, ctx, config.n_threads)))] \
                if config.mtp and kind == "chat" else []
            buffers = tuple(footprints(ctx, *beside))
            n_ctx, n_ctx_seq = ctx.n_ctx, ctx.n_ctx_seq
        description = model.description()
    weights, memory, compute = (sum(getattr(b, k) for b in buffers) for k in ("weights", "memory", "compute"))
    per_cell = math.ceil(memory / n_ctx) if n_ctx and not model.is_recurrent else 0
    return Plan(os.fspath(path), description, model.n_gpu_layers, n_ctx, n_ctx_seq, config.n_seq_max, buffers,
                weights, memory, compute, per_cell, per_cell * n_ctx_seq, kind)
