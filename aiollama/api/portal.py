"""How the decode thread reaches consumers: one non-blocking hop into their event loop.

The decode thread only calls ``Portal.send`` (through the outbox), ``Portal.wake`` and
``Portal.after_delivery``. What it sends to an event loop waits in the portal until a wake, which
the decode thread gives as its next ``llama_decode`` starts (or at once when nothing decodes), so
that consumers run while the decode computes. It waits for a consumer in one case only, and for
at most ``HAND_OVER_SECONDS`` (:mod:`aiollama.core.engine_core`): when every generation has just
got its first token, so that no stream waits on it (see :func:`aiollama.core.outbox.hand_over`).

A wake goes through the event loop's own thread-safe channel (``call_soon_threadsafe`` on asyncio,
``TrioToken.run_sync_soon`` on trio): it cannot be lost to anything else in the application. A
descriptor of our own registered with ``loop.add_reader`` can: asyncio keys readers by descriptor
number, so a transport that the application abandoned, whose socket was closed behind its back,
removes "its" reader by number when it is finally closed, and takes with it the registration of
whatever descriptor reused that number.

Liveness: a reader waiting for an engine that has stopped without answering is answered all the
same. Each portal looks at its waiting readers every ``LIVENESS_SECONDS`` (one timer per event loop,
armed only while someone waits; a plain thread's reader waits through the blocking portal's loop,
so the same holds); a reader whose engine has ended gets that engine's error instead of waiting
forever.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import sniffio

from aiollama.core.commands import Portal
from aiollama.core.outputs import Delta, Item
from aiollama.errors import WrongEventLoop

# A trio run leaves its token behind when it ends; forget the portals of old runs now and then
# (a process rarely runs many trio loops, and a forgotten portal is only a small object).
MAX_TRIO_PORTALS = 64
# How often a waiting reader's engine is looked at: a reader of an engine that ended without
# answering it learns so within this time.
LIVENESS_SECONDS = 1.0

# None while the engine can still answer; otherwise the error a waiting reader gets.
Failure = Callable[[], BaseException | None]


class _Posted:
    """Callbacks the decode thread posted for one event loop, run there in order by ``run``.

    ``arm`` tells the decode thread whether the loop must be asked to run them: once per batch of
    posts, however many arrive before the loop gets to them."""

    def __init__(self) -> None:
        self._items: deque[Callable[[], None]] = deque()
        self._armed = False

    def post(self, callback: Callable[[], None]) -> None:
        self._items.append(callback)  # deque.append is atomic: the loop may be running callbacks

    def arm(self) -> bool:
        """On the decode thread: True if the loop must now be asked to run what was posted."""
        if self._armed or not self._items:
            return False
        self._armed = True
        return True

    def disarm(self) -> None:
        self._armed = False

    def run(self) -> None:
        """On the loop: run everything posted, in order. Disarmed first, so that a post arriving
        while this runs either is run here or arms the next run."""
        self._armed = False
        items = self._items
        while items:
            items.popleft()()


class _Watch:
    """The readers of one event loop that wait on an engine, looked at every ``LIVENESS_SECONDS``."""

    def __init__(self) -> None:
        self.waiting: set[AsyncSink] = set()

    def check(self) -> None:
        for sink in list(self.waiting):
            sink.check()


class AsyncioPortal:
    """Delivers into an asyncio loop (any implementation: selector, proactor, uvloop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._posted = _Posted()
        self._watch = _Watch()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def owner(self) -> asyncio.AbstractEventLoop | None:
        return self._loop()

    def send(self, callback: Callable[[], None]) -> bool:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return False  # nobody is listening any more
        self._posted.post(callback)
        return True

    def after_delivery(self, callback: Callable[[], None]) -> bool:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return False
        def queue() -> None:  # behind the tasks that the delivery wakes: it runs after their turn
            loop.call_soon(callback)
        self._posted.post(queue)
        return True

    def wake(self) -> None:
        if not self._posted.arm():
            return
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._posted.run)
        except RuntimeError:  # closed: the next send says so
            self._posted.disarm()

    def waiting(self, sink: AsyncSink, waits: bool) -> None:
        """On the loop: ``sink`` starts (or stops) waiting on its engine."""
        if not waits:
            self._watch.waiting.discard(sink)
            return
        self._watch.waiting.add(sink)
        if self._timer is None:
            loop = self._loop()
            if loop is not None:
                self._timer = loop.call_later(LIVENESS_SECONDS, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._posted.run()  # whatever arrived is delivered before anyone is told the engine ended
        self._watch.check()
        if self._watch.waiting:
            loop = self._loop()
            if loop is not None:
                self._timer = loop.call_later(LIVENESS_SECONDS, self._tick)


class TrioPortal:
    """Delivers into a trio run."""

    def __init__(self, token: Any) -> None:
        import trio

        self.owner = token
        self._posted = _Posted()
        self._watch = _Watch()
        self._done = False
        trio.lowlevel.spawn_system_task(self._look, name="aiollama-liveness")

    async def _look(self) -> None:
        import trio

        try:
            while True:
                await trio.sleep(LIVENESS_SECONDS)
                if self._watch.waiting:
                    self._posted.run()
                    self._watch.check()
        finally:
            self._done = True

    def send(self, callback: Callable[[], None]) -> bool:
        if self._done:
            return False  # the run has ended
        self._posted.post(callback)
        return True

    def after_delivery(self, callback: Callable[[], None]) -> bool:
        # trio runs the tasks a delivery wakes in its next batch, beside its queue of callbacks in
        # an order of its own: the callback goes two batches later, after theirs
        token = self.owner

        def later(batches: int) -> None:
            if batches:
                token.run_sync_soon(lambda: later(batches - 1))
            else:
                callback()
        return self.send(lambda: later(2))

    def wake(self) -> None:
        import trio

        if not self._posted.arm():
            return
        try:
            self.owner.run_sync_soon(self._posted.run)
        except trio.RunFinishedError:
            self._done = True
            self._posted.disarm()

    def waiting(self, sink: AsyncSink, waits: bool) -> None:
        if waits:
            self._watch.waiting.add(sink)
        else:
            self._watch.waiting.discard(sink)


_asyncio_portals: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncioPortal] = weakref.WeakKeyDictionary()
_trio_portals: dict[Any, TrioPortal] = {}


def current_portal() -> AsyncioPortal | TrioPortal:
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
    conversation keeps its history with it). ``failure`` says whether the engine can still answer
    (None) or what a waiting reader gets instead. On asyncio a waiting reader waits on a plain
    future (a step wakes every stream, so this is the consumer's hot path); on trio on an event.
    """

    def __init__(self, portal: AsyncioPortal | TrioPortal, on_item: Callable[[Item], None] | None = None,
                 failure: Failure | None = None) -> None:
        self.portal: Portal = portal
        self._portal = portal
        self._on_item = on_item
        self._failure = failure
        self._items: deque[Item] = deque()
        self._asyncio = isinstance(portal, AsyncioPortal)
        # the readers waiting: a future each on asyncio (one reader's cancellation cancels its
        # own), or one anyio event on trio
        self._futures: list[asyncio.Future[None]] = []
        self._event: anyio.Event | None = None
        self._ended = False  # the item that ends a stream (its last delta, or an error) has come
        self._end_only = False  # a reader waits for that item alone

    def deliver(self, item: Item) -> None:
        if self._on_item is not None:
            self._on_item(item)
        self._items.append(item)
        if isinstance(item, Delta) and (item.finish_reason is not None or item.error is not None):
            self._ended = True
        elif self._end_only:
            return  # the reader sleeps on: one wake-up for a whole generation
        if self._futures:
            futures, self._futures = self._futures, []
            for future in futures:
                if not future.done():  # a cancelled reader's future is done
                    future.set_result(None)
        elif self._event is not None:
            self._event.set()
            self._event = None

    def check(self) -> None:
        """On the loop, for a waiting reader: if the engine has ended, answer with its error."""
        error = self._failure() if self._failure is not None else None
        if error is not None and not self._ended:
            self.deliver(Delta(error=error))

    def get_nowait(self) -> Item | None:
        """An item already delivered, or None."""
        return self._items.popleft() if self._items else None

    async def get(self) -> Item:
        if not self._items:
            await self._wait(lambda: bool(self._items))
        return self._items.popleft()

    async def wait_end(self) -> None:
        """Wait until the item that ends the stream has been delivered, woken once for it rather
        than at every step as ``get`` is; the items stay to be taken."""
        if self._ended:
            return
        self._end_only = True
        try:
            await self._wait(lambda: self._ended)
        finally:
            self._end_only = False

    async def _wait(self, done: Callable[[], bool]) -> None:
        watched = self._failure is not None
        if watched:
            self._portal.waiting(self, True)
        try:
            while not done():
                if self._asyncio:
                    future = asyncio.get_running_loop().create_future()
                    self._futures.append(future)
                    await future
                else:
                    if self._event is None:
                        self._event = anyio.Event()
                    await self._event.wait()
        finally:
            if watched:
                self._portal.waiting(self, False)
