"""Context: one llama_context, its KV memory, and decoding.

A context belongs to one thread at a time: llama.cpp does no locking inside it. Only
:meth:`Context.request_abort` and :meth:`Context.clear_abort` may be called from other threads.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiollama._validate import integer
from aiollama.errors import (
    ContextCreateError,
    InvalidBatchError,
    InvalidOutputError,
    InvalidSeqIdError,
    InvalidTokenError,
)
from aiollama.native.batch import Batch
from aiollama.native.binding import ffi, lib
from aiollama.native.handle import Handle
from aiollama.native.lora import LoraAdapter, set_adapters
from aiollama.native.memory import WHOLE_COPIES, MemoryOps
from aiollama.native.model import Model, Vocab, with_model
from aiollama.native.params import context_params


class DecodeStatus(enum.IntEnum):
    """What ``llama_decode`` returned.

    ``NO_KV_SLOT`` and ``INVALID_BATCH`` leave the KV memory as it was. After ``ABORTED`` and the
    failures below it, the ubatches computed before the failure stay in memory: read
    ``seq_pos_max`` to resync.
    """

    OK = 0
    NO_KV_SLOT = 1
    ABORTED = 2
    INVALID_BATCH = -1
    ALLOC_FAILED = -2
    COMPUTE_FAILED = -3
    FATAL = -1000  # any other negative code

    @classmethod
    def _missing_(cls, value: object) -> DecodeStatus:
        return cls.FATAL

    @property
    def is_fatal(self) -> bool:
        """True for failures after which the context may hold partial results."""
        return self.value < -1 or self is DecodeStatus.FATAL


@dataclass(frozen=True)
class Perf:
    """llama.cpp's own counters for a context (``llama_perf_context``)."""

    t_load_ms: float
    t_prompt_eval_ms: float
    t_eval_ms: float
    n_prompt_eval: int
    n_eval: int
    n_graph_reused: int


class Context(Handle, MemoryOps):
    """A llama_context over ``model``, which it keeps alive until closed.

    Defaults suit a batching engine: a unified KV cache (so ``seq_cp`` shares cells and a fork costs
    nothing), and thread counts from the CPUs this process may actually use. ``reference_kernels``
    runs ggml-cpu's reference kernels, which compute each row the same way whatever else the batch
    holds (see the engine's deterministic mode).

    Raises:
        InvalidRequestError: a parameter out of range (for example ``n_seq_max`` > 256).
        ClosedError: the model is closed.
        ContextCreateError: llama.cpp could not create the context (for example, out of memory).
    """

    _kind = "context"

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_seq_max: int = 1,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        kv_unified: bool = True,
        flash_attn: bool | None = None,
        embeddings: bool = False,
        pooling: str | None = None,
        reference_kernels: bool = False,
        cache_type_k: str = "f16",
        cache_type_v: str = "f16",
        mtp: bool = False,
        rollback: int = 0,
    ) -> None:
        params = context_params(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                                n_threads=n_threads, n_threads_batch=n_threads_batch, kv_unified=kv_unified,
                                flash_attn=flash_attn, embeddings=embeddings, pooling=pooling,
                                cache_type_k=cache_type_k, cache_type_v=cache_type_v, mtp=mtp, rollback=rollback)
        # The abort flag is read by C after every graph node; Python only stores to it.
        self._abort_flag = ffi.new("int *", 0)
        params.abort_callback = ffi.addressof(lib, "aiollama_abort_cb")
        params.abort_callback_data = self._abort_flag

        ptr = with_model(model, lambda model_ptr: lib.llama_init_from_model(model_ptr, params),
                         lambda why: ContextCreateError(f"llama.cpp could not create a context: {why}"))
        self._own(ptr)
        self.model = model
        if reference_kernels and lib.aiollama_reference_kernels(ptr, True) < 1:
            self.close()
            raise ContextCreateError("reference kernels need ggml's CPU backend, and this build does not "
                                     "expose it to aiollama")
        self.reference_kernels = reference_kernels
        self.vocab: Vocab = model.vocab
        self._memory = lib.llama_get_memory(ptr)
        self.n_ctx: int = lib.llama_n_ctx(ptr)
        self.n_ctx_seq: int = lib.llama_n_ctx_seq(ptr)
        self.n_batch: int = lib.llama_n_batch(ptr)
        self.n_ubatch: int = lib.llama_n_ubatch(ptr)
        self.n_seq_max: int = lib.llama_n_seq_max(ptr)
        # the tokens of its last decode a sequence's recurrent state can drop (seq_rm from a p0 > 0):
        # what was asked, or 0 where the model's architecture keeps no snapshots in llama.cpp
        self.rollback: int = lib.llama_n_rs_seq(ptr)
        if self.n_seq_max > self.n_batch and not embeddings:
            self.close()  # llama.cpp reserves an output row per sequence within the batch's: it would abort
            raise ContextCreateError(f"n_seq_max ({self.n_seq_max}) exceeds the batch ({self.n_batch}, at most "
                                     "n_ctx): give fewer sequences or a larger batch and context")
        self.kv_unified = kv_unified
        # (an MTP context's memory is a plain attention cache for its block)
        self.whole_copies = not mtp and model.metadata("general.architecture") in WHOLE_COPIES
        self.embeddings = embeddings
        # what a pooled row holds: a reranker's scores (rank pooling), else an embedding
        self.pooled_size: int = model.n_cls_out if embeddings and lib.llama_pooling_type(ptr) == \
            lib.LLAMA_POOLING_TYPE_RANK else model.n_embd
        self.n_vocab = self.vocab.n_tokens
        self._outputs: frozenset[int] = frozenset()

    def _free(self, ptr: Any) -> None:
        self._outputs = frozenset()
        lib.llama_free(ptr)
        self.model._release()

    def __repr__(self) -> str:
        state = "closed" if self._ptr is None else f"n_ctx={self.n_ctx} n_seq_max={self.n_seq_max}"
        return f"<Context {state}>"

    # threads and abort

    @property
    def n_threads(self) -> tuple[int, int]:
        """(threads for single-token ubatches, threads for larger ubatches)."""
        ptr = self._get()
        return lib.llama_n_threads(ptr), lib.llama_n_threads_batch(ptr)

    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        integer("n_threads", n_threads, low=1)
        batch = n_threads if n_threads_batch is None else integer("n_threads_batch", n_threads_batch, low=1)
        lib.llama_set_n_threads(self._get(), n_threads, batch)

    def request_abort(self) -> None:
        """Make the running (or next) decode stop at the next graph node, returning ABORTED.

        Safe from any thread. The flag stays set until :meth:`clear_abort`.
        """
        lib.aiollama_flag_store(self._abort_flag, 1)

    def clear_abort(self) -> None:
        lib.aiollama_flag_store(self._abort_flag, 0)

    # decoding

    def _check_seq(self, seq_id: object, *, allow_all: bool = False) -> int:
        seq_id = integer("seq_id", seq_id)
        if allow_all and seq_id == -1:
            return seq_id
        if not 0 <= seq_id < self.n_seq_max:
            raise InvalidSeqIdError(f"seq id {seq_id} is outside [0, {self.n_seq_max}) (n_seq_max)")
        return seq_id

    def _check_batch(self, batch: Batch) -> None:
        n = batch.n_tokens
        if n == 0:
            raise InvalidBatchError("cannot decode an empty batch")
        if n > self.n_batch:
            raise InvalidBatchError(f"batch of {n} rows exceeds n_batch={self.n_batch}; split it")
        if batch.max_token >= self.n_vocab:
            raise InvalidTokenError(f"token id {batch.max_token} is outside the vocabulary [0, {self.n_vocab})")
        if batch.max_seq_id >= self.n_seq_max:
            raise InvalidSeqIdError(f"seq id {batch.max_seq_id} is outside [0, {self.n_seq_max}) (n_seq_max)")
        if batch.shares_rows and not self.kv_unified:
            raise InvalidBatchError("rows shared by several sequences need a context with kv_unified=True")
        for seq_id, first in batch.first_pos.items():
            if self._memory == ffi.NULL:
                break
            pos_max = lib.llama_memory_seq_pos_max(self._memory, seq_id)
            if pos_max >= 0 and first != pos_max + 1:
                raise InvalidBatchError(
                    f"position gap in sequence {seq_id}: the cache holds it up to position {pos_max}, "
                    f"the batch starts it at {first} (expected {pos_max + 1})")

    def decode(self, batch: Batch, before: Callable[[], None] | None = None) -> DecodeStatus:
        """Run one ``llama_decode`` over ``batch`` and wait for it to finish (on a GPU too). The GIL
        is released while it runs; ``before`` is called just before it starts, once the batch has
        been checked (to wake another thread that can then run while this one computes).

        Raises InvalidBatchError, InvalidTokenError or InvalidSeqIdError for a batch llama.cpp would
        abort on or reject; nothing is decoded (and ``before`` is not called) then.
        """
        ptr = self._get()
        c = batch._get()
        self._check_batch(batch)
        self._outputs = frozenset()
        c.n_tokens = batch.n_tokens
        if before is not None:
            before()
        status = DecodeStatus(lib.llama_decode(ptr, c))
        # A GPU decode returns once its graph is queued; wait here, so that the decode's time is
        # the decode's (the first read of its logits would wait anyway)
        lib.llama_synchronize(ptr)
        if status is DecodeStatus.OK:
            self._outputs = frozenset(batch.outputs)
        return status

    @property
    def outputs(self) -> frozenset[int]:
        """Batch indices that have logits from the last successful decode."""
        return self._outputs

    def check_output(self, idx: int) -> int:
        """Return ``idx`` if that row of the last decode has logits, else raise InvalidOutputError."""
        self._get()
        integer("idx", idx)
        if idx not in self._outputs:
            rows = sorted(self._outputs)
            shown = rows if len(rows) <= 16 else rows[:16] + ["..."]
            raise InvalidOutputError(f"batch row {idx} has no logits from the last decode (rows with logits: {shown})")
        return idx

    def check_outputs(self, rows: Sequence[int]) -> None:
        """:meth:`check_output` of each of ``rows``, in one look where all are ints with logits."""
        self._get()
        if not (all(type(r) is int for r in rows) and self._outputs.issuperset(rows)):
            for idx in rows:
                self.check_output(idx)

    def set_causal(self, causal: bool) -> None:
        """Causal attention (the default), or attention over every position of the ubatch for the
        decodes that follow (the pictures of some projectors are decoded so)."""
        lib.llama_set_causal_attn(self._get(), bool(causal))

    def set_adapters(self, adapters: Sequence[tuple[LoraAdapter, float]]) -> None:
        """Apply these LoRA adapters, each at its scale, from the next decode on (none: the base
        model). llama.cpp keeps the graph when the set is unchanged."""
        set_adapters(self._get(), adapters)

    def logits_buffer(self, idx: int) -> Any:
        """The logits of batch row ``idx`` of the last decode, in place (a writable buffer of
        ``n_vocab`` floats; valid until the next decode). A sampler run afterwards sees changes."""
        ptr = self._get()
        self.check_output(idx)
        return ffi.buffer(lib.llama_get_logits_ith(ptr, idx), 4 * self.n_vocab)

    def embedding(self, seq_id: int) -> list[float]:
        """The pooled embedding of ``seq_id`` after the last decode of an embeddings context (with
        rank pooling: the reranker's ``n_cls_out`` scores)."""
        ptr = self._get()
        self._check_seq(seq_id)
        row = lib.llama_get_embeddings_seq(ptr, seq_id)
        if row == ffi.NULL:
            raise InvalidOutputError(f"no pooled embedding for sequence {seq_id} (embeddings off, or no pooling)")
        return list(ffi.unpack(row, self.pooled_size))

    def token_embedding(self, idx: int) -> list[float]:
        """The embedding of batch row ``idx`` (an output row) after the last decode of an embeddings
        context without pooling."""
        ptr = self._get()
        self.check_output(idx)
        row = lib.llama_get_embeddings_ith(ptr, idx)
        if row == ffi.NULL:
            raise InvalidOutputError(f"no embedding for batch row {idx} (embeddings off, or pooled)")
        return list(ffi.unpack(row, self.model.n_embd))

    def logits(self, idx: int) -> list[float]:
        """A copy of the logits of batch row ``idx`` of the last decode."""
        ptr = self._get()
        self.check_output(idx)
        row = lib.llama_get_logits_ith(ptr, idx)
        return list(ffi.unpack(row, self.n_vocab))

    # memory (KV cache)

    # per-sequence state

    def perf(self) -> Perf:
        """llama.cpp's timings; they are accumulated when the context synchronizes."""
        ptr = self._get()
        lib.llama_synchronize(ptr)
        d = lib.llama_perf_context(ptr)
        return Perf(d.t_load_ms, d.t_p_eval_ms, d.t_eval_ms, d.n_p_eval, d.n_eval, d.n_reused)
