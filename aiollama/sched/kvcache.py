"""Seq ids and the prefix cache, over the cells of a unified llama.cpp KV cache. Pure Python.

The cells themselves are :class:`~aiollama.sched.kvtree.KVCells`, a radix tree of every cached prefix.
:class:`KVManager` is the mechanism under the scheduler's policy: the pool of seq ids, which
*holder* holds which, the cells each holds, the prefix cache, and the log of KV operations the
executor must apply before the next decode. A conversation is the public word; a *sequence* here is
the decode thread's state of one conversation, and a *seq id* is the llama.cpp slot a holder keeps
while it has cells. Holders are sequences, and cache entries: what a closed conversation had cached,
kept as a prefix for any later conversation that starts with the same tokens.

When cells are needed, idle holders give them back least recently used first, leaf first: a holder
gives up only the cells nobody else holds (its tail beyond the prefix it shares). With a host budget
its whole state is parked in host memory first (:mod:`aiollama.sched.hostcache`); without one only as
much of its tail as is needed is dropped.

With ``ordered`` (the engine's deterministic mode) every sequence must hold its cells in position
order, and llama.cpp gives a new token the lowest free cell: a cell freed below a sequence's cells
would take its next token out of order. So the executor never frees a cell; it hands it to a
tombstone sequence instead, and this manager counts those ``holes``. When the cells a step or a
restore needs are free only once the holes are reclaimed, it asks for a :class:`Compact`: the
cache is re-laid, prefixes still shared, and the holes are free again.

A recurrent or hybrid model's rules are :class:`~aiollama.sched.recurrent.RecurrentKV`'s.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence

from aiollama.sched.checkpoints import CheckpointStore
from aiollama.sched.hostcache import HostCache, Parked
from aiollama.sched.kvtree import KVCells, Span
from aiollama.sched.sequence import Phase, SeqState, unique_cells
from aiollama.sched.step import Compact, Copy, Op, Park, Relay, Remove, Restore, Shift

# A holder with fewer cells than this is not worth parking in host memory: it is dropped instead.
MIN_PARK_TOKENS = 16


class KVManager:
    """Seq ids, the cells each holder holds, and the KV operations that keep llama.cpp in step."""

    def __init__(self, n_cells: int, n_seq_max: int, host: HostCache | None = None, *,
                 ordered: bool = False) -> None:
        self.cells = KVCells(n_cells)
        self.checkpoints = CheckpointStore(0)  # recurrent states' (see aiollama.sched.recurrent)
        self.ordered = ordered
        self.holes = 0  # ordered: cells released here that the context still holds (tombstones)
        self.compactions = 0
        self.n_seq_max = n_seq_max
        self.host = host if host is not None else HostCache(0)
        self.parks = self.restores = self.evictions = 0
        self.n_entries = 0
        self.clock = itertools.count(1)  # orders uses (LRU) and admissions (newest is preempted)
        self._free_ids = list(range(n_seq_max - 1, -1, -1))  # pop() gives the lowest id
        self._holders: dict[int, SeqState] = {}  # seq id -> sequence holding it
        self._tails: dict[Span, set[SeqState]] = {}  # span -> holders whose path ends there
        self._ops: list[Op] = []
        self._entry_ids = itertools.count(-1, -1)

    def tick(self) -> int:
        return next(self.clock)

    @property
    def n_holders(self) -> int:
        return len(self._holders)

    def holders(self) -> Iterable[SeqState]:
        return self._holders.values()

    def take_ops(self) -> tuple[Op, ...]:
        """KV operations decided since the last call, in order."""
        ops, self._ops = tuple(self._ops), []
        return ops

    def _set_tail(self, seq: SeqState, tail: Span | None) -> None:
        if seq.kv is tail:
            return
        if seq.kv is not None:
            holders = self._tails[seq.kv]
            holders.discard(seq)
            if not holders:
                del self._tails[seq.kv]
        seq.kv = tail
        if tail is not None:
            self._tails.setdefault(tail, set()).add(seq)

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
            self._remove_all(seq)
            del self._holders[seq.seq_id]
            self.n_entries -= seq.entry
            bisect.insort(self._free_ids, seq.seq_id, key=lambda i: -i)  # kept in descending order
        self._set_tail(seq, None)
        seq.seq_id = None
        seq.restoring = False

    # cells

    def _remove_all(self, seq: SeqState) -> None:
        """``seq`` gives back every cell it holds (the tail it shares with none becomes free)."""
        assert seq.seq_id is not None
        self._ops.append(Remove(seq.seq_id))
        used = self.cells.used
        self.cells.release(seq.kv)
        self._released(used)

    def truncate(self, seq: SeqState, keep: int) -> None:
        """Keep only the first ``keep`` cached positions of ``seq``."""
        if seq.seq_id is not None and keep < seq.n_cached:
            self._ops.append(Remove(seq.seq_id, keep))
            used = self.cells.used
            self._set_tail(seq, self.cells.truncate(seq.kv, keep))
            self._released(used)

    def share(self, seq: SeqState, donor: SeqState, n: int) -> None:
        """``seq`` drops what it holds and shares ``donor``'s first ``n`` positions instead."""
        assert seq.seq_id is not None and donor.seq_id is not None
        if seq.kv is not None:
            self._remove_all(seq)
            self._set_tail(seq, None)
        self._ops.append(Copy(donor.seq_id, seq.seq_id, n))
        self._set_tail(seq, self.cells.share(donor.kv, n))
        donor.last_used = self.tick()

    def extend(self, seq: SeqState, count: int) -> None:
        """``count`` more tokens of ``seq`` were decoded into the context."""
        start = seq.n_cached
        self._set_tail(seq, self.cells.extend(seq.kv, seq.tokens[start:start + count], seq.salt))

    def resync(self, seq: SeqState, n_cached: int) -> None:
        """After an aborted or failed decode: the context holds ``n_cached`` positions of ``seq``; of
        those past its history (a draft's) and its pending token's (its logits are gone), none stay."""
        keep, have = min(n_cached, len(seq.tokens) - 1), seq.n_cached
        if keep < n_cached and seq.seq_id is not None:  # the executor removes them (ordered: holds them)
            self._ops.append(Remove(seq.seq_id, keep))
            self.dropped(n_cached - keep)
        if keep > have:
            self.extend(seq, keep - have)
        elif keep < have:
            self._set_tail(seq, self.cells.truncate(seq.kv, keep))

    def shift(self, seq: SeqState, keep: int, n: int) -> None:
        """Context shift: drop cached positions ``[keep, keep + n)`` and move the rest down by ``n``.
        The caller checked that ``seq`` holds them alone, and drops the same tokens afterwards."""
        assert seq.seq_id is not None and unique_cells(seq) >= seq.n_cached - keep
        moved = seq.tokens[keep + n:seq.n_cached]
        self._ops.append(Shift(seq.seq_id, keep, n))
        used = self.cells.used
        self._set_tail(seq, self.cells.extend(self.cells.truncate(seq.kv, keep), moved, seq.salt))
        self._released(used)

    # the prefix cache and eviction

    def find(self, tokens: Sequence[int], limit: int, salt: str | None = None) -> tuple[SeqState | None, int]:
        """A holder of ``salt`` whose cells hold the longest cached prefix of ``tokens`` (at most
        ``limit`` long), and that prefix's length."""
        span, n = self.cells.find(tokens, limit, salt)
        if span is None:
            return None, 0
        for below in span.below():
            holders = self._tails.get(below)
            if holders:
                return next(iter(holders)), n
        raise AssertionError("a span in use with no holder below it")

    def lru_idle(self, holding_cells: bool = False, any_cells: bool = False) -> SeqState | None:
        """The least recently used holder that is not running (idle, or waiting for admission),
        holding cells of its own, or any cells, if asked."""
        return lru(self._holders.values(), holding_cells, any_cells)

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
                del seq.tokens[seq.n_cached:]

    def park(self, seq: SeqState, to_disk: bool = False) -> None:
        """Copy ``seq``'s cells to host memory, or via it to disk (the bytes come with the step's result)."""
        assert seq.seq_id is not None
        key = self.host.reserve(seq.tokens[:seq.n_cached], self.tick(), seq.salt, to_disk)
        self._ops.append(Park(seq.seq_id, key))
        self.parks += 1

    def restore(self, seq: SeqState, parked: Parked, n: int) -> None:
        """Put a parked state back into ``seq`` (which holds a seq id and no cells) and keep its
        first ``n`` positions, which ``seq.tokens`` begins with. Its tokens can be decoded from the
        next step on."""
        assert seq.seq_id is not None and seq.kv is None and parked.data is not None
        self.room(len(parked.tokens))
        self.host.take(parked.key)
        self._ops.append(Restore(seq.seq_id, parked.data))
        self._set_tail(seq, self.cells.extend(None, parked.tokens, seq.salt))
        self.truncate(seq, n)
        seq.restoring = True
        seq.restores += 1
        self.restores += 1

    # ordered cells

    def _released(self, used: int) -> None:
        """Cells went from ``used`` to ``self.cells.used``: ordered, the context keeps them as holes."""
        if self.ordered:
            self.holes += used - self.cells.used

    def dropped(self, n: int) -> None:
        """The executor removed ``n`` cells this manager never counted (a draft's rejected tokens)."""
        if self.ordered:
            self.holes += n

    def room(self, needed: int) -> None:
        """Ordered: ``needed`` free cells above every held one, the cache re-laid if holes are in the
        way (``free_cells`` decides what is evicted; this only reclaims what was)."""
        if self.ordered and self.holes and self.cells.free - self.holes < needed:
            self.compact()

    def compact(self) -> None:
        """Re-lay every holder's cells (see :class:`~aiollama.sched.step.Compact`)."""
        self._ops.append(Compact(relays(self._holders)))
        self.holes = 0
        self.compactions += 1

    def restored(self, seq: SeqState, ok: bool) -> None:
        """The executor put the state back (or could not: ``seq`` then holds nothing)."""
        seq.restoring = False
        if not ok:
            self._set_tail(seq, self.cells.truncate(seq.kv, 0))

    def retire(self, seq: SeqState) -> None:
        """A closed conversation: what it had cached stays as a cache entry (unless another holder
        holds all of it, or it holds nothing); entries that it holds all of go."""
        if seq.seq_id is None or seq.kv is None or seq.kv.refs > 1:
            self.drop(seq)
            return
        seq.conv, seq.entry, seq.phase = next(self._entry_ids), True, Phase.IDLE
        self.n_entries += 1
        del seq.tokens[seq.n_cached:]
        seq.follow, seq.last_used = None, self.tick()
        for other in entries_below(seq, self._tails):
            self.drop(other)

    def clear_cache(self) -> None:
        """Drop every cache entry and every parked state."""
        for seq in [h for h in self._holders.values() if h.entry]:
            self.drop(seq)
        self.host.clear()

    def cells_cached(self) -> int:
        """Cells held by cache entries only (not by any conversation)."""
        return self.cells.used - cells_on_paths(h for h in self._holders.values() if not h.entry)


def entries_below(seq: SeqState, tails: Mapping[Span, set[SeqState]]) -> list[SeqState]:
    """The cache entries (other than ``seq``) whose path ends on ``seq``'s: it holds all of theirs."""
    found: list[SeqState] = []
    span: Span | None = seq.kv
    while span is not None:
        found += [other for other in tails.get(span, ()) if other.entry and other is not seq]
        span = span.parent
    return found


def lru(holders: Iterable[SeqState], holding_cells: bool, any_cells: bool) -> SeqState | None:
    best: SeqState | None = None
    for seq in holders:
        if seq.phase is Phase.RUNNING:
            continue
        if (holding_cells and unique_cells(seq) == 0) or (any_cells and seq.kv is None):
            continue
        if best is None or seq.last_used < best.last_used:
            best = seq
    return best


def cells_on_paths(holders: Iterable[SeqState]) -> int:
    """The cells these holders' paths pass through, each counted once."""
    seen: set[int] = set()
    n = 0
    for seq in holders:
        span = seq.kv
        while span is not None and id(span) not in seen:
            seen.add(id(span))
            n += span.length
            span = span.parent
    return n


def relays(holders: Mapping[int, SeqState]) -> tuple[Relay, ...]:
    """How to re-lay the cache (by seq id): each path of the prefix tree is restored once, by the
    first holder through it; later holders share it."""
    by_span: dict[Span, int] = {}  # span -> the seq id that restores it
    out: list[Relay] = []
    for seq_id in sorted(holders):
        path: list[Span] = []
        span = holders[seq_id].kv
        while span is not None:
            path.append(span)
            span = span.parent
        if not path:
            continue
        path.reverse()
        donor: int | None = None
        shared = 0
        for span in path:
            if span not in by_span:
                break
            donor, shared = by_span[span], span.end
        for span in path:
            by_span.setdefault(span, seq_id)
        out.append(Relay(seq_id, donor, shared))
    return tuple(out)
