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
from importlib.metadata import PackageNotFoundError, version

from aiollama.config import EngineConfig
from aiollama.core.commands import Admission, Command, Portal
from aiollama.core.diskcache import DiskCache, file_identity
from aiollama.core.generations import Generations, stats_of
from aiollama.core.handlers import Handlers
from aiollama.core.outbox import Outbox, wake
from aiollama.core.outputs import STEP_BUCKETS, FinishReason, Statistics
from aiollama.errors import DecodeError, EngineDead, InvalidRequestError
from aiollama.sched import Scheduler, SchedulerConfig
from aiollama.sched.step import Executor, Plan, StepResult, StepStatus

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
        self.disk = open_disk(executor, config)
        self.scheduler = Scheduler(scheduler_config(executor, config), disk=self.disk)
        self.outbox = Outbox()
        self.generations = Generations(admission, self.outbox, executor.n_ctx)
        self.prefilling: frozenset[int] = frozenset()  # a cancel of these aborts the running decode
        self.statistics = Statistics()
        self._counters = _Counters()
        self._step_counts = [0] * (len(STEP_BUCKETS) + 1)
        self._no_slot_streak = 0
        self._unwoken: list[Portal] = []
        self.handlers = Handlers(self)
        self.publish()

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    def step(self) -> None:
        started = time.perf_counter()
        plan = self.schedule()
        if self.disk is not None and not plan.slices and not plan.ops and self.scheduler.loading:
            self.disk.wait(0.005)  # only reads from disk are pending: wait for one, not spin
        result = self.execute(plan)
        self.update(plan, result)
        self.deliver(plan, started)

    def schedule(self) -> Plan:
        """The step's plan; the generations learn who was admitted and whose history shifted."""
        plan = self.scheduler.schedule()
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

    def update(self, plan: Plan, result: StepResult) -> None:
        """The step's result applied: the cache and histories, the counters, and the finish rules.
        Raises DecodeError when llama.cpp failed, or keeps finding no KV slot with nothing to free."""
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

    def deliver(self, plan: Plan, started: float) -> None:
        """The step's output to its consumers: the numbers published, then one hop per event loop.
        The whole step counts, delivery included: up to the publishing in the numbers published
        now, the publishing and the hop in the next ones."""
        wake(self._unwoken)  # in case no decode started: a portal woken already is not asked again
        self._unwoken = []
        counted = time.perf_counter()
        if plan.slices:
            self._counters.step_seconds += counted - started
            self._step_counts[bisect.bisect_left(STEP_BUCKETS, counted - started)] += 1
        self.publish()  # before the hop, so that a woken consumer sees this step's numbers
        self.flush()
        if plan.slices:
            self._counters.step_seconds += time.perf_counter() - counted

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
        c = self._counters
        self.statistics = Statistics(
            **vars(self.scheduler.statistics()), tokens_evaluated=c.tokens_evaluated,
            tokens_generated=c.tokens_generated, decode_steps=c.decode_steps, aborted_steps=c.aborted_steps,
            decode_seconds=c.decode_seconds, step_seconds=c.step_seconds, step_histogram=tuple(self._step_counts),
            weights_device=self.executor.placement, kv_device=self.executor.placement,
            disk_entries=self.disk.n_entries if self.disk else 0, disk_bytes=self.disk.n_bytes if self.disk else 0)

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
        can_shift=executor.can_shift, ordered=config.deterministic, draft_model=config.draft_model is not None,
        kv_unified=executor.kv_unified, memory=executor.memory, checkpoint_bytes=config.checkpoint_bytes,
        whole_images=getattr(executor, "whole_images", False))
