"""Each step's plan, from the scheduler's queues and KV manager: admission, idle cells, the slices
of the step and the room for them, and the step's result applied (see
:mod:`aiollama.sched.scheduler` for the policy, in the order it is applied). Pure Python."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from aiollama.sched.drafting import add_drafts
from aiollama.sched.idle import trim_idle
from aiollama.sched.images import whole_take
from aiollama.sched.kvcache import KVManager
from aiollama.sched.lockstep import lockstep
from aiollama.sched.queues import Queues
from aiollama.sched.room import fit
from aiollama.sched.rowcost import RowCost
from aiollama.sched.sequence import Phase, SeqState
from aiollama.sched.sharing import Rules, follow, share_prefix
from aiollama.sched.shifting import shift
from aiollama.sched.step import Plan, Slice, StepResult, StepStatus
from aiollama.sched.views import SchedulerConfig

# A prompt chunk gets at least this many tokens a step, even when decode rows fill the budget.
MIN_PREFILL_CHUNK = 16


class Planner:
    """The step's half of a scheduler: its plan, and its result applied to the cache and the histories."""

    def __init__(self, config: SchedulerConfig, rules: Rules, queues: Queues) -> None:
        self.kv = rules.kv
        self.rules = rules
        self.queues = queues
        self.n_ctx = config.n_ctx
        self.n_batch = config.n_batch
        self.step_tokens = min(config.step_tokens, config.n_batch)
        self.max_running = min(config.max_running or config.n_seq_max, config.n_seq_max)
        self.can_shift = config.can_shift and config.memory == "kv"  # the memory can move positions (seq_add)
        self.draft_model = config.draft_model
        self.whole_images = config.whole_images
        self.cache_hit_tokens = 0  # tokens an admission did not have to evaluate
        self.drafted = self.accepted = 0  # speculative draft tokens verified, and those the sampler took
        self.row_cost = RowCost()  # what a decode row costs: whether a draft token pays
        self.drafts_seen = False  # a stream has drafted: from then on the row cost is fitted
        self.probe = False  # whether this step's drafts may go past a full step, to fit the row cost
        self.admitted: list[int] = []
        self.shifted: list[tuple[int, int, int]] = []
        self.rr = 0
        self.lora_turn = 0  # which adapter set's turn it is
        self.pairs = 0  # guided generations submitted and not finished
        # unified: idle cells are given back under load, looked at when generations start or end
        self.trims = config.kv_unified and not config.ordered
        self.idle_changed = False
        self.idle_trims = 0  # idle holders that gave their cells back so running streams stay fast

    def schedule(self, hold: Collection[int] = ()) -> Plan:
        """The next step's plan. Building it has effects: admissions, prefix sharing, evictions,
        parking, context shifts and preemptions are decided here, and their KV operations lead the
        plan. The running conversations in ``hold`` (and their guides) sit this step out."""
        self._admit()
        if self.trims and self.idle_changed and self.queues.running:
            self.idle_changed = False
            self.idle_trims += trim_idle(self.kv, self.queues.running)
        group = self._lora_group()
        slices = fit(self._slices(group, hold), self.kv, self.queues.preempt_newest, self.whole_images)
        if self.pairs:
            slices = lockstep(slices, self.queues.seqs)
        if self.kv.holes:  # ordered cells only: never summed on the common path
            self.kv.room(sum(s.cells for s in slices))
        admitted, self.admitted = tuple(self.admitted), []
        shifted, self.shifted = tuple(self.shifted), []
        return Plan(self.kv.take_ops(), tuple(slices), admitted, shifted, group, self.queues.images.rows)

    def _lora_group(self) -> tuple[tuple[str, float], ...]:
        """The adapter set this step decodes: the running sequences' sets take turns, a step each
        (llama.cpp applies adapters to a whole context)."""
        if not self.queues.lora_used:  # the common case costs the step nothing
            return ()
        groups = sorted({seq.lora for seq in self.queues.running if not seq.restoring})
        if len(groups) <= 1:
            return groups[0] if groups else ()
        self.lora_turn += 1
        return groups[self.lora_turn % len(groups)]

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
            drafted, accepted = record(self.kv, self.queues.seqs, plan, result)
            fits = self.drafts_seen and result.decode_seconds > 0 and plan.slices
            if fits and all(len(s.tokens) - s.draft == 1 for s in plan.slices):
                self.row_cost.add(sum(len(s.tokens) for s in plan.slices) + sum(result.drafted.values()),
                                  result.decode_seconds)
            for sl in plan.slices if result.discarded else ():
                held = self.queues.seqs.get(sl.conv)
                if sl.conv in result.discarded and held is not None and held.seq_id == sl.seq_id:
                    self.rules.discarded(held, sl)
            self.drafted += drafted
            self.accepted += accepted
            self.rules.after_step(plan, self.queues.seqs)
            return True
        if result.status is StepStatus.NO_KV_SLOT:
            return self.make_room()
        for conv, n_cached in result.n_cached.items():
            if conv in self.queues.seqs:
                self.kv.resync(self.queues.seqs[conv], n_cached)
        return True

    def make_room(self) -> bool:
        """llama.cpp found no KV slot although the plan fit: free cells by force. False if it cannot."""
        victim = self.kv.lru_idle(holding_cells=True)
        if victim is not None:
            self.kv.evict(victim, victim.n_cached, whole=True)
            return True
        return bool(self.queues.preempt_newest(True))

    def _admit(self) -> None:
        while self.queues.waiting and len(self.queues.running) < self.max_running:
            seq = self.queues.next_waiting()
            if seq is None:
                return
            group = (seq, seq.guide) if seq.guide is not None else (seq,)
            if self.queues.running:  # room for the running ones to finish their prompts, then for this one
                need = sum(max(1, s.pending) for s in self.queues.running)
                for s in group:
                    _, shared = self.kv.find(s.tokens, len(s.tokens) - 1, s.salt)
                    need += len(s.tokens) - max(shared, s.n_cached)
                if not self.kv.free_cells(need):
                    return  # admitted now, it would only be preempted again
            if not all(s.seq_id is not None or self.kv.assign(s) for s in group):
                return  # a seq id this pair got stays with it (an idle holder's, until it runs)
            self.queues.waiting.remove(seq)
            self.idle_changed = True
            started = self.kv.tick()
            for s in group:
                s.phase = Phase.RUNNING
                s.started = started
                self.queues.running.append(s)
                self.admitted.append(s.conv)
                if s.score:
                    self.kv.truncate(s, 0)  # a cached prefix has no logits: score the prompt whole
                elif s.pending <= 0:
                    # everything is cached, but sampling needs the last token's logits: evaluate it again
                    self.kv.truncate(s, len(s.tokens) - 1)
                if not s.score:
                    share_prefix(self.rules, s, self.queues.running)
                self.cache_hit_tokens += s.n_cached
                s.prompt_evaluated += s.pending
                if s.prompt_tokens < 0:
                    s.prompt_tokens, s.cached_tokens = len(s.tokens), s.n_cached

    def _slices(self, group: tuple[tuple[str, float], ...] = (), hold: Collection[int] = ()) -> list[Slice]:
        slices: list[Slice] = []
        prefill: list[SeqState] = []
        drafting: list[int] = []
        for seq in self.queues.running:
            assert seq.seq_id is not None
            if seq.restoring or seq.lora != group or (hold and (seq.owner or seq).conv in hold):
                continue
            if seq.n_keep is not None and len(seq.tokens) >= self.n_ctx:
                self.shifted.append((seq.conv, *shift(self.kv, seq, self.n_ctx, self.can_shift)))
            if seq.pending == 1:
                if len(slices) < self.n_batch:
                    pos = seq.n_cached
                    if seq.draft is not None:
                        drafting.append(len(slices))
                    slices.append(Slice(seq.conv, seq.seq_id, pos, (seq.tokens[pos],), True))
            elif not self._follows(seq):
                prefill.append(seq)
        rows = len(slices)
        if drafting:  # an engine without speculation never gets here
            self.drafts_seen = True
            share = self.row_cost.shares()
            self.probe = share is None and not self.probe  # while the cost is unknown, every other step
            rows += add_drafts(slices, drafting, self.queues.seqs, n_batch=self.n_batch, n_ctx=self.n_ctx,
                               draft_model=self.draft_model, share=share, probe=self.probe)
        room, first = self.n_batch - rows, len(slices)
        budget = min(room, max(self.step_tokens - rows, MIN_PREFILL_CHUNK))
        if prefill and budget > 0:
            start = self.rr % len(prefill)
            self.rr += 1
            for seq in sorted(prefill[start:] + prefill[:start], key=lambda s: s.priority):
                if budget <= 0:
                    break
                assert seq.seq_id is not None
                pos = seq.n_cached
                take = min(seq.pending, budget)
                take = self.rules.prefill_take(seq, take, self.queues.running)
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
        waits, gained = follow(self.rules, seq)
        if gained:
            self.cache_hit_tokens += gained
            if seq.cached_tokens < seq.prompt_tokens:  # still in its first prefill: not evaluated by it
                seq.cached_tokens = min(seq.prompt_tokens, seq.cached_tokens + gained)
            seq.prompt_evaluated -= gained
        return waits



def record(kv: KVManager, seqs: Mapping[int, SeqState], plan: Plan, result: StepResult) -> tuple[int, int]:
    """A decode went through: sampled tokens join their histories (a guided one's guide's too), and
    the cells decoded are cached; of a draft, only the pending token and the draft tokens the sampler
    took keep theirs (the executor removed the others, all of them when no token was taken).
    Returns the draft tokens verified and those taken."""
    taken: dict[int, int] = {}
    drafted = accepted = 0
    for sampled in result.sampled:
        seq = seqs[sampled.conv]
        seq.tokens.append(sampled.token)
        if seq.guide is not None:
            seq.guide.tokens.append(sampled.token)
        taken[sampled.conv] = taken.get(sampled.conv, 0) + 1
    for s in plan.slices:
        if s.conv in result.discarded:
            continue  # see Rules.discarded
        seq = seqs[s.conv]
        offered = s.draft or result.drafted.get(s.conv, 0)
        if offered:
            n = taken.get(s.conv, 1)
            kv.extend(seq, n)
            kv.dropped(offered - (n - 1))
            if seq.draft is not None:
                seq.draft.record(offered, n - 1)
            drafted, accepted = drafted + offered, accepted + n - 1
        else:
            kv.extend(seq, len(s.tokens))
    return drafted, accepted
