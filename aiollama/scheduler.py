"""The scheduler: which sequences run, and which rows go into each decode step.

Pure Python: it imports neither cffi nor anyio, and is tested with a fake decoder. The decode thread
tells it what happened (conversations added, prompted, forked, started, finished, removed; a decode
committed or failed) and asks it for a :class:`Plan` each step.

Policy, in the order it is applied each step:

1. Admission. Conversations that want to generate wait FIFO (preempted ones go first) for a seq id.
   A seq id comes from the free pool, else from the least recently used idle conversation, whose
   KV is dropped (it is re-evaluated transparently when used again).
2. Prefix sharing. An admitted sequence without KV shares the longest cached prefix any other
   sequence holds (``seq_cp``, free in a unified cache). If another running sequence is still
   prefilling a longer common prefix, it waits for that one instead of evaluating it twice.
3. Rows. Every running sequence with one pending token (a decode row) goes first; prompt chunks
   follow, round-robin, in what is left of ``step_tokens`` (but at least ``MIN_PREFILL_CHUNK``
   tokens, so prompts progress even when decode rows fill the budget). A long prompt therefore
   never freezes running streams, and a step holds at most
   ``max(step_tokens, decode rows + MIN_PREFILL_CHUNK)`` tokens, never more than ``n_batch``.
4. Room. If the rows need more KV cells than are free: evict idle conversations (least recently
   used first), then shrink prompt chunks, then preempt the most recently started stream, which
   keeps its tokens and resumes later from the front of the queue.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass

from aiollama.errors import ContextFull, InvalidRequestError
from aiollama.kvcache import KVCells, Span, cached

# Sharing a prefix that is still being prefilled is worth waiting for only if it saves this much.
MIN_SHARED_WAIT = 32
# A prompt chunk gets at least this many tokens a step, even when decode rows fill the budget.
MIN_PREFILL_CHUNK = 16


class Phase(enum.Enum):
    IDLE = "idle"  # no generation asked for; may hold a seq id and KV as a cache
    WAITING = "waiting"  # wants to generate, has no seq id yet
    RUNNING = "running"  # has a seq id and work in flight


@dataclass(eq=False)
class Sequence:
    """The decode thread's view of one conversation."""

    conv: int
    tokens: list[int]
    phase: Phase = Phase.IDLE
    seq_id: int | None = None
    kv: Span | None = None
    last_used: int = 0  # when it was last used: the least recently used idle one is evicted first
    started: int = 0  # admission order: the newest running one is preempted first
    follow: tuple[Sequence, int] | None = None  # (leader, prefix length) it waits to share

    @property
    def n_cached(self) -> int:
        return cached(self.kv)

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.n_cached


@dataclass(frozen=True)
class Remove:
    """``seq_rm(seq_id, p0, -1)``: drop positions from p0 on."""

    seq_id: int
    p0: int = 0


@dataclass(frozen=True)
class Copy:
    """``seq_cp(src, dst, 0, n)``: dst shares src's first n positions."""

    src: int
    dst: int
    n: int


Op = Remove | Copy


@dataclass(frozen=True)
class Row:
    """Consecutive tokens of one sequence; only a chunk that completes the pending tokens wants logits."""

    conv: int
    seq_id: int
    pos: int
    tokens: tuple[int, ...]
    logits: bool


@dataclass(frozen=True)
class Plan:
    ops: tuple[Op, ...] = ()
    rows: tuple[Row, ...] = ()

    @property
    def n_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


@dataclass(frozen=True)
class Counts:
    live: int
    active: int
    queued: int
    kv_cells_used: int
    kv_cells_total: int
    seq_ids_used: int


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """Length of the common prefix of two token lists, comparing slices at C speed."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Scheduler:
    """Sequences, seq ids and KV cells of one context, and each step's plan."""

    def __init__(self, *, n_ctx: int, n_seq_max: int, n_batch: int, step_tokens: int) -> None:
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.step_tokens = min(step_tokens, n_batch)
        self.cells = KVCells(n_ctx)
        self._free_ids = list(range(n_seq_max - 1, -1, -1))  # pop() gives the lowest id
        self._seqs: dict[int, Sequence] = {}
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._holders: dict[int, Sequence] = {}  # seq id -> sequence holding it
        self._ops: list[Op] = []
        self._clock = itertools.count(1)  # orders uses (LRU) and admissions (newest is preempted)
        self._rr = 0

    # what the decode thread tells it

    def get(self, conv: int) -> Sequence:
        return self._seqs[conv]

    def __contains__(self, conv: int) -> bool:
        return conv in self._seqs

    def add(self, conv: int, tokens: Iterable[int] = ()) -> Sequence:
        if conv in self._seqs:
            raise KeyError(f"conversation {conv} already exists")
        seq = Sequence(conv, list(tokens), last_used=self._tick())
        self._seqs[conv] = seq
        return seq

    def append(self, conv: int, tokens: Iterable[int]) -> None:
        seq = self._seqs[conv]
        seq.tokens.extend(tokens)
        seq.last_used = self._tick()

    def fork(self, parent: int, child: int) -> Sequence:
        """The child starts with the parent's history; it shares KV once it runs (prefix sharing)."""
        src = self._seqs[parent]
        src.last_used = self._tick()
        return self.add(child, src.tokens)

    def submit(self, conv: int) -> None:
        """The conversation wants to generate. Raises ContextFull if its history can never fit."""
        seq = self._seqs[conv]
        if seq.phase is not Phase.IDLE:
            raise RuntimeError(f"conversation {conv} is already generating")
        if not seq.tokens:
            raise InvalidRequestError("nothing to generate from: prompt the conversation first")
        if len(seq.tokens) >= self.n_ctx:
            raise ContextFull(
                f"the conversation holds {len(seq.tokens)} tokens; the context has {self.n_ctx}")
        seq.phase = Phase.WAITING
        seq.last_used = self._tick()
        self._waiting.append(seq)

    def add_token(self, conv: int, token: int) -> None:
        """A token was sampled for a running sequence; it is decoded in the next step."""
        self._seqs[conv].tokens.append(token)

    def finish(self, conv: int) -> None:
        """The generation ended (or was cancelled); the sequence keeps its seq id and KV as a cache."""
        seq = self._seqs[conv]
        if seq.phase is Phase.WAITING:
            self._waiting.remove(seq)
        elif seq.phase is Phase.RUNNING:
            self._running.remove(seq)
        seq.phase = Phase.IDLE
        seq.follow = None
        seq.last_used = self._tick()

    def remove(self, conv: int) -> None:
        """The conversation is closed: free its seq id and cells."""
        self.finish(conv)
        seq = self._seqs.pop(conv)
        self._drop(seq)

    def commit(self, plan: Plan) -> None:
        """The plan's decode succeeded: its rows are cached now."""
        for row in plan.rows:
            seq = self._seqs[row.conv]
            seq.kv = self.cells.extend(seq.kv, len(row.tokens))

    def resync(self, conv: int, n_cached: int) -> None:
        """After an aborted or failed decode: the context holds ``n_cached`` positions of ``conv``."""
        seq = self._seqs[conv]
        have = seq.n_cached
        if n_cached > have:
            seq.kv = self.cells.extend(seq.kv, n_cached - have)
        elif n_cached < have:
            seq.kv = self.cells.truncate(seq.kv, n_cached)

    def make_room(self) -> bool:
        """llama.cpp found no KV slot although the plan fit: free cells by force. False if it cannot."""
        victim = self._lru_idle(holding_cells=True)
        if victim is not None:
            self._drop(victim)
            return True
        if len(self._running) > 1:
            self._preempt(max(self._running, key=lambda s: s.started))
            return True
        return False

    # the plan

    def _tick(self) -> int:
        return next(self._clock)

    def schedule(self) -> Plan:
        self._admit()
        rows = self._rows()
        rows = self._fit(rows)
        return Plan(self.take_ops(), tuple(rows))

    def take_ops(self) -> tuple[Op, ...]:
        """KV operations decided since the last plan (they also lead the next plan)."""
        ops, self._ops = tuple(self._ops), []
        return ops

    def counts(self) -> Counts:
        return Counts(
            live=len(self._seqs),
            active=len(self._running),
            queued=len(self._waiting),
            kv_cells_used=self.cells.used,
            kv_cells_total=self.cells.n_cells,
            seq_ids_used=len(self._holders),
        )

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    # internals

    def _drop(self, seq: Sequence) -> None:
        """Release a sequence's cells and seq id."""
        if seq.seq_id is not None:
            self._ops.append(Remove(seq.seq_id))
            self.cells.release(seq.kv)
            del self._holders[seq.seq_id]
            self._free_ids.append(seq.seq_id)
            self._free_ids.sort(reverse=True)
        seq.kv = None
        seq.seq_id = None

    def _lru_idle(self, holding_cells: bool = False) -> Sequence | None:
        """The least recently used idle sequence holding a seq id (and cells, if asked)."""
        best: Sequence | None = None
        for seq in self._holders.values():
            if seq.phase is Phase.IDLE and (not holding_cells or seq.kv is not None):
                if best is None or seq.last_used < best.last_used:
                    best = seq
        return best

    def _take_seq_id(self) -> int | None:
        if not self._free_ids:
            victim = self._lru_idle()
            if victim is None:
                return None
            self._drop(victim)
        return self._free_ids.pop()

    def _admit(self) -> None:
        while self._waiting:
            seq = self._waiting[0]
            if seq.seq_id is None:
                sid = self._take_seq_id()
                if sid is None:
                    return
                seq.seq_id = sid
                self._holders[sid] = seq
            self._waiting.popleft()
            seq.phase = Phase.RUNNING
            seq.started = self._tick()
            self._running.append(seq)
            if seq.pending <= 0:
                # everything is cached, but sampling needs the last token's logits: evaluate it again
                keep = len(seq.tokens) - 1
                self._ops.append(Remove(seq.seq_id, keep))
                seq.kv = self.cells.truncate(seq.kv, keep)
            self._find_prefix(seq)

    def _find_prefix(self, seq: Sequence) -> None:
        """Share the longest cached prefix, or arrange to wait for a longer one being prefilled."""
        assert seq.seq_id is not None
        limit = len(seq.tokens) - 1  # at least one token must be evaluated for logits
        best, best_n = None, seq.n_cached
        lead, lead_n = None, 0
        for other in self._holders.values():
            if other is seq:
                continue
            n = min(common_prefix(seq.tokens, other.tokens), limit)
            have = min(n, other.n_cached)
            if have > best_n:
                best, best_n = other, have
            if (other.phase is Phase.RUNNING and other.follow is None and n > other.n_cached
                    and n > lead_n):
                lead, lead_n = other, n
        if best is not None:
            self._share(seq, best, best_n)
        if lead is not None and lead_n >= seq.n_cached + MIN_SHARED_WAIT:
            seq.follow = (lead, lead_n)

    def _share(self, seq: Sequence, donor: Sequence, n: int) -> None:
        assert seq.seq_id is not None and donor.seq_id is not None
        if seq.kv is not None:
            self._ops.append(Remove(seq.seq_id))
            self.cells.release(seq.kv)
        self._ops.append(Copy(donor.seq_id, seq.seq_id, n))
        seq.kv = self.cells.share(donor.kv, n)

    def _waits(self, seq: Sequence) -> bool:
        """True while the sequence waits for a leader to prefill the prefix they share."""
        if seq.follow is None:
            return False
        lead, n = seq.follow
        if lead.seq_id is not None and lead.n_cached >= n:
            seq.follow = None
            if n > seq.n_cached:
                self._share(seq, lead, n)
            return False
        if lead.phase is Phase.RUNNING and lead.seq_id is not None and lead.pending > 1:
            return True
        seq.follow = None  # the leader went away before getting there
        return False

    def _rows(self) -> list[Row]:
        rows: list[Row] = []
        prefill: list[Sequence] = []
        for seq in self._running:
            assert seq.seq_id is not None
            if seq.pending == 1:
                if len(rows) < self.n_batch:
                    pos = seq.n_cached
                    rows.append(Row(seq.conv, seq.seq_id, pos, (seq.tokens[pos],), True))
            elif not self._waits(seq):
                prefill.append(seq)
        room = self.n_batch - len(rows)
        budget = min(room, max(self.step_tokens - len(rows), MIN_PREFILL_CHUNK))
        if prefill and budget > 0:
            start = self._rr % len(prefill)
            self._rr += 1
            for seq in prefill[start:] + prefill[:start]:
                if budget <= 0:
                    break
                assert seq.seq_id is not None
                pos = seq.n_cached
                take = min(seq.pending, budget)
                done = take == seq.pending
                rows.append(Row(seq.conv, seq.seq_id, pos, tuple(seq.tokens[pos:pos + take]), done))
                budget -= take
        return rows

    def _fit(self, rows: list[Row]) -> list[Row]:
        """Drop or shrink rows until they fit in the free KV cells, evicting and preempting as needed."""
        def need() -> int:
            return sum(len(r.tokens) for r in rows)

        while need() > self.cells.free:
            victim = self._lru_idle(holding_cells=True)
            if victim is None:
                break
            self._drop(victim)
        while need() > self.cells.free:
            prompt_rows = [i for i, r in enumerate(rows) if len(r.tokens) > 1 or not r.logits]
            if not prompt_rows:
                break
            i = prompt_rows[-1]
            r = rows[i]
            excess = need() - self.cells.free
            keep = len(r.tokens) - excess
            if keep <= 0:
                del rows[i]
            else:
                rows[i] = Row(r.conv, r.seq_id, r.pos, r.tokens[:keep], False)
        while need() > self.cells.free and self._running:
            newest = max(self._running, key=lambda s: s.started)
            rows = [r for r in rows if r.conv != newest.conv]
            self._preempt(newest)
        return rows

    def _preempt(self, seq: Sequence) -> None:
        """Stop a running sequence to free its cells; it resumes first when room returns."""
        self._running.remove(seq)
        self._drop(seq)
        seq.phase = Phase.WAITING
        seq.follow = None
        self._waiting.appendleft(seq)
