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

from aiollama.boundary import Item, Portal
from aiollama.errors import WrongEventLoop

# A trio run leaves its token behind when it ends; forget the portals of old runs now and then
# (a process rarely runs many trio loops, and a forgotten portal is only a small object).
MAX_TRIO_PORTALS = 64


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
            if len(_trio_portals) > MAX_TRIO_PORTALS:
                _trio_portals.clear()
            trio_portal = _trio_portals[token] = TrioPortal(token)
        return trio_portal
    raise WrongEventLoop(f"aiollama supports asyncio and trio, not {library}")


class AsyncSink:
    """A stream's inbox on its event loop; ``deliver`` runs on that loop.

    ``on_item`` sees every item as it arrives, whether or not anyone reads the stream (the
    conversation keeps its history with it).
    """

    def __init__(self, portal: Portal, on_item: Callable[[Item], None] | None = None) -> None:
        self.portal = portal
        self._on_item = on_item
        self._items: deque[Item] = deque()
        self._event = anyio.Event()

    def deliver(self, item: Item) -> None:
        if self._on_item is not None:
            self._on_item(item)
        self._items.append(item)
        self._event.set()

    async def get(self) -> Item:
        while not self._items:
            if self._event.is_set():
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
