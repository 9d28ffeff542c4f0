"""Bookkeeping of KV cells and seq ids, mirroring a unified llama.cpp KV cache. Pure Python.

In a unified cache ``seq_cp(src, dst, 0, n)`` makes ``dst`` share ``src``'s cells for positions
``[0, n)``; a cell is freed once no sequence holds it. :class:`KVCells` models exactly that as a tree
of spans: each sequence's cache is the path from its tail span to the root, and a span's ``refs``
counts the sequences whose path passes through it. Since sequences that share a span hold the same
tokens there, the tree is also a radix tree of the cached token prefixes.

:class:`KVManager` is the mechanism under the scheduler's policy: the pool of seq ids, which
*holder* holds which, the cells each holds, the prefix cache, and the log of KV operations the
executor must apply before the next decode. A conversation is the public word; a *sequence* here is
the decode thread's state of one conversation, and a *seq id* is the llama.cpp slot a holder keeps
while it has cells. Holders are sequences, and cache entries: what a closed conversation had cached,
kept as a prefix for any later conversation that starts with the same tokens.

When cells are needed, idle holders give them back least recently used first, leaf first: a holder
gives up only the cells nobody else holds (its tail beyond the prefix it shares). With a host budget
its whole state is parked in host memory first (:mod:`aiollama.hostcache`); without one only as
much of its tail as is needed is dropped.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from aiollama.hostcache import HostCache, Parked, common_prefix
from aiollama.step import Copy, Op, Park, Remove, Restore, Shift

# A holder with fewer cells than this is not worth parking in host memory: it is dropped instead.
MIN_PARK_TOKENS = 16


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
    """The decode thread's state of one conversation, or of one cache entry (``entry``)."""

    conv: int
    tokens: list[int]
    phase: Phase = Phase.IDLE
    seq_id: int | None = None
    kv: Span | None = None
    last_used: int = 0  # when it was last used: the least recently used idle one is evicted first
    started: int = 0  # admission order: the newest running one is preempted first
    follow: tuple[SeqState, int] | None = None  # (leader, prefix length) it waits to share
    entry: bool = False  # a cache entry: a closed conversation's prefix, no conversation behind it
    restoring: bool = False  # a parked state is being put back this step: no tokens for it yet
    n_keep: int | None = None  # context shift: keep this many first tokens; None: no shift
    # what the current generation cost (reset when it is submitted)
    prompt_tokens: int = -1  # history at its first admission; -1 before
    cached_tokens: int = 0  # of those, not evaluated
    preemptions: int = 0
    restores: int = 0

    @property
    def n_cached(self) -> int:
        return cached(self.kv)

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.n_cached


def unique_cells(seq: SeqState) -> int:
    """Cells only ``seq`` holds: the end of its path that nobody else's passes through."""
    n, span = 0, seq.kv
    while span is not None and span.refs == 1:
        n += span.length
        span = span.parent
    return n


class KVManager:
    """Seq ids, the cells each holder holds, and the KV operations that keep llama.cpp in step."""

    def __init__(self, n_cells: int, n_seq_max: int, host: HostCache | None = None) -> None:
        self.cells = KVCells(n_cells)
        self.n_seq_max = n_seq_max
        self.host = host if host is not None else HostCache(0)
        self.parks = self.restores = self.evictions = 0
        self.n_entries = 0
        self.clock = itertools.count(1)  # orders uses (LRU) and admissions (newest is preempted)
        self._free_ids = list(range(n_seq_max - 1, -1, -1))  # pop() gives the lowest id
        self._holders: dict[int, SeqState] = {}  # seq id -> sequence holding it
        self._ops: list[Op] = []
        self._entry_ids = itertools.count(-1, -1)

    def tick(self) -> int:
        return next(self.clock)

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

    # seq ids

    def assign(self, seq: SeqState) -> bool:
        """Give ``seq`` a seq id, taking one from the least recently used idle holder if none is
        free. False if every id is held by a sequence with work in flight."""
        if not self._free_ids:
            victim = self.lru_idle()
            if victim is None:
                return False
            self.evict(victim, victim.n_cached, whole=True)
        seq.seq_id = self._free_ids.pop()
        self._holders[seq.seq_id] = seq
        return True

    def drop(self, seq: SeqState) -> None:
        """Release a holder's cells and seq id."""
        if seq.seq_id is not None:
            self._ops.append(Remove(seq.seq_id))
            self.cells.release(seq.kv)
            del self._holders[seq.seq_id]
            self.n_entries -= seq.entry
            self._free_ids.append(seq.seq_id)
            self._free_ids.sort(reverse=True)
        seq.kv = None
        seq.seq_id = None
        seq.restoring = False

    # cells

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
        donor.last_used = self.tick()

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

    def shift(self, seq: SeqState, keep: int, n: int) -> None:
        """Context shift: drop cached positions ``[keep, keep + n)`` and move the rest down by ``n``.
        The caller checked that ``seq`` holds them alone."""
        assert seq.seq_id is not None and unique_cells(seq) >= seq.n_cached - keep
        moved = seq.n_cached - keep - n
        self._ops.append(Shift(seq.seq_id, keep, n))
        seq.kv = self.cells.extend(self.cells.truncate(seq.kv, keep), moved)

    # the prefix cache and eviction

    def lru_idle(self, holding_cells: bool = False, any_cells: bool = False) -> SeqState | None:
        """The least recently used idle holder (holding cells of its own, or any cells, if asked)."""
        best: SeqState | None = None
        for seq in self._holders.values():
            if seq.phase is not Phase.IDLE:
                continue
            if (holding_cells and unique_cells(seq) == 0) or (any_cells and seq.kv is None):
                continue
            if best is None or seq.last_used < best.last_used:
                best = seq
        return best

    def free_cells(self, needed: int) -> bool:
        """Evict idle holders, least recently used first, until ``needed`` cells are free. Holders
        with cells of their own go first; when only cells several idle holders share are left, one
        of those goes whole, so the next one's become its own."""
        while self.cells.free < needed:
            victim = self.lru_idle(holding_cells=True)
            if victim is not None:
                self.evict(victim, needed - self.cells.free)
                continue
            victim = self.lru_idle(holding_cells=False, any_cells=True)
            if victim is None:
                return False
            self.evict(victim, victim.n_cached, whole=True)
        return True

    def evict(self, seq: SeqState, want: int, *, whole: bool = False) -> None:
        """Take cells back from an idle holder: park it and drop it when host memory takes it,
        otherwise drop only as much of its own tail as ``want`` (all of it with ``whole``)."""
        self.evictions += 1
        if self.host.enabled and seq.n_cached >= MIN_PARK_TOKENS:
            self.park(seq)
            whole = True
        keep = 0 if whole else seq.n_cached - min(want, unique_cells(seq))
        if keep <= 0 or (seq.entry and keep <= seq.n_cached - unique_cells(seq)):
            self.drop(seq)  # an entry reduced to what others hold is nothing of its own
        else:
            self.truncate(seq, keep)
            if seq.entry:
                del seq.tokens[keep:]

    def park(self, seq: SeqState) -> None:
        """Copy ``seq``'s cells to host memory (the bytes come with the step's result)."""
        assert seq.seq_id is not None
        key = self.host.reserve(seq.tokens[:seq.n_cached], self.tick())
        self._ops.append(Park(seq.seq_id, key))
        self.parks += 1

    def restore(self, seq: SeqState, parked: Parked, n: int) -> None:
        """Put a parked state back into ``seq`` (which holds a seq id and no cells) and keep its
        first ``n`` positions. Its tokens can be decoded from the next step on."""
        assert seq.seq_id is not None and seq.kv is None and parked.data is not None
        self.host.take(parked.key)
        self._ops.append(Restore(seq.seq_id, parked.data))
        seq.kv = self.cells.extend(None, len(parked.tokens))
        self.truncate(seq, n)
        seq.restoring = True
        seq.restores += 1
        self.restores += 1

    def restored(self, seq: SeqState, ok: bool) -> None:
        """The executor put the state back (or could not: ``seq`` then holds nothing)."""
        seq.restoring = False
        if not ok:
            seq.kv = self.cells.truncate(seq.kv, 0)

    def retire(self, seq: SeqState) -> None:
        """A closed conversation: what it had cached stays as a cache entry (unless some other
        holder already holds all of it, or it holds nothing)."""
        if seq.seq_id is None or seq.n_cached == 0:
            self.drop(seq)
            return
        seq.conv, seq.entry, seq.phase = next(self._entry_ids), True, Phase.IDLE
        self.n_entries += 1
        del seq.tokens[seq.n_cached:]
        seq.follow, seq.last_used = None, self.tick()
        for other in list(self._holders.values()):
            if other is seq:
                continue
            n = common_prefix(seq.tokens, other.tokens)
            if n >= seq.n_cached and other.n_cached >= seq.n_cached:
                self.drop(seq)  # another holder holds all of it
                return
            if other.entry and n >= other.n_cached:
                self.drop(other)  # this one holds all of that entry

    def clear_cache(self) -> None:
        """Drop every cache entry and every parked state."""
        for seq in [h for h in self._holders.values() if h.entry]:
            self.drop(seq)
        self.host.clear()

    def cells_cached(self) -> int:
        """Cells held by cache entries only (not by any conversation)."""
        live: set[int] = set()
        n_live = 0
        for seq in self._holders.values():
            if seq.entry:
                continue
            span = seq.kv
            while span is not None and id(span) not in live:
                live.add(id(span))
                n_live += span.length
                span = span.parent
        return self.cells.used - n_live


def best_prefix(tokens: Sequence[int], holders: Iterable[SeqState], skip: SeqState, limit: int) -> tuple[SeqState | None, int]:
    """The holder whose cells cover the longest prefix of ``tokens`` (at most ``limit``)."""
    best, best_n = None, 0
    for other in holders:
        if other is skip:
            continue
        n = min(common_prefix(tokens, other.tokens), limit, other.n_cached)
        if n > best_n:
            best, best_n = other, n
    return best, best_n
