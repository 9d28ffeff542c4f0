"""What a context holds, per buffer type, as llama.cpp accounts it: the model's weights, the
context's memory (KV cells, recurrent states) and its compute buffers. Over a model loaded with
``no_alloc`` the context only simulates its allocations, and this is what they would take."""

from __future__ import annotations

from dataclasses import dataclass

from aiollama.native.binding import ffi, lib
from aiollama.native.context import Context

MAX_BUFFERS = 64


@dataclass(frozen=True)
class Buffer:
    """One buffer type's bytes (``name``: llama.cpp's, such as "CPU", "CPU_REPACK", "CUDA0")."""

    name: str
    weights: int
    memory: int
    compute: int


def footprint(ctx: Context) -> list[Buffer]:
    """The context's bytes by buffer type (the model's weights, its memory, its compute buffers)."""
    names = ffi.new("const char *[]", MAX_BUFFERS)
    weights, memory, compute = (ffi.new("uint64_t[]", MAX_BUFFERS) for _ in range(3))
    n = lib.aiollama_memory_breakdown(ctx._get(), names, weights, memory, compute, MAX_BUFFERS)
    return [Buffer(ffi.string(names[i]).decode("utf-8", "replace"), int(weights[i]), int(memory[i]), int(compute[i]))
            for i in range(max(0, min(n, MAX_BUFFERS)))]


def footprints(ctx: Context, *beside: Context) -> list[Buffer]:
    """``ctx``'s bytes by buffer type, with the memory and compute buffers of ``beside``: contexts
    over the same model (whose weights are ``ctx``'s, counted once), such as an MTP context."""
    held = {b.name: b for b in footprint(ctx)}
    for other in beside:
        for b in footprint(other):
            was = held.get(b.name, Buffer(b.name, 0, 0, 0))
            held[b.name] = Buffer(b.name, was.weights, was.memory + b.memory, was.compute + b.compute)
    return list(held.values())
