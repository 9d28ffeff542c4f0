"""The scheduler: which sequences run, and which tokens go into each decode step.

Pure Python: it imports neither cffi nor anyio, and is tested with a fake KV cache. The decode thread
tells it what callers asked for (conversations added, prompted, forked, rewound, submitted, finished,
removed), asks it for a :class:`~aiollama.sched.step.Plan` each step, and hands it the step's result.
The mechanism underneath (seq ids, cells, the prefix cache, parking) is
:class:`~aiollama.sched.kvcache.KVManager`.

Policy, in the order it is applied each step, each part in a module of its own where it is more
than a few lines:

1. Admission (here). Conversations that want to generate wait in priority order (lowest value
   first; a waiting one gains a level every ``AGING_SECONDS``, so none waits forever; equal ones first
   come first served, preempted ones first among them) until fewer than ``max_running`` run and
   the cells they need (what they do not share, and a cell for each running stream's next token)
   are free or held by idle holders, then take a seq id. When nothing runs, the first one is
   admitted whatever it needs. An admitted sequence shares what is cached of its prompt
   (:mod:`~aiollama.sched.sharing`).
2. Idle cells under load, in a unified cache (:mod:`~aiollama.sched.idle`).
3. Slices (here). Every running sequence with one pending token (a decode row) goes first; prompt
   chunks follow, round-robin within each priority (lower values first), in what is left of
   ``step_tokens`` (but at least ``MIN_PREFILL_CHUNK`` tokens, so prompts progress even when decode
   rows fill the budget). A long prompt therefore never freezes running streams, and a step holds at
   most ``max(step_tokens, decode rows + MIN_PREFILL_CHUNK)`` tokens, never more than ``n_batch``.
   Histories that filled the context shift first (:mod:`~aiollama.sched.shifting`); drafting streams
   get drafts (:mod:`~aiollama.sched.drafting`). With a recurrent or hybrid model a prompt's last
   token waits for the next step, so that a checkpoint can be taken before it
   (:mod:`~aiollama.sched.checkpoints`).
4. Room for the slices (:mod:`~aiollama.sched.room`): drafts, idle holders, prompt chunks, then
   preemption of the newest stream of the lowest priority.
5. Lockstep of classifier-free guidance pairs (:mod:`~aiollama.sched.lockstep`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from aiollama.errors import ContextFull, InvalidRequestError
from aiollama.sched.checkpoints import CheckpointStore
from aiollama.sched.drafting import add_drafts
from aiollama.sched.hostcache import HostCache
from aiollama.sched.idle import trim_idle
from aiollama.sched.images import whole_take
from aiollama.sched.kvcache import KVManager
from aiollama.sched.kvtree import common_prefix
from aiollama.sched.lockstep import lockstep
from aiollama.sched.queues import AGING_SECONDS, Queues
from aiollama.sched.recurrent import RecurrentKV
from aiollama.sched.room import fit
from aiollama.sched.sequence import Phase, SeqState
from aiollama.sched.sharing import follow, share_prefix
from aiollama.sched.shifting import shift, shift_size
from aiollama.sched.speculation import DraftLength
from aiollama.sched.step import Plan, Slice, StepResult, StepStatus

# A prompt chunk gets at least this many tokens a step, even when decode rows fill the budget.
MIN_PREFILL_CHUNK = 16

__all__ = ["AGING_SECONDS", "MIN_PREFILL_CHUNK", "Scheduler", "common_prefix"]


class Scheduler(Queues):
    """Sequences, seq ids and KV cells of one context, and each step's plan.

    ``n_seq_max`` is how many seq ids the context has (holders of cached prefixes included);
    ``max_running`` how many sequences may generate at once (default: all of them). ``ordered``
    keeps each sequence's cells in position order (the deterministic mode; see
    :mod:`aiollama.sched.kvcache`). ``kv_unified``: one pool of cells for every seq id, over which each
    step's attention passes (idle cells are then given back under load). ``draft_model``: drafting
    streams leave their drafts to the executor's draft model (the slice says how many tokens it may add) instead of n-grams.
    ``memory``: "kv", or "hybrid" and "recurrent" for models with recurrent states, which are
    checkpointed in host memory within ``checkpoint_bytes`` (see :mod:`~aiollama.sched.recurrent`);
    they decode without n-gram drafts.
    """

    def __init__(self, *, n_ctx: int, n_seq_max: int, n_batch: int, step_tokens: int, n_cells: int | None = None,
                 max_running: int | None = None, host_bytes: int = 0, can_shift: bool = True,
                 ordered: bool = False, draft_model: bool = False, kv_unified: bool = False,
                 memory: str = "kv", checkpoint_bytes: int = 0, whole_images: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.step_tokens = min(step_tokens, n_batch)
        self.max_running = min(max_running or n_seq_max, n_seq_max)
        self.can_shift = can_shift and memory == "kv"  # the memory can move positions (seq_add)
        self.draft_model = draft_model  # drafts come from the executor's draft model, not n-grams
        self.whole_images = whole_images  # a picture's rows go in one step (decoded with attention over all)
        # n_ctx: what one sequence can hold; n_cells: the cells of all (n_ctx in a unified cache)
        kv = KVManager(n_cells or n_ctx, n_seq_max, HostCache(host_bytes), ordered=ordered) if memory == "kv" \
            else RecurrentKV(n_cells or n_ctx, n_seq_max, HostCache(host_bytes),
                             checkpoints=CheckpointStore(checkpoint_bytes), cells_held=memory == "hybrid")
        super().__init__(kv, clock)
        self.cache_hit_tokens = 0  # tokens an admission did not have to evaluate
        self._admitted: list[int] = []
        self._shifted: list[tuple[int, int, int]] = []
        self._rr = 0
        self._lora_turn = 0  # which adapter set's turn it is
        self._pairs = 0  # guided generations submitted and not finished
        # unified: idle cells are given back under load, looked at when generations start or end
        self._trims = kv_unified and not ordered
        self._idle_changed = False
        self.idle_trims = 0  # idle holders that gave their cells back so running streams stay fast

    def submit(self, conv: int, n_keep: int | None = None, draft: int = 0, *, priority: int = 0,
               guide: int | None = None, score: bool = False) -> tuple[int, int] | None:
        """The conversation wants to generate. With ``n_keep`` (a context-shift policy) a history too
        long for the context loses part of what follows its first ``n_keep`` tokens, and this
        returns ``(n_keep, n_dropped)``; without, it raises ContextFull. ``draft`` > 0: decode
        steps carry n-gram drafts of up to that many tokens. ``guide``: a conversation decoded in
        lockstep with this one (classifier-free guidance), which gets every sampled token too.
        ``score``: the prompt is evaluated whole, with every row's logits (prompt log-probabilities)."""
        seq = self._seqs[conv]
        partner = None if guide is None else self._seqs[guide]
        _check_submit(seq, partner, n_keep, self.n_ctx)
        if partner is not None and partner.lora != seq.lora:
            raise InvalidRequestError("a guidance conversation must use the same LoRA adapters")
        dropped = None
        if len(seq.tokens) >= self.n_ctx:
            assert n_keep is not None
            n = shift_size(self.n_ctx, len(seq.tokens), n_keep)
            self.kv.truncate(seq, min(seq.n_cached, n_keep))
            del seq.tokens[n_keep:n_keep + n]
            dropped = (n_keep, n)
        seq.n_keep = n_keep
        seq.draft = DraftLength(draft) if draft > 0 and partner is None and not isinstance(self.kv, RecurrentKV) else None
        seq.prompt_tokens, seq.cached_tokens, seq.preemptions, seq.restores = -1, 0, 0, 0
        seq.prompt_evaluated, seq.score = 0, score
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
        self.images.drop(conv)

    # the step

    def schedule(self) -> Plan:
        """The next step's plan. Building it has effects: admissions, prefix sharing, evictions,
        parking, context shifts and preemptions are decided here, and their KV operations lead the
        plan."""
        self._admit()
        if self._trims and self._idle_changed and self._running:
            self._idle_changed = False
            self.idle_trims += trim_idle(self.kv, self._running)
        group = self._lora_group()
        slices = fit(self._slices(group), self.kv, self._preempt_newest, self.whole_images)
        if self._pairs:
            slices = lockstep(slices, self._seqs)
        if self.kv.holes:  # ordered cells only: never summed on the common path
            self.kv.room(sum(s.cells for s in slices))
        admitted, self._admitted = tuple(self._admitted), []
        shifted, self._shifted = tuple(self._shifted), []
        return Plan(self.kv.take_ops(), tuple(slices), admitted, shifted, group, self.images.rows)

    def _lora_group(self) -> tuple[tuple[str, float], ...]:
        """The adapter set this step decodes: the running sequences' sets take turns, a step each
        (llama.cpp applies adapters to a whole context)."""
        if not self.lora_used:  # the common case costs the step nothing
            return ()
        groups = sorted({seq.lora for seq in self._running if not seq.restoring})
        if len(groups) <= 1:
            return groups[0] if groups else ()
        self._lora_turn += 1
        return groups[self._lora_turn % len(groups)]

    def update(self, plan: Plan, result: StepResult) -> bool:
        """Apply a step's result: the decoded tokens are cached and sampled tokens join the history;
        after a failure the cache is resynced with what the context holds. Returns False only for a
        NO_KV_SLOT that nothing could be freed for."""
        for key, data in result.parked.items():
            self.kv.host.fill(key, data)
        for key, data in result.checkpoints.items():
            self.kv.checkpoints.fill(key, data)
        for seq in self.kv.holders():
            ok = result.restored.get(seq.seq_id or 0)
            if seq.restoring or ok is False:  # a parked state put back, or a checkpoint that was not
                self.kv.restored(seq, bool(ok))
        if result.status is StepStatus.OK:
            record(self.kv, self._seqs, plan, result)
            if isinstance(self.kv, RecurrentKV):
                self.kv.after_step(plan, self._seqs)
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
        return bool(self._preempt_newest(True))

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            seq = self._next_waiting()
            group = (seq, seq.guide) if seq.guide is not None else (seq,)
            if self._running:  # room for the running ones to finish their prompts, then for this one
                need = sum(max(1, s.pending) for s in self._running)
                for s in group:
                    _, shared = self.kv.find(s.tokens, len(s.tokens) - 1, s.salt)
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
                if s.score:
                    self.kv.truncate(s, 0)  # a cached prefix has no logits: score the prompt whole
                elif s.pending <= 0:
                    # everything is cached, but sampling needs the last token's logits: evaluate it again
                    self.kv.truncate(s, len(s.tokens) - 1)
                if not s.score:
                    share_prefix(self.kv, s, self._running)
                self.cache_hit_tokens += s.n_cached
                s.prompt_evaluated += s.pending
                if s.prompt_tokens < 0:
                    s.prompt_tokens, s.cached_tokens = len(s.tokens), s.n_cached

    def _slices(self, group: tuple[tuple[str, float], ...] = ()) -> list[Slice]:
        slices: list[Slice] = []
        prefill: list[SeqState] = []
        drafting: list[int] = []
        for seq in self._running:
            assert seq.seq_id is not None
            if seq.restoring or seq.lora != group:
                continue
            if seq.n_keep is not None and len(seq.tokens) >= self.n_ctx:
                self._shifted.append((seq.conv, *shift(self.kv, seq, self.n_ctx, self.can_shift)))
            if seq.pending == 1:
                if len(slices) < self.n_batch:
                    pos = seq.n_cached
                    if seq.draft is not None:
                        drafting.append(len(slices))
                    slices.append(Slice(seq.conv, seq.seq_id, pos, (seq.tokens[pos],), True))
            elif not self._follows(seq):
                prefill.append(seq)
        rows = len(slices) + add_drafts(slices, drafting, self._seqs, n_batch=self.n_batch, n_ctx=self.n_ctx,
                                        draft_model=self.draft_model)
        room, first = self.n_batch - rows, len(slices)
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
                if isinstance(self.kv, RecurrentKV):
                    take = self.kv.take(seq, take, self._running)
                used = sum(len(s.tokens) for s in slices[first:]) if self.whole_images else 0
                if self.whole_images and not (take := whole_take(seq.tokens, pos, take, room - used)):
                    continue  # its picture waits for a step with room for it whole
                slices.append(Slice(seq.conv, seq.seq_id, pos, tuple(seq.tokens[pos:pos + take]),
                                    take == seq.pending, history=seq.tokens if seq.score else (),
                                    score=seq.score))
                budget -= take
        return slices

    def _follows(self, seq: SeqState) -> bool:
        """True while ``seq`` waits for a leader to prefill the prefix they share."""
        waits, gained = follow(self.kv, seq)
        if gained:
            self.cache_hit_tokens += gained
            if seq.cached_tokens < seq.prompt_tokens:  # still in its first prefill: not evaluated by it
                seq.cached_tokens = min(seq.prompt_tokens, seq.cached_tokens + gained)
            seq.prompt_evaluated -= gained
        return waits


def _check_submit(seq: SeqState, partner: SeqState | None, n_keep: int | None, n_ctx: int) -> None:
    """What a generation asked for must be possible. Raises InvalidRequestError or ContextFull."""
    # Callers refuse a second generation before it gets here (ConversationBusy).
    assert seq.phase is Phase.IDLE, f"conversation {seq.conv} is already generating"
    if not seq.tokens:
        raise InvalidRequestError("nothing to generate from: prompt the conversation first")
    if partner is not None:
        assert partner.phase is Phase.IDLE and partner is not seq, "callers check the guide"
        if not partner.tokens:
            raise InvalidRequestError("the guidance conversation is empty: prompt it first")
        if len(partner.tokens) >= n_ctx:
            raise ContextFull(f"the guidance conversation holds {len(partner.tokens)} tokens; the context has {n_ctx}")
    if n_keep is not None and n_keep > n_ctx // 2:
        raise InvalidRequestError(f"n_keep ({n_keep}) must be at most half the context ({n_ctx // 2})")
    if len(seq.tokens) >= n_ctx and n_keep is None:
        raise ContextFull(f"the conversation holds {len(seq.tokens)} tokens; the context has {n_ctx}",
                          n_prompt_tokens=len(seq.tokens), n_ctx=n_ctx)


def record(kv: KVManager, seqs: Mapping[int, SeqState], plan: Plan, result: StepResult) -> None:
    """A decode went through: sampled tokens join their histories (a guided one's guide's too), and
    the cells decoded are cached; of a draft, only the pending token and the draft tokens the sampler
    took keep theirs (the executor removed the others, all of them when no token was taken)."""
    taken: dict[int, int] = {}
    for sampled in result.sampled:
        seq = seqs[sampled.conv]
        seq.tokens.append(sampled.token)
        if seq.guide is not None:
            seq.guide.tokens.append(sampled.token)
        taken[sampled.conv] = taken.get(sampled.conv, 0) + 1
    for s in plan.slices:
        seq = seqs[s.conv]
        offered = s.draft or result.drafted.get(s.conv, 0)
        if offered:
            n = taken.get(s.conv, 1)
            kv.extend(seq, n)
            kv.dropped(offered - (n - 1))
            if seq.draft is not None:
                seq.draft.record(offered, n - 1)
        else:
            kv.extend(seq, len(s.tokens))
