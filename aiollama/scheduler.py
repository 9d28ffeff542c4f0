"""The scheduler: which sequences run, and which tokens go into each decode step.

Pure Python: it imports neither cffi nor anyio, and is tested with a fake KV cache. The decode thread
tells it what callers asked for (conversations added, prompted, forked, submitted, finished,
removed), asks it for a :class:`~aiollama.step.Plan` each step, and hands it the step's result.
The mechanism underneath (seq ids, cells, KV operations) is :class:`~aiollama.kvcache.KVManager`.

Policy, in the order it is applied each step:

1. Admission. Conversations that want to generate wait FIFO (preempted ones go first) for a seq id.
   A seq id comes from the free pool, else from the least recently used idle conversation, whose
   KV is dropped (it is re-evaluated transparently when used again).
2. Prefix sharing. An admitted sequence without KV shares the longest cached prefix any other
   sequence holds (``seq_cp``, free in a unified cache). If another running sequence is still
   prefilling a longer common prefix, it waits for that one instead of evaluating it twice.
3. Slices. Every running sequence with one pending token (a decode row) goes first; prompt chunks
   follow, round-robin, in what is left of ``step_tokens`` (but at least ``MIN_PREFILL_CHUNK``
   tokens, so prompts progress even when decode rows fill the budget). A long prompt therefore
   never freezes running streams, and a step holds at most
   ``max(step_tokens, decode rows + MIN_PREFILL_CHUNK)`` tokens, never more than ``n_batch``.
4. Room. If the slices need more KV cells than are free: evict idle conversations (least recently
   used first), then shrink prompt chunks, then preempt the most recently started stream, which
   keeps its tokens and resumes later from the front of the queue.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence

from aiollama.errors import ContextFull, InvalidRequestError
from aiollama.kvcache import KVManager, Phase, SeqState
from aiollama.step import Op, Plan, Slice, StepResult, StepStatus

# Sharing a prefix that is still being prefilled is worth waiting for only if it saves this much.
MIN_SHARED_WAIT = 32
# A prompt chunk gets at least this many tokens a step, even when decode rows fill the budget.
MIN_PREFILL_CHUNK = 16


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
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
        self.kv = KVManager(n_ctx, n_seq_max)
        self._seqs: dict[int, SeqState] = {}
        self._waiting: deque[SeqState] = deque()
        self._running: list[SeqState] = []
        self._admitted: list[int] = []
        self._clock = itertools.count(1)  # orders uses (LRU) and admissions (newest is preempted)
        self._rr = 0

    # what callers asked for

    def get(self, conv: int) -> SeqState:
        return self._seqs[conv]

    def __contains__(self, conv: int) -> bool:
        return conv in self._seqs

    def sequences(self) -> list[SeqState]:
        """Every live sequence (a read for tests and statistics; do not modify them)."""
        return list(self._seqs.values())

    def add(self, conv: int, tokens: Iterable[int] = ()) -> SeqState:
        if conv in self._seqs:
            raise KeyError(f"conversation {conv} already exists")
        seq = SeqState(conv, list(tokens), last_used=next(self._clock))
        self._seqs[conv] = seq
        return seq

    def append(self, conv: int, tokens: Iterable[int]) -> None:
        seq = self._seqs[conv]
        seq.tokens.extend(tokens)
        seq.last_used = next(self._clock)

    def fork(self, parent: int, child: int, n_tokens: int | None = None) -> SeqState:
        """The child starts with the parent's first ``n_tokens`` tokens (all of them by default);
        it shares their KV once it runs (prefix sharing)."""
        src = self._seqs[parent]
        src.last_used = next(self._clock)
        return self.add(child, src.tokens if n_tokens is None else src.tokens[:n_tokens])

    def submit(self, conv: int) -> None:
        """The conversation wants to generate. Raises ContextFull if its history can never fit."""
        seq = self._seqs[conv]
        # Callers refuse a second generation before it gets here (ConversationBusy).
        assert seq.phase is Phase.IDLE, f"conversation {conv} is already generating"
        if not seq.tokens:
            raise InvalidRequestError("nothing to generate from: prompt the conversation first")
        if len(seq.tokens) >= self.n_ctx:
            raise ContextFull(
                f"the conversation holds {len(seq.tokens)} tokens; the context has {self.n_ctx}")
        seq.phase = Phase.WAITING
        seq.last_used = next(self._clock)
        self._waiting.append(seq)

    def finish(self, conv: int) -> None:
        """The generation ended (or was cancelled); the sequence keeps its seq id and KV as a cache."""
        seq = self._seqs[conv]
        if seq.phase is Phase.WAITING:
            self._waiting.remove(seq)
        elif seq.phase is Phase.RUNNING:
            self._running.remove(seq)
        seq.phase = Phase.IDLE
        seq.follow = None
        seq.last_used = next(self._clock)

    def remove(self, conv: int) -> None:
        """The conversation is closed: free its seq id and cells."""
        self.finish(conv)
        self.kv.drop(self._seqs.pop(conv))

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def n_live(self) -> int:
        return len(self._seqs)

    @property
    def n_active(self) -> int:
        return len(self._running)

    @property
    def n_queued(self) -> int:
        return len(self._waiting)

    # the step

    def schedule(self) -> Plan:
        """The next step's plan. Building it has effects: admissions, prefix sharing, evictions and
        preemptions are decided here, and their KV operations lead the plan."""
        self._admit()
        slices = self._fit(self._slices())
        admitted, self._admitted = tuple(self._admitted), []
        return Plan(self.kv.take_ops(), tuple(slices), admitted)

    def update(self, plan: Plan, result: StepResult) -> bool:
        """Apply a step's result: the decoded tokens are cached and sampled tokens join the history;
        after a failure the cache is resynced with what the context holds. Returns False only for a
        NO_KV_SLOT that nothing could be freed for."""
        if result.status is StepStatus.OK:
            for s in plan.slices:
                self.kv.extend(self._seqs[s.conv], len(s.tokens))
            for sampled in result.sampled:
                self._seqs[sampled.conv].tokens.append(sampled.token)
            return True
        if result.status is StepStatus.NO_KV_SLOT:
            return self.make_room()
        for conv, n_cached in result.n_cached.items():
            if conv in self._seqs:
                self.kv.resync(self._seqs[conv], n_cached)
        return True

    def make_room(self) -> bool:
        """llama.cpp found no KV slot although the plan fit: free cells by force. False if it cannot."""
        if self.kv.evict_idle():
            return True
        if len(self._running) > 1:
            self._preempt(max(self._running, key=lambda s: s.started))
            return True
        return False

    def take_ops(self) -> tuple[Op, ...]:
        """KV operations decided outside a plan (a close between steps); they also lead the next plan."""
        return self.kv.take_ops()

    # internals

    def _admit(self) -> None:
        while self._waiting:
            seq = self._waiting[0]
            if seq.seq_id is None and not self.kv.assign(seq):
                return
            self._waiting.popleft()
            seq.phase = Phase.RUNNING
            seq.started = next(self._clock)
            self._running.append(seq)
            self._admitted.append(seq.conv)
            if seq.pending <= 0:
                # everything is cached, but sampling needs the last token's logits: evaluate it again
                self.kv.truncate(seq, len(seq.tokens) - 1)
            self._find_prefix(seq)

    def _find_prefix(self, seq: SeqState) -> None:
        """Share the longest cached prefix, or arrange to wait for a longer one being prefilled."""
        limit = len(seq.tokens) - 1  # at least one token must be evaluated for logits
        best, best_n = None, seq.n_cached
        lead, lead_n = None, 0
        for other in self.kv.holders():
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
            self.kv.share(seq, best, best_n)
        if lead is not None and lead_n >= seq.n_cached + MIN_SHARED_WAIT:
            seq.follow = (lead, lead_n)

    def _waits(self, seq: SeqState) -> bool:
        """True while the sequence waits for a leader to prefill the prefix they share."""
        if seq.follow is None:
            return False
        lead, n = seq.follow
        if lead.seq_id is not None and lead.n_cached >= n:
            seq.follow = None
            if n > seq.n_cached:
                self.kv.share(seq, lead, n)
            return False
        if lead.phase is Phase.RUNNING and lead.seq_id is not None and lead.pending > 1:
            return True
        seq.follow = None  # the leader went away before getting there
        return False

    def _slices(self) -> list[Slice]:
        slices: list[Slice] = []
        prefill: list[SeqState] = []
        for seq in self._running:
            assert seq.seq_id is not None
            if seq.pending == 1:
                if len(slices) < self.n_batch:
                    pos = seq.n_cached
                    slices.append(Slice(seq.conv, seq.seq_id, pos, (seq.tokens[pos],), True))
            elif not self._waits(seq):
                prefill.append(seq)
        room = self.n_batch - len(slices)
        budget = min(room, max(self.step_tokens - len(slices), MIN_PREFILL_CHUNK))
        if prefill and budget > 0:
            start = self._rr % len(prefill)
            self._rr += 1
            for seq in prefill[start:] + prefill[:start]:
                if budget <= 0:
                    break
                assert seq.seq_id is not None
                pos = seq.n_cached
                take = min(seq.pending, budget)
                slices.append(Slice(seq.conv, seq.seq_id, pos, tuple(seq.tokens[pos:pos + take]),
                                    take == seq.pending))
                budget -= take
        return slices

    def _fit(self, slices: list[Slice]) -> list[Slice]:
        """Drop or shrink slices until they fit in the free KV cells, evicting and preempting as needed."""
        def need() -> int:
            return sum(len(s.tokens) for s in slices)

        while need() > self.kv.free and self.kv.evict_idle():
            pass
        while need() > self.kv.free:
            prompt_slices = [i for i, s in enumerate(slices) if len(s.tokens) > 1 or not s.logits]
            if not prompt_slices:
                break
            i = prompt_slices[-1]
            s = slices[i]
            keep = len(s.tokens) - (need() - self.kv.free)
            if keep <= 0:
                del slices[i]
            else:
                slices[i] = Slice(s.conv, s.seq_id, s.pos, s.tokens[:keep], False)
        while need() > self.kv.free and self._running:
            newest = max(self._running, key=lambda s: s.started)
            slices = [s for s in slices if s.conv != newest.conv]
            self._preempt(newest)
        return slices

    def _preempt(self, seq: SeqState) -> None:
        """Stop a running sequence to free its cells; it resumes first when room returns."""
        self._running.remove(seq)
        self.kv.drop(seq)
        seq.phase = Phase.WAITING
        seq.follow = None
        self._waiting.appendleft(seq)
