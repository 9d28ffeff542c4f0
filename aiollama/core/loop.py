"""The decode thread: commands in, one step at a time, deltas out.

:class:`DecodeLoop` is the thread's shell: it opens the executor on the thread, drains the command
queue between steps (blocking only when nothing runs), runs :meth:`EngineCore.step
<aiollama.core.engine_core.EngineCore.step>`, and makes sure every failure reaches every stream as
``EngineDead`` and every later command gets an answer: nothing ever hangs.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from aiollama.config import EngineConfig
from aiollama.core.commands import (
    Admission,
    Cancel,
    Close,
    Command,
    Shutdown,
    answer_when_gone,
)
from aiollama.core.engine_core import EngineCore
from aiollama.core.outbox import Outbox
from aiollama.core.outputs import Statistics
from aiollama.errors import AiollamaError, EngineClosed, EngineDead
from aiollama.formats.tokens import Tokenizer
from aiollama.sched.step import Executor

_live_loops: weakref.WeakSet[DecodeLoop] = weakref.WeakSet()

# The decode thread's stack. It loads the model, and llama.cpp's tokenizer (run while its
# vocabulary loads) compiles and runs std::regex, whose recursion needs more than the smallest
# thread stacks some systems give; a stack is address space, reserved and only used as needed.
DECODE_STACK_BYTES = 64 * 2**20
_stack_size_lock = threading.Lock()  # threading.stack_size is process-wide


@atexit.register
def _stop_live_loops() -> None:
    # A forgotten engine must not decode while the interpreter is torn down.
    for loop in list(_live_loops):
        loop.shutdown(timeout=10.0)


class DecodeLoop:
    """Owns the engine core on one thread; everything else talks to it through :meth:`send`.

    ``open_executor`` runs on the decode thread; what it raises is re-raised by :meth:`wait_ready`.
    """

    def __init__(self, config: EngineConfig, open_executor: Callable[[], Executor], admission: Admission) -> None:
        self.config = config
        self.admission = admission
        self.dead: EngineDead | None = None
        self._failed: Command | None = None  # the command the decode thread failed on
        self.tokenizer: Tokenizer | None = None  # set once the executor is open
        self.projector: Any = None
        self.fingerprint: Mapping[str, str | int] = {}
        self.model_info: Mapping[str, str | int] = {}
        self.n_ctx = 0
        self._open_executor = open_executor
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="aiollama-decode", daemon=True)
        self._core: EngineCore | None = None

    # caller side (any thread)

    def start(self) -> None:
        _live_loops.add(self)
        with _stack_size_lock:
            previous = threading.stack_size(DECODE_STACK_BYTES)
            try:
                self._thread.start()
            finally:
                threading.stack_size(previous)

    def wait_ready(self) -> None:
        """Block until the executor is open; re-raise what opening it raised."""
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    @property
    def statistics(self) -> Statistics:
        core = self._core
        return Statistics() if core is None else core.statistics

    def send(self, command: Command) -> None:
        """Queue a command; never blocks. A cancel of a conversation being prefilled aborts the decode."""
        if self.dead is not None:
            raise self.dead
        self._commands.put(command)
        if self.dead is not None:  # it died meanwhile: the command may never be answered
            raise self.dead
        core = self._core
        if core is not None and isinstance(command, (Cancel, Close)) and command.conv in core.prefilling:
            core.executor.request_abort()

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
        outbox = Outbox()
        try:
            try:
                executor = self._open_executor()
            except BaseException as exc:
                self._startup_error = exc
                return
            try:
                core = EngineCore(executor, self.config, self.admission)
            except BaseException as exc:
                executor.close()
                self._startup_error = exc
                return
            self.tokenizer, self.n_ctx, outbox = executor.tokenizer, executor.n_ctx, core.outbox
            self.fingerprint, self.model_info = executor.fingerprint, executor.model_info
            self.projector = getattr(executor, "projector", None)  # images: used from the callers' threads
            self._core = core
            self._ready.set()
            try:
                while self._drain(core, block=not core.busy):
                    core.step()
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the streams
                dead = EngineDead(f"the decode thread failed: {exc!r}")
                dead.__cause__ = exc
                self.dead = dead
                core.fail_all(dead)
            finally:
                core.close()
                executor.close()
        finally:
            self._answer_leftovers(outbox, self.dead or EngineClosed("the engine is closed"))
            self._ready.set()
            _live_loops.discard(self)

    def _drain(self, core: EngineCore, block: bool) -> bool:
        """Run queued commands; False once shutdown is asked for."""
        try:
            if block:
                core.settle()
                core.outbox.wake_all()  # nothing is decoding: deliver what the last step sent now
                command = self._commands.get()
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            return True
        core.settle()  # commands see whole steps: an overlapped one's finish rules applied
        while True:
            if isinstance(command, Shutdown):
                core.end_all(EngineClosed("the engine was closed while this stream ran"))
                return False
            try:
                core.handle(command)
            except BaseException:
                self._failed = command  # it left the queue: it is answered with the leftovers
                raise
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _answer_leftovers(self, outbox: Outbox, error: AiollamaError) -> None:
        """Commands that arrived after the loop stopped, and the one it failed on, still get an
        answer."""
        failed, self._failed = self._failed, None
        while True:
            if failed is not None:
                command, failed = failed, None
            else:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
            answer = answer_when_gone(command, error)
            if answer is not None:
                outbox.emit(*answer)
        outbox.flush()
        outbox.wake_all()
