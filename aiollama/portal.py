"""How the decode thread reaches consumers: one non-blocking hop into an event loop, or a queue.

The decode thread only calls ``Portal.send`` and ``Sink.deliver`` (through the portal); it never
waits for a consumer.
"""

from __future__ import annotations

import asyncio
import queue
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import sniffio

from aiollama.commands import Delta, Portal
from aiollama.errors import WrongEventLoop


class AsyncioPortal:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.owner = loop

    def send(self, callback: Callable[[], None]) -> bool:
        try:
            self.owner.call_soon_threadsafe(callback)
        except RuntimeError:
            return False  # the loop is closed: nobody is listening any more
        return True


class TrioPortal:
    def __init__(self, token: Any) -> None:
        self.owner = token

    def send(self, callback: Callable[[], None]) -> bool:
        import trio

        try:
            self.owner.run_sync_soon(callback)
        except trio.RunFinishedError:
            return False
        return True


class ThreadPortal:
    """For consumers on plain threads: their sinks are thread-safe queues, so deliver at once."""

    owner = None

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
            if len(_trio_portals) > 64:
                _trio_portals.clear()
            trio_portal = _trio_portals[token] = TrioPortal(token)
        return trio_portal
    raise WrongEventLoop(f"aiollama supports asyncio and trio, not {library}")


class AsyncSink:
    """A stream's inbox on its event loop; ``deliver`` runs on that loop."""

    def __init__(self, portal: Portal) -> None:
        self.portal = portal
        self._items: deque[Delta] = deque()
        self._event = anyio.Event()

    def deliver(self, delta: Delta) -> None:
        self._items.append(delta)
        self._event.set()

    async def get(self) -> Delta:
        while not self._items:
            if self._event.is_set():
                self._event = anyio.Event()
            await self._event.wait()
        return self._items.popleft()

    def get_nowait(self) -> Delta | None:
        return self._items.popleft() if self._items else None


class ThreadSink:
    """A stream's inbox for a consumer on a plain thread."""

    portal: Portal = THREAD_PORTAL

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Delta] = queue.SimpleQueue()

    def deliver(self, delta: Delta) -> None:
        self._queue.put(delta)

    def get(self, timeout: float | None = None) -> Delta:
        return self._queue.get(timeout=timeout)
