"""The decode thread's state and its step, in the shape of vLLM's engine core.

``EngineCore.step()`` is the whole step:

1. ``plan = scheduler.schedule()``: pure; admissions, prefix sharing and KV operations included;
2. ``result = executor.execute(plan)``: the only call into llama.cpp (KV ops, decode, sampling);
3. ``scheduler.update(plan, result)`` and ``generations.update(result)``: pure; the history, the
   cache and the finish rules;
4. ``outbox.flush()``: one non-blocking hop per consumer event loop. Each loop is woken as the next
   decode starts (just before the executor releases the GIL for ``llama_decode``, so consumers run
   while the decode computes, not while the decode thread waits for the GIL), or at once when no
   decode follows.

Commands from callers are applied between steps by :meth:`EngineCore.handle`. Everything here runs on
the decode thread, except reads of ``statistics`` and ``prefilling``, which are replaced whole.
It imports neither llama.cpp nor an event loop library.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from aiollama.boundary import (
    STEP_BUCKETS,
    Ack,
    Admission,
    Cancel,
    ClearCache,
    Close,
    Command,
    Delta,
    Embed,
    EngineConfig,
    FinishReason,
    Fork,
    Generate,
    Load,
    NewConversation,
    Prompt,
    Rewind,
    Save,
    Snapshot,
    Statistics,
    Vectors,
)
from aiollama.errors import AiollamaError, ConversationBusy, ConversationClosed, DecodeError, EngineDead
from aiollama.generations import Generations, stats_of
from aiollama.outbox import Outbox, wake
from aiollama.scheduler import Scheduler
from aiollama.step import Executor, Plan, StepResult, StepStatus

MAX_NO_SLOT_RETRIES = 16


@dataclass
class _Counters:
    tokens_evaluated: int = 0
    tokens_generated: int = 0
    decode_steps: int = 0
    aborted_steps: int = 0
    decode_seconds: float = 0.0
    step_seconds: float = 0.0


class EngineCore:
    """The scheduler, the running generations and the executor of one engine, and its step."""

    def __init__(self, executor: Executor, config: EngineConfig, admission: Admission) -> None:
        self.executor = executor
        self.config = config
        self.admission = admission
        self.scheduler = Scheduler(n_ctx=executor.n_ctx, n_cells=executor.n_cells, n_seq_max=executor.n_seq_max,
                                   n_batch=executor.n_batch,
                                   step_tokens=config.step_tokens, max_running=config.n_seq_max,
                                   host_bytes=config.host_cache_bytes, can_shift=executor.can_shift,
                                   ordered=config.deterministic, draft_model=config.draft_model is not None,
                                   kv_unified=executor.kv_unified)
        self.outbox = Outbox()
        self.generations = Generations(admission, self.outbox, executor.n_ctx)
        self.prefilling: frozenset[int] = frozenset()  # a cancel of these aborts the running decode
        self.statistics = Statistics()
        self._counters = _Counters()
        self._step_counts = [0] * (len(STEP_BUCKETS) + 1)
        self._no_slot_streak = 0
        self.publish()

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    def step(self) -> None:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self.generations.admitted(plan.admitted)
        for conv, keep, n in plan.shifted:
            self.generations.shifted(conv, keep, n)
        if plan.slices:
            self.prefilling = plan.prefilling
            if plan.admitted or self.prefilling:
                self.publish()  # admissions and prompts show while a long decode runs
        unwoken = self.outbox.take_unwoken()
        if plan.slices:
            result = self.executor.execute(plan, lambda: wake(unwoken))
        else:
            wake(unwoken)
            result = self.executor.execute(plan)
        wake(unwoken)  # in case no decode started: a portal woken already is not asked again
        self.prefilling = frozenset()
        progressed = self.scheduler.update(plan, result)
        if plan.slices:
            self._count(plan, result)
        if result.status is StepStatus.OK:
            self._no_slot_streak = 0
            for conv, past_end in self.generations.update(result, self.scheduler).items():
                self.end(conv, past_end=past_end)
            for conv, exc in result.failed.items():
                if conv in self.generations:
                    self.end(conv, error=exc)
        elif result.status is StepStatus.NO_KV_SLOT:
            # Planning keeps batches within the free cells, so this is rare: the scheduler frees
            # cells by force; give up only if it keeps happening with nothing left to free.
            self._no_slot_streak = 0 if progressed else self._no_slot_streak + 1
            if self._no_slot_streak > MAX_NO_SLOT_RETRIES:
                raise DecodeError("llama.cpp keeps finding no KV slot and nothing can be freed")
        elif result.status is StepStatus.FAILED:
            raise DecodeError(result.detail)
        # The whole step counts, delivery included: up to here in the numbers published now, the
        # publishing and the hop in the next ones.
        counted = time.perf_counter()
        if plan.slices:
            self._counters.step_seconds += counted - started
            self._step_counts[bisect.bisect_left(STEP_BUCKETS, counted - started)] += 1
        self.publish()  # before the hop, so that a woken consumer sees this step's numbers
        self.flush()
        if plan.slices:
            self._counters.step_seconds += time.perf_counter() - counted

    def handle(self, command: Command) -> None:
        """Apply a caller's command (between steps)."""
        sched, gens = self.scheduler, self.generations
        if isinstance(command, NewConversation):
            sched.add(command.conv, command.tokens)
        elif isinstance(command, Prompt):
            if command.conv in sched and not gens.defer(command.conv, command.tokens):
                sched.append(command.conv, command.tokens)
        elif isinstance(command, Fork):
            if command.parent in sched:
                sched.fork(command.parent, command.child, command.n_tokens)
        elif isinstance(command, Generate):
            self._generate(command)
        elif isinstance(command, Cancel):
            if command.conv in gens:
                self.end(command.conv, FinishReason.CANCELLED)
        elif isinstance(command, Close):
            if command.conv in gens:
                self.end(command.conv, FinishReason.CANCELLED)
            guided = gens.guided_by(command.conv)
            if guided is not None:
                self.end(guided, error=ConversationClosed("the conversation guiding this one was closed"))
            if command.conv in sched:
                sched.remove(command.conv)
            gens.forget(command.conv)
            if command.ack is not None:
                self.outbox.emit(command.ack, Ack())
        elif isinstance(command, Rewind):
            if command.conv in sched and command.conv not in gens and gens.guided_by(command.conv) is None:
                sched.rewind(command.conv, command.n_tokens)
        elif isinstance(command, Save):
            self._save(command)
        elif isinstance(command, Load):
            self._load(command)
        elif isinstance(command, Embed):
            try:
                self.outbox.emit(command.sink, Vectors(self.executor.embed(command.texts, command.normalize)))
            except AiollamaError as exc:
                self.outbox.emit(command.sink, Delta(error=exc))
        elif isinstance(command, ClearCache):
            sched.kv.clear_cache()
            self.outbox.emit(command.ack, Ack())

    def _generate(self, command: Generate) -> None:
        conv = command.conv
        try:
            if conv not in self.scheduler:
                raise ConversationClosed("the conversation is closed")
            if conv in self.generations:
                raise ConversationBusy("the conversation is already generating: read that stream to its "
                                       "end or cancel it first")
            if self.generations.guided_by(conv) is not None:
                raise ConversationBusy("the conversation guides another one's stream: wait for that to end")
            guide = command.guide
            if guide is not None:
                self._check_guide(conv, guide)
            params = command.params
            shifts = self.config.context_shift if params.context_shift is None else params.context_shift
            shifts = shifts and guide is None  # the two histories stay in step
            n_keep = self.config.n_keep if params.n_keep is None else params.n_keep
            draft = self.config.draft_tokens if params.draft_tokens is None else params.draft_tokens
            if command.matcher is not None:  # a constraint's mask needs the tokens before it: one row at a time
                draft = 0
            self.executor.start_sampling(conv, params, self.scheduler.get(conv).tokens, command.matcher,
                                         guidance=None if guide is None else (guide, command.guidance_scale))
            try:
                dropped = self.scheduler.submit(conv, n_keep if shifts else None, draft, priority=params.priority,
                                                guide=guide)
            except BaseException:
                self.executor.stop_sampling(conv)
                raise
        except AiollamaError as exc:
            self.admission.leave()
            self.outbox.emit(command.sink, Delta(error=exc))
            return
        self.generations.start(conv, params, command.sink, shifts=shifts, dropped=dropped, guide=guide,
                               created=command.created)

    def _check_guide(self, conv: int, guide: int) -> None:
        if guide not in self.scheduler:
            raise ConversationClosed("the guidance conversation is closed")
        if guide in self.generations or self.generations.guided_by(guide) is not None:
            raise ConversationBusy("the guidance conversation is generating or guiding another stream")

    def _sync_kv(self) -> None:
        """Apply the KV operations decided since the last step (between steps, before reading or
        writing a sequence's cells directly)."""
        plan = Plan(self.scheduler.take_ops())
        if plan.ops:
            self.scheduler.update(plan, self.executor.execute(plan))

    def _save(self, command: Save) -> None:
        if command.conv not in self.scheduler:
            self.outbox.emit(command.sink, Delta(error=ConversationClosed("the conversation is closed")))
            return
        self._sync_kv()
        seq = self.scheduler.get(command.conv)
        state, n_cached = b"", 0
        if seq.seq_id is not None and seq.n_cached > 0:
            state, n_cached = self.executor.read_state(seq.seq_id), seq.n_cached
        else:  # parked in host memory, perhaps
            parked, n = self.scheduler.kv.host.best(seq.tokens, len(seq.tokens))
            if parked is not None and parked.data is not None and n == len(parked.tokens):
                state, n_cached = parked.data, n
        self.outbox.emit(command.sink, Snapshot(tuple(seq.tokens), n_cached if state else 0, state))

    def _load(self, command: Load) -> None:
        seq = self.scheduler.add(command.conv, command.tokens)
        kv = self.scheduler.kv
        if command.state and 0 < command.n_cached <= len(command.tokens) and kv.free_cells(command.n_cached) \
                and kv.assign(seq):
            kv.room(command.n_cached)
            self._sync_kv()  # evictions first: they may have freed the very seq id now assigned
            assert seq.seq_id is not None
            if self.executor.write_state(seq.seq_id, command.state):
                kv.extend(seq, command.n_cached)
            else:
                kv.drop(seq)
                self._sync_kv()
        self.outbox.emit(command.sink, Ack())

    def end(self, conv: int, reason: FinishReason | None = None, error: BaseException | None = None,
            past_end: int = 0) -> None:
        """End ``conv``'s generation: tell its stream (unless its last delta said so), free its
        sampler, keep its KV as a cache, and append the prompts that waited for it. ``past_end``
        tokens at the end of the history came after the generation's end (drafted): they go."""
        gens = self.generations
        stats = stats_of(self.scheduler.get(conv), gens.get(conv)) if reason is not None or error is not None \
            else None
        guide = gens.get(conv).guide
        deferred = gens.end(conv, reason, error, stats)
        self.executor.stop_sampling(conv)
        self.scheduler.finish(conv)
        if past_end:
            self.scheduler.rewind(conv, len(self.scheduler.get(conv).tokens) - past_end)
            self._counters.tokens_generated -= past_end
        for tokens in deferred:
            self.scheduler.append(conv, tokens)
        if guide is not None and guide in self.scheduler:
            for tokens in gens.deferred(guide):
                self.scheduler.append(guide, tokens)
            gens.forget(guide)

    def end_all(self, error: BaseException) -> None:
        """The engine closes: end every generation with ``error``."""
        for conv in self.generations.convs():
            self.end(conv, FinishReason.CANCELLED, error)
        self.publish()
        self.flush()

    def fail_all(self, error: EngineDead) -> None:
        """The engine died: tell every stream, touching nothing else (its state may be broken)."""
        for conv in self.generations.convs():
            self.generations.end(conv, error=error)
        self.outbox.flush()

    def flush(self) -> None:
        for portal in self.outbox.flush():
            # that event loop has closed: end its generations, nobody reads them
            for conv in self.generations.of_portal(portal):
                self.end(conv, FinishReason.CANCELLED)
            self.outbox.discard(portal)
            self.publish()

    def _count(self, plan: Plan, result: StepResult) -> None:
        c, status, n_cached = self._counters, result.status, result.n_cached
        c.decode_steps += 1
        c.decode_seconds += result.decode_seconds
        c.aborted_steps += status is StepStatus.ABORTED
        if status is StepStatus.OK:
            c.tokens_evaluated += plan.n_tokens
            c.tokens_generated += len(result.sampled)
        else:  # what an interrupted decode computed before it stopped stays in the cache
            c.tokens_evaluated += sum(max(0, n_cached.get(s.conv, s.pos) - s.pos) for s in plan.slices)

    def publish(self) -> None:
        c, kv, sched = self._counters, self.scheduler.kv, self.scheduler
        self.statistics = Statistics(
            live=sched.n_live, active=sched.n_active, queued=sched.n_queued,
            kv_cells_used=kv.cells.used, kv_cells_cached=kv.cells_cached() if kv.n_entries else 0,
            kv_cells_total=kv.cells.n_cells, seq_ids_used=kv.n_holders, cache_entries=kv.n_entries,
            n_seq_max=sched.max_running, tokens_evaluated=c.tokens_evaluated, tokens_generated=c.tokens_generated,
            decode_steps=c.decode_steps, aborted_steps=c.aborted_steps, decode_seconds=c.decode_seconds,
            step_seconds=c.step_seconds, step_histogram=tuple(self._step_counts),
            cache_hit_tokens=sched.cache_hit_tokens, parked=len(kv.host), parked_bytes=kv.host.used_bytes,
            parks=kv.parks, restores=kv.restores, evictions=kv.evictions, preemptions=sched.preemptions,
            compactions=kv.compactions, weights_device=self.executor.placement,
            kv_device=self.executor.placement)

