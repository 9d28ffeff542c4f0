"""What one step produced for each consumer, delivered in one hop per event loop.

It calls :meth:`~aiollama.core.commands.Portal.send`, which never blocks; what was sent runs in the
consumer's context once the portal is woken (see :func:`wake`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from aiollama.core.commands import Portal, Sink
from aiollama.core.outputs import Item


@dataclass(frozen=True)
class _Dispatch:
    """Runs in the consumer's context: hands each item to its sink, in order."""

    items: list[tuple[Sink, Item]]

    def __call__(self) -> None:
        for sink, item in self.items:
            sink.deliver(item)


def wake(portals: Iterable[Portal]) -> None:
    """Make these portals' event loops run what was sent to them (a portal already woken and not
    yet run is not asked twice)."""
    for portal in portals:
        portal.wake()


def hand_over(portals: Iterable[Portal], seconds: float) -> None:
    """Wake these portals and wait, at most ``seconds`` in all, until each has delivered what was
    sent to it and its consumers have had their turn.

    Why wait: on a host whose cores the decode's threads fill, an event loop woken as a decode
    starts queues behind them, and the kernel tends to let it wait out the decode's time slice (a
    few milliseconds) when the loop has just run a long burst, as it has when it started a request.
    The decode thread waiting here leaves its core to the loop instead."""
    portals = list(portals)
    delivered: list[threading.Event] = []
    for portal in portals:
        done = threading.Event()
        if portal.after_delivery(done.set):
            delivered.append(done)
    wake(portals)
    deadline = time.monotonic() + seconds
    for done in delivered:
        if not done.wait(max(0.0, deadline - time.monotonic())):
            return


class Outbox:
    def __init__(self) -> None:
        self._out: dict[Portal, list[tuple[Sink, Item]]] = {}
        self._unwoken: dict[Portal, None] = {}  # sent to, not yet woken (ordered, no repeats)

    def emit(self, sink: Sink, item: Item) -> None:
        self._out.setdefault(sink.portal, []).append((sink, item))

    def flush(self) -> list[Portal]:
        """Send everything emitted since the last flush; return the portals nobody listens to any
        more (their event loop has closed). The others still need :meth:`take_unwoken` and a
        wake."""
        out, self._out = self._out, {}
        dead = []
        for portal, items in out.items():
            if not portal.send(_Dispatch(items)):
                dead.append(portal)
            else:
                self._unwoken[portal] = None
        return dead

    def take_unwoken(self) -> list[Portal]:
        """The portals sent to since the last call, whose loops must now be woken."""
        out, self._unwoken = list(self._unwoken), {}
        return out

    def wake_all(self) -> None:
        """Wake every portal sent to (before the decode thread waits, or ends)."""
        wake(self.take_unwoken())

    def discard(self, portal: Portal) -> None:
        """Drop what is waiting for ``portal``."""
        self._out.pop(portal, None)
