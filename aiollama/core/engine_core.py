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

Overlapped (``EngineConfig.overlap``; by default where the decode runs on a GPU, whose
``llama_decode`` returns before the device finishes), step N+1 is planned and submitted right after
step N's tokens are sampled and joined their histories, and step N's finish rules and delivery run
while N+1 decodes: :meth:`EngineCore.settle`. A stream that step N ended still has a row in N+1: it
is not sampled, and its cells are removed (``Scheduler.stopped``, ``StepResult.discarded``). The
loop settles before it applies commands or waits, so commands always see a whole step.

Commands from callers are applied between steps by :meth:`EngineCore.handle`. Everything here runs on
the decode thread, except reads of ``statistics`` and ``prefilling``, which are replaced whole.
It imports neither llama.cpp nor an event loop library.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Collection
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from aiollama.config import EngineConfig
from aiollama.core.commands import Admission, Command, Portal
from aiollama.core.diskcache import DiskCache, file_identity
from aiollama.core.generations import Generations, stats_of
from aiollama.core.handlers import Handlers
from aiollama.core.outbox import Outbox, hand_over, wake
from aiollama.core.outputs import STEP_BUCKETS, FinishReason, Statistics
from aiollama.errors import DecodeError, EngineDead, InvalidRequestError
from aiollama.sched import Scheduler, SchedulerConfig
from aiollama.sched.step import Executor, Overlapped, Plan, StepResult, StepStatus

MAX_NO_SLOT_RETRIES = 16
# The longest the decode thread waits for the consumers of first tokens when no other stream is
# waiting (see outbox.hand_over): a loop that does not come in time costs no more than this.
HAND_OVER_SECONDS = 0.002


@dataclass
class _Counters:
    tokens_evaluated: int = 0
    tokens_generated: int = 0
    decode_steps: int = 0
    aborted_steps: int = 0
    discarded_tokens: int = 0
    decode_seconds: float = 0.0
    step_seconds: float = 0.0


class EngineCore:
    """The scheduler, the running generations and the executor of one engine, and its step."""

    def __init__(self, executor: Executor, config: EngineConfig, admission: Admission) -> None:
        self.executor = executor
        self.config = config
        self.admission = admission
        self.disk = open_disk(executor, config)
        self.scheduler = Scheduler(scheduler_config(executor, config), disk=self.disk)
        self.outbox = Outbox()
        self.generations = Generations(admission, self.outbox, executor.n_ctx)
        self.prefilling: frozenset[int] = frozenset()  # a cancel of these aborts the running decode
        self._published: tuple[Any, ...] = ()  # the numbers of the last step (see publish)
        self._built: tuple[tuple[Any, ...], Statistics] | None = None
        self._counters = _Counters()
        self._step_counts = [0] * (len(STEP_BUCKETS) + 1)
        self._no_slot_streak = 0
        self._unwoken: list[Portal] = []
        self.overlapped = overlapped(executor, config)
        self._settling: tuple[Plan, StepResult] | None = None  # a step whose finish rules and delivery wait
        self._ended_in_flight: list[int] | None = None  # samplers to stop once the decode is collected
        self.handlers = Handlers(self)
        self.publish()

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    def step(self) -> None:
        started = time.perf_counter()
        plan = self.schedule(self.generations.ending(self._settling[1]) if self._settling else ())
        if self.disk is not None and not plan.slices and not plan.ops and self.scheduler.loading:
            self.disk.wait(0.005)  # only reads from disk are pending: wait for one, not spin
        if self.overlapped is None or not plan.slices:
            self.settle()
            result = self.execute(plan)
            self.update(plan, result)
            self.deliver(plan, started)
            return
        self.overlapped.submit(plan)
        self._ended_in_flight = []
        try:
            self.settle()  # the last step's finish rules and delivery, while this one decodes
        finally:
            ended, self._ended_in_flight = self._ended_in_flight, None
        result = self.overlapped.collect(self.scheduler.stopped(plan))
        for conv in ended:
            self.executor.stop_sampling(conv)
        self.update(plan, result, settle=False)
        self._settling = (plan, result)
        self._count_step(time.perf_counter() - started)

    def settle(self) -> None:
        """Apply the finish rules of the step that waits for them, and deliver its tokens."""
        if self._settling is None:
            return
        plan, result = self._settling
        self._settling = None
        if result.status is StepStatus.OK:
            self.finish_rules(result)
        self.deliver(plan, None)
        wake(self.outbox.take_unwoken())  # a decode is running or none follows: now

    def schedule(self, hold: Collection[int] = ()) -> Plan:
        """The step's plan; the generations learn who was admitted and whose history shifted."""
        plan = self.scheduler.schedule(hold)
        self.generations.admitted(plan.admitted)
        for conv, keep, n in plan.shifted:
            self.generations.shifted(conv, keep, n)
        if plan.slices:
            self.prefilling = plan.prefilling
            if plan.admitted or self.prefilling:
                self.publish()  # admissions and prompts show while a long decode runs
        return plan

    def execute(self, plan: Plan) -> StepResult:
        """The plan run by the executor. The event loops that have chunks of the last step waiting
        are woken as the decode starts, when the executor releases the GIL (at once without one)."""
        self._unwoken = unwoken = self.outbox.take_unwoken()
        if plan.slices:
            return self.executor.execute(plan, lambda: wake(unwoken))
        wake(unwoken)
        return self.executor.execute(plan)

    def update(self, plan: Plan, result: StepResult, settle: bool = True) -> None:
        """The step's result applied: the cache and histories, the counters, and (unless ``settle``
        is False: :meth:`settle` does it later) the finish rules. Raises DecodeError when llama.cpp
        failed, or keeps finding no KV slot with nothing to free."""
        self.prefilling = frozenset()
        progressed = self.scheduler.update(plan, result)
        if plan.slices:
            self._count(plan, result)
        if result.status is StepStatus.OK:
            self._no_slot_streak = 0
            if settle:
                self.finish_rules(result)
        elif result.status is StepStatus.NO_KV_SLOT:
            # Planning keeps batches within the free cells, so this is rare: the scheduler frees
            # cells by force; give up only if it keeps happening with nothing left to free.
            self._no_slot_streak = 0 if progressed else self._no_slot_streak + 1
            if self._no_slot_streak > MAX_NO_SLOT_RETRIES:
                raise DecodeError("llama.cpp keeps finding no KV slot and nothing can be freed")
        elif result.status is StepStatus.FAILED:
            raise DecodeError(result.detail)

    def finish_rules(self, result: StepResult) -> None:
        """The generations read a decoded step's tokens; those that it ends, end."""
        for conv, past_end in self.generations.update(result, self.scheduler).items():
            self.end(conv, past_end=past_end)
        for conv, exc in result.failed.items():
            if conv in self.generations:
                self.end(conv, error=exc)

    def deliver(self, plan: Plan, started: float | None) -> None:
        """The step's output to its consumers: the numbers published, then one hop per event loop.
        The whole step counts, delivery included: up to the publishing in the numbers published
        now, the publishing and the hop in the next ones (an overlapped step counts from its
        planning to its collection: its delivery is inside the next one's)."""
        wake(self._unwoken)  # in case no decode started: a portal woken already is not asked again
        self._unwoken = []
        counted = time.perf_counter()
        if plan.slices and started is not None:
            self._count_step(counted - started)
        self.publish()  # before the hop, so that a woken consumer sees this step's numbers
        self.flush()
        if plan.slices and started is not None:
            self._counters.step_seconds += time.perf_counter() - counted
        if self.generations.only_first_tokens() and started is not None:
            # nobody waits for the next step: the first tokens' consumers run first, on this
            # thread's core (see outbox.hand_over); the wait is not the step's
            hand_over(self.outbox.take_unwoken(), HAND_OVER_SECONDS)

    def _count_step(self, seconds: float) -> None:
        self._counters.step_seconds += seconds
        self._step_counts[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1

    def handle(self, command: Command) -> None:
        """Apply a caller's command (between steps): see :mod:`aiollama.core.handlers`."""
        self.handlers(command)

    def end(self, conv: int, reason: FinishReason | None = None, error: BaseException | None = None,
            past_end: int = 0) -> None:
        """End ``conv``'s generation: tell its stream (unless its last delta said so), free its
        sampler, keep its KV as a cache, and append the prompts that waited for it. ``past_end``
        tokens at the end of the history came after the generation's end (drafted): they go."""
        gens = self.generations
        stats = stats_of(self.scheduler.progress(conv), gens.get(conv)) if reason is not None or error is not None \
            else None
        guide = gens.get(conv).guide
        deferred = gens.end(conv, reason, error, stats)
        if self._ended_in_flight is not None:
            self._ended_in_flight.append(conv)  # the decode running may use its sampler (in its graph)
        else:
            self.executor.stop_sampling(conv)
        self.scheduler.finish(conv)
        if past_end:
            self.scheduler.rewind(conv, self.scheduler.length(conv) - past_end)
            self._counters.tokens_generated -= past_end
        for tokens in deferred:
            self.scheduler.append(conv, tokens)
        if guide is not None and guide in self.scheduler:
            for tokens in gens.deferred(guide):
                self.scheduler.append(guide, tokens)
            gens.forget(guide)

    def end_all(self, error: BaseException) -> None:
        """The engine closes: end every generation with ``error``."""
        self.settle()
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
            thrown = sum(len(s.tokens) for s in plan.slices if s.conv in result.discarded) if result.discarded else 0
            c.tokens_evaluated += plan.n_tokens - thrown
            c.discarded_tokens += thrown
            c.tokens_generated += len(result.sampled)
        else:  # what an interrupted decode computed before it stopped stays in the cache
            c.tokens_evaluated += sum(max(0, n_cached.get(s.conv, s.pos) - s.pos) for s in plan.slices)

    def publish(self) -> None:
        """Replace the numbers that :attr:`statistics` shows: plain immutable values, taken here on
        the decode thread after every step; the ``Statistics`` is built from them when it is read."""
        c = self._counters
        self._published = (
            self.scheduler.statistics(), c.tokens_evaluated, c.tokens_generated, c.decode_steps, c.aborted_steps,
            c.discarded_tokens, c.decode_seconds, c.step_seconds, tuple(self._step_counts),
            self.disk.n_entries if self.disk else 0, self.disk.n_bytes if self.disk else 0)

    @property
    def statistics(self) -> Statistics:
        """The engine's numbers as the last step published them (safe from any thread: a step
        replaces its numbers whole; reading them builds the snapshot once)."""
        published, built = self._published, self._built
        if built is not None and built[0] is published:
            return built[1]
        sched, evaluated, generated, steps, aborted, discarded, decode_s, step_s, histogram, entries, size = published
        stats = Statistics(
            **vars(sched), tokens_evaluated=evaluated, tokens_generated=generated, decode_steps=steps,
            aborted_steps=aborted, discarded_tokens=discarded, decode_seconds=decode_s, step_seconds=step_s,
            step_histogram=histogram, weights_device=self.executor.placement, kv_device=self.executor.placement,
            disk_entries=entries, disk_bytes=size)
        self._built = (published, stats)
        return stats

    def close(self) -> None:
        """The engine stops: the copies for disk that the last closes asked for are made, and the
        queued writes finish."""
        if self.disk is None:
            return
        try:
            ops = self.scheduler.take_ops()
            if ops:
                plan = Plan(ops)
                self.scheduler.update(plan, self.executor.execute(plan))
        except Exception:  # noqa: BLE001 - a dead executor: what it could not copy is not cached
            pass
        finally:
            self.disk.close()


def overlapped(executor: Executor, config: EngineConfig) -> Overlapped | None:
    """The executor, where steps overlap: as ``config.overlap`` says, by default where it decodes on
    a GPU. Raises InvalidRequestError for ``overlap=True`` with an executor that cannot."""
    if config.overlap is False:
        return None
    if not isinstance(executor, Overlapped):
        if config.overlap:
            raise InvalidRequestError(f"overlap: {type(executor).__name__} cannot start a decode without waiting for it")
        return None
    return executor if config.overlap or executor.placement != "CPU" else None


def open_disk(executor: Executor, config: EngineConfig) -> DiskCache | None:
    """The disk tier of ``config.cache_dir``, for the states of this model file (two finetunes of
    one architecture have the same fingerprint), these adapter files and this cache layout."""
    if config.cache_dir is None:
        return None
    try:
        ours = version("aiollama")
    except PackageNotFoundError:
        ours = "source"
    try:
        files = {"model": file_identity(config.model_path) if config.model_path else "",
                 "lora": {name: file_identity(path) for name, path in sorted(config.lora.items())}}
        return DiskCache(config.cache_dir, config.cache_disk_bytes, {**executor.fingerprint, **files}, ours)
    except OSError as exc:
        raise InvalidRequestError(f"cache_dir {config.cache_dir}: {exc}") from None


def scheduler_config(executor: Executor, config: EngineConfig) -> SchedulerConfig:
    """The scheduler of an engine: the context's shape from its executor, the policy from its config."""
    return SchedulerConfig(
        n_ctx=executor.n_ctx, n_cells=executor.n_cells, n_seq_max=executor.n_seq_max, n_batch=executor.n_batch,
        step_tokens=config.step_tokens, max_running=config.n_seq_max, host_bytes=config.host_cache_bytes,
        can_shift=executor.can_shift, ordered=config.deterministic, draft_model=config.draft_model is not None or config.mtp,
        kv_unified=executor.kv_unified, memory=executor.memory, checkpoint_bytes=config.checkpoint_bytes,
        whole_images=getattr(executor, "whole_images", False), rollback=getattr(executor, "rollback", 0))
