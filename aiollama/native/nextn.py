"""Multi-token prediction (MTP): the hidden states a model's NextN layers read, and the extended
batch that pairs each token with one.

A target context set to :func:`output_hidden` keeps, after each decode, the hidden state of every
batch entry (unmasked: indexed by the entry's place in the batch) or of the entries that output
logits (masked: indexed as logits are). An MTP context (``Context(..., mtp=True)`` over a model
loaded with ``load_mtp``) runs the NextN layers on :class:`NextnBatch` entries: a token, its
position and the hidden state of the position before it. These calls reach llama.cpp's staging API
(``src/llama-ext.h``) through the shim in ``cmake/nextn.cpp``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from aiollama.errors import ContextCreateError, InvalidBatchError
from aiollama.native.binding import ffi, lib
from aiollama.native.context import Context, DecodeStatus
from aiollama.native.handle import Handle


def n_embd_out(ctx: Context) -> int:
    """The width of a hidden state the NextN layers read."""
    return int(lib.llama_model_n_embd_out(ctx.model._get()))


def output_hidden(ctx: Context, *, masked: bool) -> None:
    """Keep the hidden states of each decode's entries (all of them, or ``masked``: those that
    output logits)."""
    lib.aiollama_set_embeddings_nextn(ctx._get(), True, masked)


def hidden(ctx: Context, n_rows: int) -> np.ndarray:
    """The unmasked hidden states of the last decode's first ``n_rows`` entries, in place (valid
    until the next decode): an ``(n_rows, n_embd)`` float32 array."""
    width = n_embd_out(ctx)
    ptr = lib.aiollama_get_embeddings_nextn(ctx._get())
    if ptr == ffi.NULL:
        raise InvalidBatchError("the context keeps no hidden states: call output_hidden first")
    return np.frombuffer(ffi.buffer(ptr, 4 * n_rows * width), dtype=np.float32).reshape(n_rows, width)


def hidden_row(ctx: Context, i: int, width: int) -> np.ndarray:
    """The hidden state of the last decode's entry ``i`` (where the context is masked, ``i`` must be
    an entry that output logits), in place."""
    ptr = lib.aiollama_get_embeddings_nextn_ith(ctx._get(), i)
    if ptr == ffi.NULL:
        raise InvalidBatchError(f"entry {i} of the last batch kept no hidden state")
    return np.frombuffer(ffi.buffer(ptr, 4 * width), dtype=np.float32)


def logits_row(ctx: Context, i: int) -> np.ndarray:
    """The logits of the last process's entry ``i``, in place."""
    ptr = lib.llama_get_logits_ith(ctx._get(), i)
    if ptr == ffi.NULL:
        raise InvalidBatchError(f"entry {i} of the last batch has no logits")
    return np.frombuffer(ffi.buffer(ptr, 4 * ctx.n_vocab), dtype=np.float32)


class NextnBatch(Handle):
    """A ``llama_batch_ext`` for an MTP context: up to ``ctx.n_batch`` entries of a token, a
    position, a sequence and a hidden state."""

    _kind = "nextn batch"

    def __init__(self, ctx: Context) -> None:
        ptr = lib.llama_batch_ext_init(ctx._get())
        if ptr == ffi.NULL:
            raise ContextCreateError("llama.cpp could not create an extended batch")
        self._own(ptr)
        self.ctx = ctx
        self.width = n_embd_out(ctx)
        self.capacity = ctx.n_batch

    def _free(self, ptr: Any) -> None:
        lib.llama_batch_ext_free(ptr)

    def process(self, tokens: Sequence[int], pos: Sequence[int], seq_ids: Sequence[int], rows: np.ndarray,
                outputs: Sequence[bool]) -> DecodeStatus:
        """Decode these entries on the MTP context (``rows``: one hidden state each) and wait for it.
        Raises InvalidBatchError for entries llama.cpp refuses (too many, a bad token or seq id)."""
        n = len(tokens)
        if not 0 < n <= self.capacity or rows.shape != (n, self.width):
            raise InvalidBatchError(f"{n} entries with {rows.shape} states for a batch of {self.capacity} "
                                    f"entries of width {self.width}")
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        got = lib.aiollama_batch_ext_fill(
            self._get(), n, ffi.from_buffer("int32_t[]", np.asarray(tokens, dtype=np.int32)),
            ffi.from_buffer("int32_t[]", np.asarray(pos, dtype=np.int32)),
            ffi.from_buffer("int32_t[]", np.asarray(seq_ids, dtype=np.int32)),
            ffi.cast("const float *", ffi.from_buffer(rows)), self.width,
            ffi.from_buffer("bool[]", np.asarray(outputs, dtype=np.bool_)))
        if got != n:
            raise InvalidBatchError(f"llama.cpp refused an entry of the MTP batch (code {got})")
        ptr = self.ctx._get()
        status = DecodeStatus(lib.llama_process(ptr, lib.LLAMA_PROCESS_TYPE_DECODE, self._get()))
        lib.llama_synchronize(ptr)
        return status
