"""The scheduler: which sequences run, and which tokens go into each decode step.

Pure Python: it imports neither cffi nor anyio, and is tested with a fake KV cache. The decode thread
tells it what callers asked for (conversations added, prompted, forked, rewound, submitted, finished,
removed), asks it for a :class:`~aiollama.step.Plan` each step, and hands it the step's result.
The mechanism underneath (seq ids, cells, the prefix cache, parking) is
:class:`~aiollama.kvcache.KVManager`.

Policy, in the order it is applied each step:

1. Admission. Conversations that want to generate wait in priority order (lowest value first; a
   waiting one gains a level every ``AGING_SECONDS`` seconds, so none waits forever; equal ones first
   come first served, preempted ones first among them) until fewer than ``max_running`` run and the cells they need (what they do not share, and a cell for each
   running stream's next token) are free or held by idle holders, then take a seq id. When
   nothing runs, the first one is admitted whatever it needs.
2. Prefix sharing. An admitted sequence shares the longest cached prefix any holder has (a running
   or idle conversation, or a cache entry left by a closed one: ``seq_cp``, free in a unified
   cache), or gets a parked state back from host memory when that saves at least
   ``MIN_RESTORE_GAIN`` tokens and half the cells it takes. If another running sequence is still
   prefilling a longer common prefix, it waits for that one instead of evaluating it twice.
3. Slices. Every running sequence with one pending token (a decode row) goes first; prompt chunks
   follow, round-robin within each priority (lower values first), in what is left of ``step_tokens`` (but at least ``MIN_PREFILL_CHUNK``
   tokens, so prompts progress even when decode rows fill the budget). A long prompt therefore
   never freezes running streams, and a step holds at most
   ``max(step_tokens, decode rows + MIN_PREFILL_CHUNK)`` tokens, never more than ``n_batch``.
   A sequence with a context-shift policy whose history has filled the context first drops the
   older half of what follows its first ``n_keep`` tokens. A generation that speculates gets an
   n-gram draft after its decode row (:mod:`aiollama.speculation`), within ``MAX_DRAFT_ROWS``
   rows a step in all.
4. Room. If the slices need more KV cells than are free: drafts are dropped, idle holders give
   theirs back (least recently used first, parked in host memory when it has room), then prompt
   chunks shrink, then
   the most recently started stream of the lowest priority is preempted: parked too, it keeps its
   tokens and resumes first among its equals when room returns.
5. Idle cells under load (a unified cache only). Every step's attention in a unified cache passes
   over every used cell, so cells that only idle holders hold (idle conversations, cache entries)
   slow every running stream, more the more the cache has served. Whenever generations have just
   ended or started while others run, idle holders give back the cells only they hold, least
   recently used first, until at most ``IDLE_CELLS`` are left (parked in host memory when it has
   room, so a later conversation that starts with them gets them back by a copy, not an
   evaluation). With nothing running they stay: they cost nothing then. A split cache gives each
   seq id cells of its own that no other sequence's attention reads, so there they stay too.
6. Lockstep. A generation guided by another sequence (classifier-free guidance) samples only in a
   step where both have logits: the two are admitted, preempted and finished together, and a
   slice of one that would give logits without the other waits (a prompt chunk keeps its last
   token back).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from aiollama import speculation
from aiollama.errors import ContextFull, InvalidRequestError
from aiollama.hostcache import HostCache
from aiollama.kvcache import MIN_PARK_TOKENS, KVManager, Phase, SeqState, unique_cells
from aiollama.kvtree import Span, common_prefix
from aiollama.speculation import DraftLength
from aiollama.step import Op, Plan, Slice, StepResult, StepStatus

# Sharing a prefix that is still being prefilled is worth waiting for only if it saves this much.
MIN_SHARED_WAIT = 32
# A prompt chunk gets at least this many tokens a step, even when decode rows fill the budget.
MIN_PREFILL_CHUNK = 16
# A parked state comes back only if it saves evaluating at least this many tokens.
MIN_RESTORE_GAIN = 16
# Draft tokens add at most this many rows to a step in all (the decode rows count too): drafts
# pay where steps are small, not where the batch is already full.
MAX_DRAFT_ROWS = 32
# A waiting generation's priority improves by one every this many seconds: nothing waits forever.
AGING_SECONDS = 5.0
# In a unified cache, the cells idle holders may keep while generations run (llama.cpp pads the
# span of a step's attention to 256 cells anyway).
IDLE_CELLS = 256

__all__ = ["MIN_PREFILL_CHUNK", "Scheduler", "common_prefix"]


class Scheduler:
    """Sequences, seq ids and KV cells of one context, and each step's plan.

    ``n_seq_max`` is how many seq ids the context has (holders of cached prefixes included);
    ``max_running`` how many sequences may generate at once (default: all of them). ``ordered``
    keeps each sequence's cells in position order (the deterministic mode; see
    :mod:`aiollama.kvcache`). ``kv_unified``: one pool of cells for every seq id, over which each
    step's attention passes (idle cells are then given back under load). ``draft_model``: drafting streams leave their drafts to the
    executor's draft model (the slice says how many tokens it may add) instead of n-grams.
    """

    def __init__(self, *, n_ctx: int, n_seq_max: int, n_batch: int, step_tokens: int, n_cells: int | None = None,
                 max_running: int | None = None, host_bytes: int = 0, can_shift: bool = True,
                 ordered: bool = False, draft_model: bool = False, kv_unified: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.step_tokens = min(step_tokens, n_batch)
        self.max_running = min(max_running or n_seq_max, n_seq_max)
        self.can_shift = can_shift  # the memory can move positions (seq_add)
        self.draft_model = draft_model  # drafts come from the executor's draft model, not n-grams
        # n_ctx: what one sequence can hold; n_cells: the cells of all (n_ctx in a unified cache)
        self.kv = KVManager(n_cells or n_ctx, n_seq_max, HostCache(host_bytes), ordered=ordered)
        self.preemptions = 0
        self.cache_hit_tokens = 0  # tokens an admission did not have to evaluate
        self._seqs: dict[int, SeqState] = {}
        self._waiting: deque[SeqState] = deque()
        self._running: list[SeqState] = []
        self._admitted: list[int] = []
        self._shifted: list[tuple[int, int, int]] = []
        self._rr = 0
        self._clock = clock
        self._pairs = 0  # guided generations submitted and not finished
        # unified: idle cells are given back under load, looked at when generations start or end
        self._trims = kv_unified and not ordered
        self._idle_changed = False
        self.idle_trims = 0  # idle holders that gave their cells back so running streams stay fast

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
        seq = SeqState(conv, list(tokens), last_used=self.kv.tick())
        self._seqs[conv] = seq
        return seq

    def append(self, conv: int, tokens: Iterable[int]) -> None:
        seq = self._seqs[conv]
        seq.tokens.extend(tokens)
        seq.last_used = self.kv.tick()

    def fork(self, parent: int, child: int, n_tokens: int | None = None) -> SeqState:
        """The child starts with the parent's first ``n_tokens`` tokens (all of them by default);
        it shares their KV once it runs (prefix sharing)."""
        src = self._seqs[parent]
        src.last_used = self.kv.tick()
        return self.add(child, src.tokens if n_tokens is None else src.tokens[:n_tokens])

    def rewind(self, conv: int, n_tokens: int) -> None:
        """Keep only the first ``n_tokens`` tokens of an idle conversation (and of its cache)."""
        seq = self._seqs[conv]
        assert seq.phase is Phase.IDLE, "callers rewind only conversations that do not generate"
        del seq.tokens[n_tokens:]
        self.kv.truncate(seq, n_tokens)
        seq.last_used = self.kv.tick()

    def submit(self, conv: int, n_keep: int | None = None, draft: int = 0, *, priority: int = 0,
               guide: int | None = None) -> tuple[int, int] | None:
        """The conversation wants to generate. With ``n_keep`` (a context-shift policy) a history too
        long for the context loses part of what follows its first ``n_keep`` tokens, and this
        returns ``(n_keep, n_dropped)``; without, it raises ContextFull. ``draft`` > 0: decode
        steps carry n-gram drafts of up to that many tokens. ``guide``: a conversation decoded in
        lockstep with this one (classifier-free guidance), which gets every sampled token too."""
        seq = self._seqs[conv]
        # Callers refuse a second generation before it gets here (ConversationBusy).
        assert seq.phase is Phase.IDLE, f"conversation {conv} is already generating"
        if not seq.tokens:
            raise InvalidRequestError("nothing to generate from: prompt the conversation first")
        partner = None
        if guide is not None:
            partner = self._seqs[guide]
            assert partner.phase is Phase.IDLE and partner is not seq, "callers check the guide"
            if not partner.tokens:
                raise InvalidRequestError("the guidance conversation is empty: prompt it first")
            if len(partner.tokens) >= self.n_ctx:
                raise ContextFull(f"the guidance conversation holds {len(partner.tokens)} tokens; "
                                  f"the context has {self.n_ctx}")
        if n_keep is not None and n_keep > self.n_ctx // 2:
            raise InvalidRequestError(f"n_keep ({n_keep}) must be at most half the context ({self.n_ctx // 2})")
        dropped = None
        if len(seq.tokens) >= self.n_ctx:
            if n_keep is None:
                raise ContextFull(
                    f"the conversation holds {len(seq.tokens)} tokens; the context has {self.n_ctx}")
            n = self._shift_size(len(seq.tokens), n_keep)
            self.kv.truncate(seq, min(seq.n_cached, n_keep))
            del seq.tokens[n_keep:n_keep + n]
            dropped = (n_keep, n)
        seq.n_keep = n_keep
        seq.draft = DraftLength(draft) if draft > 0 and partner is None else None
        seq.prompt_tokens, seq.cached_tokens, seq.preemptions, seq.restores = -1, 0, 0, 0
        seq.prompt_evaluated = 0
        seq.priority, seq.queued_at, seq.preempted = priority, self._clock(), False
        for s in (seq, partner) if partner is not None else (seq,):
            s.phase = Phase.WAITING
            s.last_used = self.kv.tick()
        if partner is not None:
            seq.guide, partner.owner = partner, seq
            partner.priority = priority
            self._pairs += 1
        self._waiting.append(seq)
        return dropped

    def finish(self, conv: int) -> None:
        """The generation ended (or was cancelled); the sequence keeps its seq id and KV as a cache,
        and so does the sequence that guided it."""
        seq = self._seqs[conv]
        assert seq.owner is None, "a guiding sequence finishes with the generation it guides"
        if seq.phase is Phase.WAITING:
            self._waiting.remove(seq)
        for s in (seq, seq.guide) if seq.guide is not None else (seq,):
            if s.phase is Phase.RUNNING:
                self._running.remove(s)
            s.phase = Phase.IDLE
            s.follow = s.n_keep = s.draft = s.owner = None
            s.last_used = self.kv.tick()
        if seq.guide is not None:
            self._pairs -= 1
        seq.guide = None
        self._idle_changed = True

    def remove(self, conv: int) -> None:
        """The conversation is closed: its cached prefix stays as a cache entry."""
        self.finish(conv)
        self.kv.retire(self._seqs.pop(conv))

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
        """The next step's plan. Building it has effects: admissions, prefix sharing, evictions,
        parking, context shifts and preemptions are decided here, and their KV operations lead the
        plan."""
        self._admit()
        if self._idle_changed and self._running:
            self._idle_changed = False
            self._trim_idle()
        slices = self._fit(self._slices())
        if self._pairs:
            slices = self._lockstep(slices)
        if self.kv.holes:  # ordered cells only: never summed on the common path
            self.kv.room(sum(s.cells for s in slices))
        admitted, self._admitted = tuple(self._admitted), []
        shifted, self._shifted = tuple(self._shifted), []
        return Plan(self.kv.take_ops(), tuple(slices), admitted, shifted)

    def update(self, plan: Plan, result: StepResult) -> bool:
        """Apply a step's result: the decoded tokens are cached and sampled tokens join the history;
        after a failure the cache is resynced with what the context holds. Returns False only for a
        NO_KV_SLOT that nothing could be freed for."""
        for key, data in result.parked.items():
            self.kv.host.fill(key, data)
        for seq in self.kv.holders():
            if seq.restoring:
                self.kv.restored(seq, result.restored.get(seq.seq_id or 0, False))
        if result.status is StepStatus.OK:
            taken: dict[int, int] = {}
            for sampled in result.sampled:
                seq = self._seqs[sampled.conv]
                seq.tokens.append(sampled.token)
                if seq.guide is not None:
                    seq.guide.tokens.append(sampled.token)
                taken[sampled.conv] = taken.get(sampled.conv, 0) + 1
            for s in plan.slices:
                seq = self._seqs[s.conv]
                offered = s.draft or result.drafted.get(s.conv, 0)
                if offered:
                    # the pending token and the draft tokens the sampler took have their cells;
                    # the executor removed the others' (all of them when no token was taken)
                    n = taken.get(s.conv, 1)
                    self.kv.extend(seq, n)
                    self.kv.dropped(offered - (n - 1))
                    if seq.draft is not None:
                        seq.draft.record(offered, n - 1)
                else:
                    self.kv.extend(seq, len(s.tokens))
            return True
        if result.status is StepStatus.NO_KV_SLOT:
            return self.make_room()
        for conv, n_cached in result.n_cached.items():
            if conv in self._seqs:
                self.kv.resync(self._seqs[conv], n_cached)
        return True

    def make_room(self) -> bool:
        """llama.cpp found no KV slot although the plan fit: free cells by force. False if it cannot."""
        victim = self.kv.lru_idle(holding_cells=True)
        if victim is not None:
            self.kv.evict(victim, victim.n_cached, whole=True)
            return True
        if self._several_running():
            self._preempt(self._victim())
            return True
        return False

    def take_ops(self) -> tuple[Op, ...]:
        """KV operations decided outside a plan (a close between steps); they also lead the next plan."""
        return self.kv.take_ops()

    # internals

    def _next_waiting(self) -> SeqState:
        """The waiting generation to admit next: the lowest priority value after aging, then the
        preempted, then the first come."""
        now = self._clock()
        return min(self._waiting, key=lambda s: (s.priority - int((now - s.queued_at) / AGING_SECONDS),
                                                 not s.preempted, s.queued_at))

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            seq = self._next_waiting()
            group = (seq, seq.guide) if seq.guide is not None else (seq,)
            if self._running:
                need = len(self._running)
                for s in group:
                    _, shared = self.kv.find(s.tokens, len(s.tokens) - 1)
                    need += len(s.tokens) - max(shared, s.n_cached)
                if not self.kv.free_cells(need):
                    return  # admitted now, it would only be preempted again
            if not all(s.seq_id is not None or self.kv.assign(s) for s in group):
                return  # a seq id this pair got stays with it (an idle holder's, until it runs)
            self._waiting.remove(seq)
            self._idle_changed = True
            started = self.kv.tick()
            for s in group:
                s.phase = Phase.RUNNING
                s.started = started
                self._running.append(s)
                self._admitted.append(s.conv)
                if s.pending <= 0:
                    # everything is cached, but sampling needs the last token's logits: evaluate it again
                    self.kv.truncate(s, len(s.tokens) - 1)
                self._find_prefix(s)
                self.cache_hit_tokens += s.n_cached
                s.prompt_evaluated += s.pending
                if s.prompt_tokens < 0:
                    s.prompt_tokens, s.cached_tokens = len(s.tokens), s.n_cached

    def _trim_idle(self) -> None:
        """Unified cache under load: idle holders give back the cells only they hold, least
        recently used first, until at most ``IDLE_CELLS`` cells are held by no running sequence."""
        live: set[Span] = set()
        n_live = 0
        for seq in self._running:
            span = seq.kv
            while span is not None and span not in live:
                live.add(span)
                n_live += span.length
                span = span.parent
        idle = self.kv.cells.used - n_live
        if idle <= IDLE_CELLS:
            return
        # least recently used first: first the cells each holds alone, then, for cells several
        # idle holders share, whole holders
        order = sorted((h for h in self.kv.holders() if h.phase is not Phase.RUNNING and h.kv is not None),
                       key=lambda h: h.last_used)
        for whole in (False, True):
            for victim in order:
                if idle <= IDLE_CELLS:
                    return
                if victim.seq_id is None or victim.kv is None or victim.kv in live \
                        or (not whole and unique_cells(victim) == 0):
                    continue  # gone already, or all it holds is held by running ones
                used = self.kv.cells.used
                self.kv.evict(victim, victim.n_cached if whole else idle - IDLE_CELLS, whole=whole)
                idle -= used - self.kv.cells.used
                self.idle_trims += 1

    def _find_prefix(self, seq: SeqState) -> None:
        """Share the longest cached prefix, restore a parked one, or arrange to wait for a longer
        one being prefilled."""
        limit = len(seq.tokens) - 1  # at least one token must be evaluated for logits
        best, best_n = self.kv.find(seq.tokens, limit)
        best_n = max(best_n, seq.n_cached)
        parked, parked_n = self.kv.host.best(seq.tokens, limit)
        if parked is not None and parked_n - best_n >= max(MIN_RESTORE_GAIN, len(parked.tokens) // 2) \
                and self.kv.free_cells(len(parked.tokens) + 1):
            if seq.kv is not None:
                self.kv.truncate(seq, 0)
            self.kv.restore(seq, parked, parked_n)
            return
        if best is not None and best is not seq and best_n > seq.n_cached:
            self.kv.share(seq, best, best_n)
        lead, lead_n = None, 0
        for other in self._running:
            if other is seq or other.follow is not None:
                continue
            n = min(common_prefix(seq.tokens, other.tokens), limit)
            if n > other.n_cached and n > lead_n:
                lead, lead_n = other, n
        if lead is not None and lead_n >= seq.n_cached + MIN_SHARED_WAIT:
            seq.follow = (lead, lead_n)

    def _waits(self, seq: SeqState) -> bool:
        """True while the sequence waits for a leader to prefill the prefix they share."""
        if seq.follow is None:
            return False
        lead, n = seq.follow
        if lead.seq_id is not None and lead.n_cached >= n and not lead.restoring:
            seq.follow = None
            if n > seq.n_cached:
                gained = n - seq.n_cached
                self.kv.share(seq, lead, n)
                self.cache_hit_tokens += gained
                if seq.cached_tokens < seq.prompt_tokens:  # still in its first prefill: not evaluated by it
                    seq.cached_tokens = min(seq.prompt_tokens, seq.cached_tokens + gained)
                seq.prompt_evaluated -= gained
            return False
        if lead.phase is Phase.RUNNING and lead.seq_id is not None and lead.pending > 1:
            return True
        seq.follow = None  # the leader went away before getting there
        return False

    def _shift_size(self, length: int, keep: int) -> int:
        """How many tokens after the first ``keep`` a shift drops from a history of ``length``: the
        older ones, leaving about half of the room after ``keep`` filled."""
        return length - keep - (self.n_ctx - 1 - keep) // 2

    def _shift(self, seq: SeqState) -> None:
        """The history filled the context: drop the older half of what follows the first
        ``n_keep`` tokens, moving the cached rest down when it holds those cells alone."""
        assert seq.n_keep is not None
        keep = seq.n_keep
        n = self._shift_size(len(seq.tokens), keep)
        if self.can_shift and seq.n_cached > keep + n and unique_cells(seq) >= seq.n_cached - keep:
            self.kv.shift(seq, keep, n)
        else:  # cells shared with another holder cannot move: evaluate the kept tail again
            self.kv.truncate(seq, min(seq.n_cached, keep))
        del seq.tokens[keep:keep + n]
        self._shifted.append((seq.conv, keep, n))

    def _slices(self) -> list[Slice]:
        slices: list[Slice] = []
        prefill: list[SeqState] = []
        drafting: list[int] = []
        for seq in self._running:
            assert seq.seq_id is not None
            if seq.restoring:
                continue
            if seq.n_keep is not None and len(seq.tokens) >= self.n_ctx:
                self._shift(seq)
            if seq.pending == 1:
                if len(slices) < self.n_batch:
                    pos = seq.n_cached
                    if seq.draft is not None:
                        drafting.append(len(slices))
                    slices.append(Slice(seq.conv, seq.seq_id, pos, (seq.tokens[pos],), True))
            elif not self._waits(seq):
                prefill.append(seq)
        rows = len(slices) + self._add_drafts(slices, drafting)
        room = self.n_batch - rows
        budget = min(room, max(self.step_tokens - rows, MIN_PREFILL_CHUNK))
        if prefill and budget > 0:
            start = self._rr % len(prefill)
            self._rr += 1
            for seq in sorted(prefill[start:] + prefill[:start], key=lambda s: s.priority):
                if budget <= 0:
                    break
                assert seq.seq_id is not None
                pos = seq.n_cached
                take = min(seq.pending, budget)
                slices.append(Slice(seq.conv, seq.seq_id, pos, tuple(seq.tokens[pos:pos + take]),
                                    take == seq.pending))
                budget -= take
        return slices

    def _add_drafts(self, slices: list[Slice], drafting: list[int]) -> int:
        """Extend the decode slices at ``drafting`` with n-gram drafts (or room for the draft
        model's), within ``MAX_DRAFT_ROWS`` rows in all and the context; return the rows added."""
        spare = min(self.n_batch, MAX_DRAFT_ROWS) - len(slices)
        added = 0
        for i in drafting:
            s = slices[i]
            seq = self._seqs[s.conv]
            assert seq.draft is not None
            limit = min(seq.draft.current, spare - added, self.n_ctx - 1 - s.pos)
            if self.draft_model:
                if limit > 0:
                    slices[i] = Slice(s.conv, s.seq_id, s.pos, s.tokens, True, model_draft=limit,
                                      history=seq.tokens)
                    added += limit
                continue
            tokens = speculation.draft(seq.tokens, limit)
            if tokens:
                slices[i] = Slice(s.conv, s.seq_id, s.pos, s.tokens + tokens, True, len(tokens))
                added += len(tokens)
        return added

    def _fit(self, slices: list[Slice]) -> list[Slice]:
        """Drop or shrink slices until they fit in the free KV cells, evicting and preempting as needed."""
        def need() -> int:
            return sum(s.cells for s in slices)

        self.kv.free_cells(need() - sum(s.draft + s.model_draft for s in slices))  # drafts never evict anything
        starved = False
        if need() > self.kv.free:  # drafts go first
            slices = [Slice(s.conv, s.seq_id, s.pos, s.tokens[:1], True) if s.draft or s.model_draft else s
                      for s in slices]
        while need() > self.kv.free:
            prompt_slices = [i for i, s in enumerate(slices) if len(s.tokens) > 1 or not s.logits]
            if not prompt_slices:
                break
            i = prompt_slices[-1]
            s = slices[i]
            keep = len(s.tokens) - (need() - self.kv.free)
            if keep <= 0:
                del slices[i]
                starved = True
            else:
                slices[i] = Slice(s.conv, s.seq_id, s.pos, s.tokens[:keep], False)
        while need() > self.kv.free and self._running:
            gone = self._preempt(self._victim())
            slices = [s for s in slices if s.conv not in gone]
        if starved and not slices and self._several_running():
            # not even a prompt chunk fits: the newest stream gives way, so the others progress
            self._preempt(self._victim())
        return slices

    def _lockstep(self, slices: list[Slice]) -> list[Slice]:
        """Keep a guided pair's logits in one step: a slice whose partner gives no logits this step
        waits (a prompt chunk keeps its last token back for a later step)."""
        with_logits = {s.conv for s in slices if s.logits}
        kept: list[Slice] = []
        for s in slices:
            seq = self._seqs[s.conv]
            partner = seq.guide or seq.owner
            if partner is None or not s.logits or partner.conv in with_logits:
                kept.append(s)
            elif len(s.tokens) - s.draft > 1:
                kept.append(Slice(s.conv, s.seq_id, s.pos, s.tokens[:-1 - s.draft], False))
        return kept

    def _several_running(self) -> bool:
        """More than one generation runs (a sequence that guides another is part of that one)."""
        return sum(s.owner is None for s in self._running) > 1

    def _victim(self) -> SeqState:
        """The running generation to preempt first: the lowest priority, then the newest."""
        return max(self._running, key=lambda s: (s.priority, s.started))

    def _preempt(self, seq: SeqState) -> set[int]:
        """Stop a running generation to free its cells (parked in host memory if it has room), with
        the sequence that guides it or that it guides; it resumes first among its equals when room
        returns. Returns the conversations stopped."""
        owner = seq.owner or seq
        group = (owner, owner.guide) if owner.guide is not None else (owner,)
        for s in group:
            if s.phase is not Phase.RUNNING:
                continue
            self._running.remove(s)
            if self.kv.host.enabled and s.n_cached >= MIN_PARK_TOKENS:
                self.kv.park(s)
            self.kv.drop(s)
            s.phase = Phase.WAITING
            s.follow = None
            s.preemptions += 1
        owner.preempted = True
        self._waiting.append(owner)
        self.preemptions += 1
        return {s.conv for s in group}
