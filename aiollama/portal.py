"""How the decode thread reaches consumers: one non-blocking hop into an event loop, or a queue.

The decode thread only calls ``Portal.send`` and ``Sink.deliver`` (through the portal); it never
waits for a consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import sniffio

from aiollama.boundary import Item, Portal
from aiollama.errors import WrongEventLoop

# A trio run leaves its token behind when it ends; forget the portals of old runs now and then
# (a process rarely runs many trio loops, and a forgotten portal is only a small object).
MAX_TRIO_PORTALS = 64
WAKE_READ = 4096  # bytes read from a wake pipe at a time (a step writes one)


class _WakePipe:
    """A pipe the decode thread writes a byte to, to make an event loop run what was sent to it.

    The decode thread writes as it starts a ``llama_decode``, with the GIL released, so the loop
    takes the GIL while the decode computes, not while the decode thread waits for it. The pipe is
    closed only when its portal is collected, so a writer holding the portal never writes to a
    reused descriptor.
    """

    def __init__(self, owner: object) -> None:
        self._items: deque[Callable[[], None]] = deque()
        self._read, self.wake_fd = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self.wake_fd, False)
        weakref.finalize(owner, _close_fds, self._read, self.wake_fd)

    def post(self, callback: Callable[[], None]) -> None:
        self._items.append(callback)  # deque.append is atomic: the loop may be running callbacks

    def run_posted(self) -> None:
        """On the loop: empty the pipe, then run everything posted, in order."""
        try:
            while len(os.read(self._read, WAKE_READ)) == WAKE_READ:
                pass  # a short read emptied it: no second system call to learn so
        except BlockingIOError:
            pass
        while self._items:
            self._items.popleft()()


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class AsyncioPortal:
    """Delivers into an asyncio loop. With a selector loop (the default on Unix, and uvloop), sent
    callbacks wait in a queue until the decode thread writes to the wake pipe; otherwise each send
    is a ``call_soon_threadsafe``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._pipe: _WakePipe | None = _WakePipe(self)
        self.wake_fd: int | None = self._pipe.wake_fd
        try:
            loop.add_reader(self._pipe._read, self._pipe.run_posted)
        except NotImplementedError:  # a proactor loop has no readers
            self._pipe, self.wake_fd = None, None

    @property
    def owner(self) -> asyncio.AbstractEventLoop | None:
        return self._loop()

    def send(self, callback: Callable[[], None]) -> bool:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return False  # nobody is listening any more
        if self._pipe is not None:
            self._pipe.post(callback)
            return True
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:
            return False
        return True


class TrioPortal:
    """Delivers into a trio run: a system task waits on the wake pipe and runs what was sent."""

    def __init__(self, token: Any) -> None:
        import trio

        self.owner = token
        self._pipe = _WakePipe(self)
        self.wake_fd: int | None = self._pipe.wake_fd
        self._done = False
        trio.lowlevel.spawn_system_task(self._serve, name="aiollama-portal")

    async def _serve(self) -> None:
        import trio

        try:
            while True:
                await trio.lowlevel.wait_readable(self._pipe._read)
                self._pipe.run_posted()
        finally:
            self._done = True

    def send(self, callback: Callable[[], None]) -> bool:
        if self._done:
            return False  # the run has ended
        self._pipe.post(callback)
        return True


class ThreadPortal:
    """For consumers on plain threads: their sinks are thread-safe queues, so deliver at once."""

    owner = None
    wake_fd: int | None = None  # send() delivers at once

    def send(self, callback: Callable[[], None]) -> bool:
        callback()
        return True


THREAD_PORTAL = ThreadPortal()
_asyncio_portals: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncioPortal] = weakref.WeakKeyDictionary()
_trio_portals: dict[Any, TrioPortal] = {}


def current_portal() -> Portal:
    """The portal of the event loop the caller runs in (one per loop, so a step hops once per loop).

    Raises WrongEventLoop outside asyncio and trio.
    """
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        raise WrongEventLoop("no event loop runs in this thread: an Engine is used from its own "
                             "event loop; plain threads use SyncEngine") from None
    if library == "asyncio":
        loop = asyncio.get_running_loop()
        portal = _asyncio_portals.get(loop)
        if portal is None:
            portal = _asyncio_portals[loop] = AsyncioPortal(loop)
        return portal
    if library == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()
        trio_portal = _trio_portals.get(token)
        if trio_portal is None:
            if len(_trio_portals) > MAX_TRIO_PORTALS:
                _trio_portals.clear()
            trio_portal = _trio_portals[token] = TrioPortal(token)
        return trio_portal
    raise WrongEventLoop(f"aiollama supports asyncio and trio, not {library}")


class AsyncSink:
    """A stream's inbox on its event loop; ``deliver`` runs on that loop.

    ``on_item`` sees every item as it arrives, whether or not anyone reads the stream (the
    conversation keeps its history with it). On asyncio a waiting reader waits on a plain future
    (a step wakes every stream, so this is the consumer's hot path); on trio on an event.
    """

    def __init__(self, portal: Portal, on_item: Callable[[Item], None] | None = None) -> None:
        self.portal = portal
        self._on_item = on_item
        self._items: deque[Item] = deque()
        self._asyncio = isinstance(portal, AsyncioPortal)
        # the readers waiting: a future each on asyncio (one reader's cancellation cancels its
        # own), or one anyio event on trio
        self._futures: list[asyncio.Future[None]] = []
        self._event: anyio.Event | None = None

    def deliver(self, item: Item) -> None:
        if self._on_item is not None:
            self._on_item(item)
        self._items.append(item)
        if self._futures:
            futures, self._futures = self._futures, []
            for future in futures:
                if not future.done():  # a cancelled reader's future is done
                    future.set_result(None)
        elif self._event is not None:
            self._event.set()
            self._event = None

    async def get(self) -> Item:
        while not self._items:
            if self._asyncio:
                future = asyncio.get_running_loop().create_future()
                self._futures.append(future)
                await future
            else:
                if self._event is None:
                    self._event = anyio.Event()
                await self._event.wait()
        return self._items.popleft()


class ThreadSink:
    """A stream's inbox for a consumer on a plain thread; ``deliver`` runs on the decode thread."""

    portal: Portal = THREAD_PORTAL

    def __init__(self, on_item: Callable[[Item], None] | None = None) -> None:
        self._on_item = on_item
        self._queue: queue.SimpleQueue[Item] = queue.SimpleQueue()

    def deliver(self, item: Item) -> None:
        if self._on_item is not None:
            self._on_item(item)
        self._queue.put(item)

    def get(self) -> Item:
        return self._queue.get()
