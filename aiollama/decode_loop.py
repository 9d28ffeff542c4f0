"""The decode thread: commands in, one step at a time, deltas out.

Each turn of the loop drains the command queue (blocking only when nothing runs), then takes one
step in the shape of vLLM's engine core:

1. ``plan = scheduler.schedule()``: pure; admissions, prefix sharing and KV operations included;
2. ``result = executor.execute(plan)``: the only call into llama.cpp (KV ops, decode, sampling);
3. ``scheduler.update(plan, result)`` and ``generations.update(result)``: pure; the history, the
   cache and the finish rules;
4. ``outbox.flush()``: one non-blocking hop per consumer event loop.

It imports neither llama.cpp nor an event loop library: the executor comes from a factory, and
consumers are reached through their portals. A fatal error reaches every waiting stream as
``EngineDead``; it never becomes a hang.
"""

from __future__ import annotations

import atexit
import bisect
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from aiollama.boundary import (
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
    Shutdown,
    Statistics,
    STEP_BUCKETS,
)
from aiollama.errors import (
    AiollamaError,
    ConversationBusy,
    ConversationClosed,
    DecodeError,
    EngineClosed,
    EngineDead,
)
from aiollama.generations import Generations
from aiollama.outbox import Outbox
from aiollama.scheduler import Scheduler
from aiollama.step import Executor, Plan, StepResult, StepStatus, Tokenizer

MAX_NO_SLOT_RETRIES = 16

_live_loops: weakref.WeakSet[DecodeLoop] = weakref.WeakSet()


@atexit.register
def _stop_live_loops() -> None:
    # A forgotten engine must not decode while the interpreter is torn down.
    for loop in list(_live_loops):
        loop.shutdown(timeout=10.0)


@dataclass
class _Counters:
    tokens_evaluated: int = 0
    tokens_generated: int = 0
    decode_steps: int = 0
    aborted_steps: int = 0
    decode_seconds: float = 0.0
    step_seconds: float = 0.0


class DecodeLoop:
    """Owns the executor on one thread; everything else talks to it through :meth:`send`.

    ``open_executor`` runs on the decode thread; what it raises is re-raised by :meth:`wait_ready`.
    """

    def __init__(self, config: EngineConfig, open_executor: Callable[[], Executor], admission: Admission) -> None:
        self.config = config
        self.admission = admission
        self.statistics = Statistics()
        self.dead: EngineDead | None = None
        self.tokenizer: Tokenizer | None = None  # set once the executor is open
        self.n_ctx = 0
        self._open_executor = open_executor
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="aiollama-decode", daemon=True)
        self._executor: Executor | None = None
        self._prefilling: frozenset[int] = frozenset()
        self._outbox = Outbox()
        self._counters = _Counters()
        self._step_counts = [0] * (len(STEP_BUCKETS) + 1)

    # caller side (any thread)

    def start(self) -> None:
        _live_loops.add(self)
        self._thread.start()

    def wait_ready(self) -> None:
        """Block until the executor is open; re-raise what opening it raised."""
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def send(self, command: Command) -> None:
        """Queue a command; never blocks. A cancel of a conversation being prefilled aborts the decode."""
        if self.dead is not None:
            raise self.dead
        self._commands.put(command)
        if self.dead is not None:  # it died meanwhile: the command may never be answered
            raise self.dead
        if isinstance(command, (Cancel, Close)) and command.conv in self._prefilling:
            executor = self._executor
            if executor is not None:
                executor.request_abort()

    def shutdown(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._commands.put(Shutdown())
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # decode thread

    def _run(self) -> None:
        try:
            try:
                executor = self._open_executor()
            except BaseException as exc:
                self._startup_error = exc
                return
            self._executor, self.tokenizer, self.n_ctx = executor, executor.tokenizer, executor.n_ctx
            self.scheduler = Scheduler(n_ctx=executor.n_ctx, n_seq_max=executor.n_seq_max,
                                       n_batch=executor.n_batch, step_tokens=self.config.step_tokens)
            self.generations = Generations(self.admission, self._outbox, executor.n_ctx)
            self._publish()
            self._ready.set()
            try:
                no_slot_streak = 0
                while self._drain(block=not self.scheduler.busy):
                    no_slot_streak = self._step(no_slot_streak)
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the streams
                self._die(exc)
            finally:
                self._answer_leftovers(self.dead or EngineClosed("the engine is closed"))
                self._executor = None
                executor.close()
        finally:
            self._ready.set()
            _live_loops.discard(self)

    def _step(self, no_slot_streak: int) -> int:
        """One step; returns how many NO_KV_SLOT steps in a row there have been."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self.generations.admitted(plan.admitted)
        if plan.slices:
            self._prefilling = plan.prefilling
            self._publish()  # admissions show while a long decode runs
        assert self._executor is not None
        result = self._executor.execute(plan)
        self._prefilling = frozenset()
        progressed = self.scheduler.update(plan, result)
        if plan.slices:
            self._count(plan, result, started)
        if result.status is StepStatus.OK:
            history = self.scheduler.get
            for conv in self.generations.update(result, lambda c: len(history(c).tokens)):
                self._end(conv)
            no_slot_streak = 0
        elif result.status is StepStatus.NO_KV_SLOT:
            # Planning keeps batches within the free cells, so this is rare: the scheduler frees
            # cells by force; give up only if it keeps happening with nothing left to free.
            no_slot_streak = 0 if progressed else no_slot_streak + 1
            if no_slot_streak > MAX_NO_SLOT_RETRIES:
                raise DecodeError("llama.cpp keeps finding no KV slot and nothing can be freed")
        elif result.status is StepStatus.FAILED:
            raise DecodeError(result.detail)
        self._publish()  # before the hop, so that a woken consumer sees this step's numbers
        self._flush()
        return no_slot_streak

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

    def _drain(self, block: bool) -> bool:
        """Run queued commands; False once shutdown is asked for."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, Shutdown):
                closed = EngineClosed("the engine was closed while this stream ran")
                for conv in self.generations.convs():
                    self._end(conv, FinishReason.CANCELLED, closed)
                self._publish()
                self._flush()
                return False
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, command: Command) -> None:
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
                self._end(command.conv, FinishReason.CANCELLED)
        elif isinstance(command, Close):
            if command.conv in gens:
                self._end(command.conv, FinishReason.CANCELLED)
            if command.conv in sched:
                sched.remove(command.conv)
            gens.forget(command.conv)
            if command.ack is not None:
                self._outbox.emit(command.ack, Ack())

    def _generate(self, command: Generate) -> None:
        conv, executor = command.conv, self._executor
        assert executor is not None
        try:
            if conv not in self.scheduler:
                raise ConversationClosed("the conversation is closed")
            if conv in self.generations:
                raise ConversationBusy("the conversation is already generating: read that stream to its "
                                       "end or cancel it first")
            executor.start_sampling(conv, command.params, self.scheduler.get(conv).tokens)
            try:
                self.scheduler.submit(conv)
            except BaseException:
                executor.stop_sampling(conv)
                raise
        except AiollamaError as exc:
            self.admission.leave()
            self._outbox.emit(command.sink, Delta(error=exc))
            return
        self.generations.start(conv, command.params, command.sink)

    def _end(self, conv: int, reason: FinishReason | None = None, error: BaseException | None = None) -> None:
        """End ``conv``'s generation: tell its stream (unless its last delta said so), free its
        sampler, keep its KV as a cache, and append the prompts that waited for it."""
        deferred = self.generations.end(conv, reason, error)
        assert self._executor is not None
        self._executor.stop_sampling(conv)
        self.scheduler.finish(conv)
        for tokens in deferred:
            self.scheduler.append(conv, tokens)

    def _flush(self) -> None:
        for portal in self._outbox.flush():
            # that event loop has closed: end its generations, nobody reads them
            for conv in self.generations.of_portal(portal):
                self._end(conv, FinishReason.CANCELLED)
            self._outbox.discard(portal)
            self._publish()

    def _publish(self) -> None:
        c, kv = self._counters, self.scheduler.kv
        self.statistics = Statistics(
            live=self.scheduler.n_live, active=self.scheduler.n_active, queued=self.scheduler.n_queued,
            kv_cells_used=kv.cells.used, kv_cells_total=kv.cells.n_cells, seq_ids_used=kv.n_holders,
            n_seq_max=kv.n_seq_max, tokens_evaluated=c.tokens_evaluated, tokens_generated=c.tokens_generated,
            decode_steps=c.decode_steps, aborted_steps=c.aborted_steps, decode_seconds=c.decode_seconds,
            step_seconds=c.step_seconds, step_histogram=tuple(self._step_counts))

    def _die(self, exc: BaseException) -> None:
        dead = EngineDead(f"the decode thread failed: {exc!r}")
        dead.__cause__ = exc
        self.dead = dead
        for conv in self.generations.convs():
            self.generations.end(conv, error=dead)
        self._outbox.flush()

    def _answer_leftovers(self, error: AiollamaError) -> None:
        """Commands that arrived after the loop stopped still get an answer."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Generate):
                self._outbox.emit(command.sink, Delta(error=error))
            elif isinstance(command, Close) and command.ack is not None:
                self._outbox.emit(command.ack, Ack())
        self._outbox.flush()
