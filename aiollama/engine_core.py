"""The decode thread's state and its step, in the shape of vLLM's engine core.

``EngineCore.step()`` is the whole step:

1. ``plan = scheduler.schedule()``: pure; admissions, prefix sharing and KV operations included;
2. ``result = executor.execute(plan)``: the only call into llama.cpp (KV ops, decode, sampling);
3. ``scheduler.update(plan, result)`` and ``generations.update(result)``: pure; the history, the
   cache and the finish rules;
4. ``outbox.flush()``: one non-blocking hop per consumer event loop.

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
    Close,
    Command,
    Delta,
    EngineConfig,
    FinishReason,
    Fork,
    Generate,
    NewConversation,
    Prompt,
    Statistics,
)
from aiollama.errors import AiollamaError, ConversationBusy, ConversationClosed, DecodeError, EngineDead
from aiollama.generations import Generations
from aiollama.outbox import Outbox
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
        self.admission = admission
        self.scheduler = Scheduler(n_ctx=executor.n_ctx, n_seq_max=executor.n_seq_max,
                                   n_batch=executor.n_batch, step_tokens=config.step_tokens)
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
        if plan.slices:
            self.prefilling = plan.prefilling
            self.publish()  # admissions show while a long decode runs
        result = self.executor.execute(plan)
        self.prefilling = frozenset()
        progressed = self.scheduler.update(plan, result)
        if plan.slices:
            self._count(plan, result, started)
        if result.status is StepStatus.OK:
            self._no_slot_streak = 0
            history = self.scheduler.get
            for conv in self.generations.update(result, lambda c: len(history(c).tokens)):
                self.end(conv)
        elif result.status is StepStatus.NO_KV_SLOT:
            # Planning keeps batches within the free cells, so this is rare: the scheduler frees
            # cells by force; give up only if it keeps happening with nothing left to free.
            self._no_slot_streak = 0 if progressed else self._no_slot_streak + 1
            if self._no_slot_streak > MAX_NO_SLOT_RETRIES:
                raise DecodeError("llama.cpp keeps finding no KV slot and nothing can be freed")
        elif result.status is StepStatus.FAILED:
            raise DecodeError(result.detail)
        self.publish()  # before the hop, so that a woken consumer sees this step's numbers
        self.flush()

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
            if command.conv in sched:
                sched.remove(command.conv)
            gens.forget(command.conv)
            if command.ack is not None:
                self.outbox.emit(command.ack, Ack())

    def _generate(self, command: Generate) -> None:
        conv = command.conv
        try:
            if conv not in self.scheduler:
                raise ConversationClosed("the conversation is closed")
            if conv in self.generations:
                raise ConversationBusy("the conversation is already generating: read that stream to its "
                                       "end or cancel it first")
            self.executor.start_sampling(conv, command.params, self.scheduler.get(conv).tokens)
            try:
                self.scheduler.submit(conv)
            except BaseException:
                self.executor.stop_sampling(conv)
                raise
        except AiollamaError as exc:
            self.admission.leave()
            self.outbox.emit(command.sink, Delta(error=exc))
            return
        self.generations.start(conv, command.params, command.sink)

    def end(self, conv: int, reason: FinishReason | None = None, error: BaseException | None = None) -> None:
        """End ``conv``'s generation: tell its stream (unless its last delta said so), free its
        sampler, keep its KV as a cache, and append the prompts that waited for it."""
        deferred = self.generations.end(conv, reason, error)
        self.executor.stop_sampling(conv)
        self.scheduler.finish(conv)
        for tokens in deferred:
            self.scheduler.append(conv, tokens)

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

    def _count(self, plan: Plan, result: StepResult, started: float) -> None:
        c, status, n_cached = self._counters, result.status, result.n_cached
        c.decode_steps += 1
        c.decode_seconds += result.decode_seconds
        c.aborted_steps += status is StepStatus.ABORTED
        if status is StepStatus.OK:
            c.tokens_evaluated += plan.n_tokens
            c.tokens_generated += len(result.sampled)
        else:  # what an interrupted decode computed before it stopped stays in the cache
            c.tokens_evaluated += sum(max(0, n_cached.get(s.conv, s.pos) - s.pos) for s in plan.slices)
        elapsed = time.perf_counter() - started
        c.step_seconds += elapsed
        self._step_counts[bisect.bisect_left(STEP_BUCKETS, elapsed)] += 1

    def publish(self) -> None:
        c, kv, sched = self._counters, self.scheduler.kv, self.scheduler
        self.statistics = Statistics(
            live=sched.n_live, active=sched.n_active, queued=sched.n_queued,
            kv_cells_used=kv.cells.used, kv_cells_total=kv.cells.n_cells, seq_ids_used=kv.n_holders,
            n_seq_max=kv.n_seq_max, tokens_evaluated=c.tokens_evaluated, tokens_generated=c.tokens_generated,
            decode_steps=c.decode_steps, aborted_steps=c.aborted_steps, decode_seconds=c.decode_seconds,
            step_seconds=c.step_seconds, step_histogram=tuple(self._step_counts))

