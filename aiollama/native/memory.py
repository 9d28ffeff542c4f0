"""A context's KV memory: removing, sharing and moving positions of sequences, and copying a
sequence's cells out and back in (its state). Part of :class:`~aiollama.native.context.Context`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiollama.errors import InvalidRequestError, StateRestoreError
from aiollama.native.binding import ffi, lib

PARTIAL_ONLY = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: the recurrent (or sliding-window) part of a state

# The architectures whose memory llama.cpp copies only whole sequences of (it asserts so, aborting the
# process on a range), and copies so that the two share state: DeepSeek V4's window, compressed
# blocks and compressor states.
WHOLE_COPIES = frozenset({"deepseek4"})


class MemoryOps:
    """The memory operations of a context (a mixin of :class:`~aiollama.native.context.Context`,
    which supplies the handle, the memory pointer and the seq id check)."""

    _memory: Any
    kv_unified: bool
    n_ctx_seq: int
    whole_copies: bool  # seq_cp copies whole sequences only (WHOLE_COPIES)

    if TYPE_CHECKING:
        def _get(self) -> Any: ...

        def _check_seq(self, seq_id: object, *, allow_all: bool = False) -> int: ...

    def memory_clear(self) -> None:
        """Drop every cell of every sequence."""
        if self._memory != ffi.NULL:
            lib.llama_memory_clear(self._mem(), True)

    def _mem(self) -> Any:
        """The context's memory (KV cache); InvalidRequestError for a model that has none (an
        embedding model that attends to whole inputs keeps nothing between decodes)."""
        self._get()
        if self._memory == ffi.NULL:
            raise InvalidRequestError("this context has no memory (an embedding model keeps no KV cache)")
        return self._memory

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq_id`` (-1: every sequence; negative bounds: open).

        False when the memory cannot remove part of a sequence (recurrent models).
        """
        return bool(lib.llama_memory_seq_rm(self._mem(), self._check_seq(seq_id, allow_all=True), p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` hold ``src``'s positions [p0, p1) too.

        In a unified KV cache this shares cells and copies nothing. In a split cache it copies a whole
        stream, and a partial range would abort llama.cpp, so it raises InvalidRequestError; so does
        a range of a memory that llama.cpp copies whole only (``whole_copies``), where a range that
        covers the whole of ``src`` is a whole copy (made through the state's bytes).
        """
        self._get()
        self._check_seq(src)
        self._check_seq(dst)
        if self.whole_copies and src != dst:
            if p1 > lib.llama_memory_seq_pos_max(self._mem(), src):
                p1 = -1  # up to the end
            if p0 > 0 or p1 >= 0:
                raise InvalidRequestError(f"seq_cp of the range [{p0}, {p1}): llama.cpp copies whole sequences "
                                          "only of this model's memory (p0=p1=-1)")
            # and its copy leaves the two sequences sharing state that the first of them to decode
            # changes for both: the state's bytes are copied instead
            self.seq_rm(dst, -1, -1)
            state = self.seq_state(src)
            if state:
                self.set_seq_state(dst, state)
            return
        if not self.kv_unified and src != dst:
            size = self.n_ctx_seq
            partial = (p0 > 0 and p0 + 1 < size) or (p1 > 0 and p1 + 1 < size)
            if partial:
                raise InvalidRequestError(
                    f"seq_cp of the range [{p0}, {p1}) needs a unified KV cache; a split cache "
                    "(kv_unified=False) can only copy whole sequences (p0=p1=-1)")
        lib.llama_memory_seq_cp(self._mem(), src, dst, p0, p1)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Add ``delta`` to the positions ``[p0, p1)`` of ``seq_id`` (negative bounds: open).

        Raises InvalidRequestError when the memory cannot move positions (see ``can_shift``).
        """
        self._get()
        if not self.can_shift:
            raise InvalidRequestError("this model's memory cannot shift positions")
        lib.llama_memory_seq_add(self._mem(), self._check_seq(seq_id), p0, p1, delta)

    @property
    def can_shift(self) -> bool:
        """Whether positions can be moved (``seq_add``): a context shift."""
        self._get()
        return self._memory != ffi.NULL and bool(lib.llama_memory_can_shift(self._memory))

    def seq_pos_min(self, seq_id: int) -> int:
        """The first cached position of ``seq_id``, or -1 if it holds nothing."""
        self._get()
        return int(lib.llama_memory_seq_pos_min(self._mem(), self._check_seq(seq_id)))

    def seq_pos_max(self, seq_id: int) -> int:
        """The last cached position of ``seq_id``, or -1 if it holds nothing."""
        self._get()
        return int(lib.llama_memory_seq_pos_max(self._mem(), self._check_seq(seq_id)))

    def seq_state(self, seq_id: int, *, partial: bool = False) -> bytes:
        """The KV state of one sequence, to restore later with :meth:`set_seq_state`. ``partial``:
        only the recurrent state of a recurrent or hybrid model (a checkpoint), not its KV cells."""
        ptr = self._get()
        self._check_seq(seq_id)
        if lib.llama_memory_seq_pos_max(self._mem(), seq_id) < 0:
            return b""
        flags = PARTIAL_ONLY if partial else 0
        size = lib.llama_state_seq_get_size_ext(ptr, seq_id, flags)
        buf = ffi.new("uint8_t[]", size)
        n = lib.llama_state_seq_get_data_ext(ptr, buf, size, seq_id, flags)
        return bytes(ffi.buffer(buf, n))

    def set_seq_state(self, seq_id: int, state: bytes, *, partial: bool = False) -> None:
        """Replace ``seq_id``'s cache with a saved state (``partial``: only its recurrent state; its
        KV cells stay). Raises StateRestoreError if it does not fit."""
        ptr = self._get()
        self._check_seq(seq_id)
        if not state:
            raise InvalidRequestError("empty sequence state")
        if lib.llama_state_seq_set_data_ext(ptr, state, len(state), seq_id, PARTIAL_ONLY if partial else 0) == 0:
            raise StateRestoreError(f"could not restore the state of sequence {seq_id} (no room, or another layout)")
