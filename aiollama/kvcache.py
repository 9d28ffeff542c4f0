"""Bookkeeping of KV cells and seq ids, mirroring a unified llama.cpp KV cache. Pure Python.

In a unified cache ``seq_cp(src, dst, 0, n)`` makes ``dst`` share ``src``'s cells for positions
``[0, n)``; a cell is freed once no sequence holds it. :class:`KVCells` models exactly that as a tree
of spans: each sequence's cache is the path from its tail span to the root, and a span's ``refs``
counts the sequences whose path passes through it.

:class:`KVManager` is the mechanism under the scheduler's policy: the pool of seq ids, which
sequence holds which, the cells each holds, and the log of KV operations (``seq_rm``/``seq_cp``)
the executor must apply before the next decode. A conversation is the public word; a *sequence*
here is the decode thread's state of one conversation, and a *seq id* is the llama.cpp slot it
holds only while it has KV cached (ids are pooled and taken back from idle sequences, least
recently used first).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from aiollama.step import Copy, Op, Remove


class Span:
    """Consecutive positions ``[start, end)`` held by the same set of sequences."""

    __slots__ = ("parent", "start", "length", "refs")

    def __init__(self, parent: Span | None, start: int, length: int, refs: int) -> None:
        self.parent = parent
        self.start = start
        self.length = length
        self.refs = refs

    @property
    def end(self) -> int:
        return self.start + self.length

    def __repr__(self) -> str:
        return f"Span([{self.start}, {self.end}) refs={self.refs})"


def cached(tail: Span | None) -> int:
    """How many positions a sequence with this tail holds."""
    return 0 if tail is None else tail.end


class KVCells:
    """Counts the cells in use as sequences grow, share prefixes, shrink and disappear."""

    def __init__(self, n_cells: int) -> None:
        self.n_cells = n_cells
        self.used = 0

    @property
    def free(self) -> int:
        return self.n_cells - self.used

    def extend(self, tail: Span | None, count: int) -> Span | None:
        """A sequence appended ``count`` positions; return its new tail."""
        if count <= 0:
            return tail
        self.used += count
        if tail is not None and tail.refs == 1:
            tail.length += count  # nobody else passes through the tail: grow it in place
            return tail
        return Span(tail, cached(tail), count, 1)

    def _span_at(self, tail: Span, n: int) -> Span:
        """The span on ``tail``'s path that ends exactly at ``n`` (0 < n <= tail.end), splitting one."""
        span = tail
        while span.start >= n:
            assert span.parent is not None
            span = span.parent
        if span.end > n:
            head = Span(span.parent, span.start, n - span.start, span.refs)
            span.parent = head
            span.length -= head.length
            span.start = n
            span = head
        return span

    def share(self, src: Span | None, n: int) -> Span | None:
        """A new sequence shares the first ``n`` positions of ``src``'s path; return its tail."""
        if src is None or n <= 0:
            return None
        if n > src.end:
            raise ValueError(f"cannot share {n} positions of a sequence that holds {src.end}")
        span: Span | None = self._span_at(src, n)
        tail = span
        while span is not None:
            span.refs += 1
            span = span.parent
        return tail

    def truncate(self, tail: Span | None, n: int) -> Span | None:
        """The sequence keeps only its first ``n`` positions; return its new tail."""
        if tail is None or n >= tail.end:
            return tail
        keep = self._span_at(tail, n) if n > 0 else None
        span: Span | None = tail
        while span is not keep:
            assert span is not None
            span.refs -= 1
            if span.refs == 0:
                self.used -= span.length
            span = span.parent
        return keep

    def release(self, tail: Span | None) -> None:
        """The sequence drops everything it holds."""
        self.truncate(tail, 0)


class Phase(enum.Enum):
    IDLE = "idle"  # no generation asked for; may hold a seq id and KV as a cache
    WAITING = "waiting"  # wants to generate, has no seq id yet
    RUNNING = "running"  # has a seq id and work in flight


@dataclass(eq=False)
class SeqState:
    """The decode thread's state of one conversation."""

    conv: int
    tokens: list[int]
    phase: Phase = Phase.IDLE
    seq_id: int | None = None
    kv: Span | None = None
    last_used: int = 0  # when it was last used: the least recently used idle one is evicted first
    started: int = 0  # admission order: the newest running one is preempted first
    follow: tuple[SeqState, int] | None = None  # (leader, prefix length) it waits to share

    @property
    def n_cached(self) -> int:
        return cached(self.kv)

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.n_cached


class KVManager:
    """Seq ids, the cells each sequence holds, and the KV operations that keep llama.cpp in step."""

    def __init__(self, n_cells: int, n_seq_max: int) -> None:
        self.cells = KVCells(n_cells)
        self.n_seq_max = n_seq_max
        self._free_ids = list(range(n_seq_max - 1, -1, -1))  # pop() gives the lowest id
        self._holders: dict[int, SeqState] = {}  # seq id -> sequence holding it
        self._ops: list[Op] = []

    @property
    def free(self) -> int:
        return self.cells.free

    @property
    def n_holders(self) -> int:
        return len(self._holders)

    def holders(self) -> Iterable[SeqState]:
        return self._holders.values()

    def take_ops(self) -> tuple[Op, ...]:
        """KV operations decided since the last call, in order."""
        ops, self._ops = tuple(self._ops), []
        return ops

    def assign(self, seq: SeqState) -> bool:
        """Give ``seq`` a seq id, taking one from the least recently used idle holder if none is
        free. False if every id is held by a sequence with work in flight."""
        if not self._free_ids:
            victim = self.lru_idle()
            if victim is None:
                return False
            self.drop(victim)
        seq.seq_id = self._free_ids.pop()
        self._holders[seq.seq_id] = seq
        return True

    def drop(self, seq: SeqState) -> None:
        """Release a sequence's cells and seq id."""
        if seq.seq_id is not None:
            self._ops.append(Remove(seq.seq_id))
            self.cells.release(seq.kv)
            del self._holders[seq.seq_id]
            self._free_ids.append(seq.seq_id)
            self._free_ids.sort(reverse=True)
        seq.kv = None
        seq.seq_id = None

    def truncate(self, seq: SeqState, keep: int) -> None:
        """Keep only the first ``keep`` cached positions of ``seq``."""
        if seq.seq_id is not None and keep < seq.n_cached:
            self._ops.append(Remove(seq.seq_id, keep))
            seq.kv = self.cells.truncate(seq.kv, keep)

    def share(self, seq: SeqState, donor: SeqState, n: int) -> None:
        """``seq`` drops what it holds and shares ``donor``'s first ``n`` positions instead."""
        assert seq.seq_id is not None and donor.seq_id is not None
        if seq.kv is not None:
            self._ops.append(Remove(seq.seq_id))
            self.cells.release(seq.kv)
        self._ops.append(Copy(donor.seq_id, seq.seq_id, n))
        seq.kv = self.cells.share(donor.kv, n)

    def extend(self, seq: SeqState, count: int) -> None:
        """``count`` more positions of ``seq`` were decoded into the context."""
        seq.kv = self.cells.extend(seq.kv, count)

    def resync(self, seq: SeqState, n_cached: int) -> None:
        """After an aborted or failed decode: the context holds ``n_cached`` positions of ``seq``."""
        have = seq.n_cached
        if n_cached > have:
            seq.kv = self.cells.extend(seq.kv, n_cached - have)
        elif n_cached < have:
            seq.kv = self.cells.truncate(seq.kv, n_cached)

    def lru_idle(self, holding_cells: bool = False) -> SeqState | None:
        """The least recently used idle sequence holding a seq id (and cells, if asked)."""
        best: SeqState | None = None
        for seq in self._holders.values():
            if seq.phase is Phase.IDLE and (not holding_cells or seq.kv is not None):
                if best is None or seq.last_used < best.last_used:
                    best = seq
        return best

    def evict_idle(self) -> bool:
        """Drop the least recently used idle sequence that holds cells; False if there is none."""
        victim = self.lru_idle(holding_cells=True)
        if victim is None:
            return False
        self.drop(victim)
        return True
