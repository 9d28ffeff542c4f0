"""The scheduler: which sequences run, and which tokens go into each decode step.

Pure Python: it imports neither cffi nor anyio, and is tested with a fake KV cache. The decode thread
tells it what callers asked for (conversations added, prompted, forked, rewound, submitted, finished,
removed), asks it for a :class:`~aiollama.sched.step.Plan` each step, and hands it the step's result.
The mechanism underneath (seq ids, cells, the prefix cache, parking) is
:class:`~aiollama.sched.kvcache.KVManager`.

Policy, in the order it is applied each step (by :class:`~aiollama.sched.planner.Planner`), each
part in a module of its own where it is more than a few lines:

1. Admission (the planner). Conversations that want to generate wait in priority order (lowest value
   first; a waiting one gains a level every ``AGING_SECONDS``, so none waits forever; equal ones first
   come first served, preempted ones first among them) until fewer than ``max_running`` run and
   the cells they need (what they do not share, and a cell for each running stream's next token)
   are free or held by idle holders, then take a seq id. When nothing runs, the first one is
   admitted whatever it needs. An admitted sequence shares what is cached of its prompt
   (:mod:`~aiollama.sched.sharing`).
2. Idle cells under load, in a unified cache (:mod:`~aiollama.sched.idle`).
3. Slices (the planner). Every running sequence with one pending token (a decode row) goes first; prompt
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
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from aiollama.errors import ContextFull, InvalidRequestError
from aiollama.sched.checkpoints import CheckpointStore
from aiollama.sched.hostcache import HostCache
from aiollama.sched.kvcache import KVManager
from aiollama.sched.kvtree import common_prefix
from aiollama.sched.ondisk import keep_on_disk, load_before_admission, take_arrivals
from aiollama.sched.planner import MIN_PREFILL_CHUNK, Planner
from aiollama.sched.queues import AGING_SECONDS, Queues
from aiollama.sched.recurrent import RecurrentKV
from aiollama.sched.sequence import Phase, SeqState
from aiollama.sched.sharing import CellRules, Rules, StateRules
from aiollama.sched.shifting import shift_size
from aiollama.sched.speculation import DraftLength
from aiollama.sched.step import DiskTier, Op, Plan, StepResult
from aiollama.sched.views import Held, Progress, SchedulerConfig, SchedulerStats

__all__ = ["AGING_SECONDS", "MIN_PREFILL_CHUNK", "Scheduler", "SchedulerConfig", "common_prefix"]


def memory_rules(config: SchedulerConfig, disk: DiskTier | None = None) -> Rules:
    """The KV manager of a model's memory and its rules: cells, or cells and recurrent states
    (hybrid), or recurrent states alone."""
    n_cells, host = config.n_cells or config.n_ctx, HostCache(config.host_bytes, disk)
    if config.memory == "kv":
        return CellRules(KVManager(n_cells, config.n_seq_max, host, ordered=config.ordered))
    return StateRules(RecurrentKV(n_cells, config.n_seq_max, host, checkpoints=CheckpointStore(config.checkpoint_bytes),
                                  cells_held=config.memory == "hybrid"), config.rollback)


class Scheduler:
    """Sequences, seq ids and KV cells of one context, and each step's plan, built from a
    :class:`~aiollama.sched.views.SchedulerConfig`.

    Its face is all the decode thread uses: what callers asked for (:meth:`add`, :meth:`append`,
    :meth:`fork`, :meth:`rewind`, :meth:`submit`, :meth:`finish`, :meth:`remove`), the step
    (:meth:`schedule`, :meth:`update`), and typed reads (:meth:`progress`, :meth:`held`,
    :meth:`statistics`). The KV manager and the queues are its own. ``disk``: the prefix cache's
    tier under host memory (:mod:`~aiollama.sched.ondisk`).
    """

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic,
                 disk: DiskTier | None = None) -> None:
        self.config = config
        self.n_ctx = config.n_ctx
        self.disk = disk
        self.disk_loads = 0  # states read from disk into host memory
        self._rules = memory_rules(config, disk)
        self._kv = self._rules.kv
        self._queues = Queues(self._kv, clock)
        self._plan = Planner(config, self._rules, self._queues)

    # what callers asked for

    def add(self, conv: int, tokens: Iterable[int] = (), salt: str | None = None,
            lora: tuple[tuple[str, float], ...] = ()) -> None:
        """A conversation (see :meth:`Queues.add <aiollama.sched.queues.Queues.add>`)."""
        self._queues.add(conv, tokens, salt, lora)

    def append(self, conv: int, tokens: Iterable[int]) -> None:
        self._queues.append(conv, tokens)

    def add_images(self, conv: int, images: Mapping[int, Any]) -> None:
        """The embedding rows of the pictures a prompt of ``conv`` brought."""
        self._queues.images.add(conv, images)

    def fork(self, parent: int, child: int, n_tokens: int | None = None) -> None:
        self._queues.fork(parent, child, n_tokens)

    def rewind(self, conv: int, n_tokens: int) -> None:
        self._queues.rewind(conv, n_tokens)

    def set_lora(self, conv: int, lora: tuple[tuple[str, float], ...]) -> None:
        self._queues.set_lora(conv, lora)

    def clear_cache(self) -> None:
        """Drop every cache entry, parked state, checkpoint and state on disk (live conversations
        keep theirs)."""
        self._kv.clear_cache()
        if self.disk is not None:
            self.disk.clear()

    def take_ops(self) -> tuple[Op, ...]:
        """KV operations decided outside a plan (a close between steps); they also lead the next plan."""
        return self._kv.take_ops()

    # reads

    def __contains__(self, conv: int) -> bool:
        return conv in self._queues.seqs

    def get(self, conv: int) -> SeqState:
        """A conversation's sequence: for the scheduler's own tests; the decode thread reads
        :meth:`tokens`, :meth:`length` and :meth:`progress`."""
        return self._queues.seqs[conv]

    def sequences(self) -> list[SeqState]:
        """Every live sequence (a read for tests; do not modify them)."""
        return list(self._queues.seqs.values())

    def tokens(self, conv: int) -> Sequence[int]:
        """A conversation's history (read it, do not keep it: it changes with every step)."""
        return self._queues.seqs[conv].tokens

    def length(self, conv: int) -> int:
        return len(self._queues.seqs[conv].tokens)

    def progress(self, conv: int) -> Progress:
        seq = self._queues.seqs[conv]
        draft = seq.draft
        return Progress(len(seq.tokens), seq.n_cached, seq.prompt_tokens, seq.cached_tokens, seq.prompt_evaluated,
                        seq.preemptions, seq.restores, draft.drafted if draft else 0, draft.accepted if draft else 0)

    def stopped(self, plan: Plan) -> frozenset[int]:
        """The convs of ``plan``'s slices that no longer run: their generation ended (or their
        conversation closed) after the plan was made."""
        seqs = self._queues.seqs
        return frozenset(s.conv for s in plan.slices if s.conv not in seqs or seqs[s.conv].phase is not Phase.RUNNING)

    @property
    def busy(self) -> bool:
        return self._queues.busy

    @property
    def loading(self) -> bool:
        """A generation waits for a state from disk."""
        return any(s.loading is not None for s in self._queues.waiting)

    def statistics(self) -> SchedulerStats:
        kv, q = self._kv, self._queues
        return SchedulerStats(
            live=q.n_live, active=q.n_active, queued=q.n_queued, kv_cells_used=kv.cells.used,
            kv_cells_cached=kv.cells_cached() if kv.n_entries else 0, kv_cells_total=kv.cells.n_cells,
            seq_ids_used=kv.n_holders, cache_entries=kv.n_entries, n_seq_max=self._plan.max_running,
            cache_hit_tokens=self._plan.cache_hit_tokens, parked=len(kv.host), parked_bytes=kv.host.used_bytes,
            parks=kv.parks, restores=kv.restores, evictions=kv.evictions, preemptions=q.preemptions,
            compactions=kv.compactions, checkpoints=len(kv.checkpoints), checkpoint_bytes=kv.checkpoints.n_bytes,
            checkpoints_used=kv.checkpoints.used, drafted_tokens=self._plan.drafted, accepted_tokens=self._plan.accepted,
            disk_loads=self.disk_loads)

    # saving and loading a conversation's state

    def held(self, conv: int) -> Held:
        """What ``conv`` holds, to be saved (apply :meth:`take_ops` first: the executor reads the
        cells of ``seq_id``)."""
        seq = self._queues.seqs[conv]
        images = self._queues.images
        rows = {n: images.rows[n] for n in images.held(conv)}
        if seq.seq_id is not None and seq.n_cached > 0:
            return Held(tuple(seq.tokens), seq.seq_id, seq.n_cached, None, rows)
        parked, n = self._kv.host.best(seq.tokens, len(seq.tokens), seq.salt)  # parked in host memory, perhaps
        if parked is not None and parked.data is not None and n == len(parked.tokens):
            return Held(tuple(seq.tokens), None, n, parked.data, rows)
        return Held(tuple(seq.tokens), None, 0, None, rows)

    def place(self, conv: int, tokens: Sequence[int], images: Mapping[int, Any], n_cached: int) -> int | None:
        """A conversation loaded from a file, with the state of its first ``n_cached`` tokens to put
        back: the seq id to write that state into (after :meth:`take_ops`), then :meth:`placed`;
        None when the state cannot be placed (the history is evaluated again instead)."""
        self._queues.add(conv, tokens)
        self._queues.images.add(conv, images)
        seq = self._queues.seqs[conv]
        if not 0 < n_cached <= len(tokens) or not self._kv.free_cells(n_cached) or not self._kv.assign(seq):
            return None
        self._kv.room(n_cached)
        return seq.seq_id

    def placed(self, conv: int, n_cached: int, ok: bool) -> None:
        """The state :meth:`place` asked for was written (``ok``) or refused: the cells are the
        conversation's, or its seq id goes back."""
        seq = self._queues.seqs[conv]
        if ok:
            self._kv.extend(seq, n_cached)
        else:
            self._kv.drop(seq)

    # generations

    def submit(self, conv: int, n_keep: int | None = None, draft: int = 0, *, priority: int = 0,
               guide: int | None = None, score: bool = False, max_tokens: int | None = None) -> tuple[int, int] | None:
        """The conversation wants to generate. With ``n_keep`` (a context-shift policy) a history too
        long for the context loses part of what follows its first ``n_keep`` tokens, and this
        returns ``(n_keep, n_dropped)``; without, it raises ContextFull. ``draft`` > 0: decode
        steps carry n-gram drafts of up to that many tokens. ``guide``: a conversation decoded in
        lockstep with this one (classifier-free guidance), which gets every sampled token too.
        ``score``: the prompt is evaluated whole, with every row's logits (prompt log-probabilities).
        ``max_tokens``: the generation's length, which drafts do not go past (their tokens beyond it
        would be thrown away, and cut from a recurrent state only by going back to a checkpoint).
        A ``draft`` longer than the memory can cut back (a recurrent state's snapshots) raises
        InvalidRequestError, as does a guide whose LoRA adapters differ."""
        seq = self._queues.seqs[conv]
        partner = None if guide is None else self._queues.seqs[guide]
        _check_submit(seq, partner, n_keep, self.n_ctx)
        if partner is not None and partner.lora != seq.lora:
            raise InvalidRequestError("a guidance conversation must use the same LoRA adapters")
        if draft > self._rules.max_draft:
            raise InvalidRequestError(f"draft_tokens={draft}: this model's recurrent state rolls back at most "
                                      f"{self._rules.max_draft} tokens (the engine's draft_tokens, where llama.cpp "
                                      "keeps snapshots of the state for its architecture)")
        dropped = None
        if len(seq.tokens) >= self.n_ctx:
            assert n_keep is not None
            n = shift_size(self.n_ctx, len(seq.tokens), n_keep)
            self._kv.truncate(seq, min(seq.n_cached, n_keep))
            del seq.tokens[n_keep:n_keep + n]
            dropped = (n_keep, n)
        seq.n_keep = n_keep
        seq.draft = DraftLength(draft) if draft > 0 and partner is None else None
        seq.end_at = None if max_tokens is None else len(seq.tokens) + max_tokens
        seq.prompt_tokens, seq.cached_tokens, seq.preemptions, seq.restores = -1, 0, 0, 0
        seq.prompt_evaluated, seq.score = 0, score
        seq.priority, seq.queued_at, seq.preempted = priority, self._queues.clock(), False
        for s in (seq, partner) if partner is not None else (seq,):
            s.phase = Phase.WAITING
            s.last_used = self._kv.tick()
        if partner is not None:
            seq.guide, partner.owner = partner, seq
            partner.priority = priority
            self._plan.pairs += 1
        self._queues.waiting.append(seq)
        if partner is None and not score:
            load_before_admission(self._rules, self.disk, seq)
        return dropped

    def finish(self, conv: int) -> None:
        """The generation ended (or was cancelled); the sequence keeps its seq id and KV as a cache,
        and so does the sequence that guided it."""
        seq = self._queues.seqs[conv]
        assert seq.owner is None, "a guiding sequence finishes with the generation it guides"
        if seq.phase is Phase.WAITING:
            self._queues.waiting.remove(seq)
        for s in (seq, seq.guide) if seq.guide is not None else (seq,):
            if s.phase is Phase.RUNNING:
                self._queues.running.remove(s)
            s.phase = Phase.IDLE
            s.follow = s.n_keep = s.draft = s.owner = None
            s.last_used = self._kv.tick()
        if seq.guide is not None:
            self._plan.pairs -= 1
        seq.guide = None
        self._plan.idle_changed = True

    def remove(self, conv: int) -> None:
        """The conversation is closed: its cached prefix stays as a cache entry (and goes to disk)."""
        self.finish(conv)
        keep_on_disk(self._rules, self.disk, self._queues.seqs[conv])
        self._kv.retire(self._queues.seqs.pop(conv))
        self._queues.images.drop(conv)

    # the step

    def schedule(self, hold: Collection[int] = ()) -> Plan:
        """The next step's plan. Building it has effects: admissions, prefix sharing, evictions,
        parking, context shifts and preemptions are decided here, and their KV operations lead the
        plan. The running conversations in ``hold`` sit this step out (an overlapped step plans
        before the finish rules have read the last tokens: those whose last token surely ends them)."""
        self.disk_loads += take_arrivals(self._rules, self.disk, self._queues.waiting)
        return self._plan.schedule(hold)

    def update(self, plan: Plan, result: StepResult) -> bool:
        """Apply a step's result: the decoded tokens are cached and sampled tokens join the history;
        after a failure the cache is resynced with what the context holds. Returns False only for a
        NO_KV_SLOT that nothing could be freed for."""
        return self._plan.update(plan, result)

    def make_room(self) -> bool:
        """llama.cpp found no KV slot although the plan fit: free cells by force. False if it cannot."""
        return self._plan.make_room()

    @property
    def idle_trims(self) -> int:
        """Idle holders that gave their cells back so that running streams stay fast."""
        return self._plan.idle_trims


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


