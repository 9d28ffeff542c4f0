"""What one step produced for each consumer, delivered in one hop per event loop.

It calls :meth:`~aiollama.boundary.Portal.send`, which never blocks, and writes one byte to the
wake descriptor of each portal that has one (see :func:`wake`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass

from aiollama.boundary import Item, Portal, Sink


@dataclass(frozen=True)
class _Dispatch:
    """Runs in the consumer's context: hands each item to its sink, in order."""

    items: list[tuple[Sink, Item]]

    def __call__(self) -> None:
        for sink, item in self.items:
            sink.deliver(item)


def wake_fds(fds: Iterable[int]) -> None:
    """Write a byte to each wake descriptor (a full pipe means that loop is awake already)."""
    for fd in fds:
        with contextlib.suppress(BlockingIOError):
            os.write(fd, b"\0")


def wake(portals: Iterable[Portal]) -> None:
    """Make these portals' event loops run what was sent to them."""
    wake_fds(p.wake_fd for p in portals if p.wake_fd is not None)


class Outbox:
    def __init__(self) -> None:
        self._out: dict[Portal, list[tuple[Sink, Item]]] = {}
        self._unwoken: dict[Portal, None] = {}  # sent to, not yet woken (ordered, no repeats)

    def emit(self, sink: Sink, item: Item) -> None:
        self._out.setdefault(sink.portal, []).append((sink, item))

    def flush(self) -> list[Portal]:
        """Send everything emitted since the last flush; return the portals nobody listens to any
        more (their event loop has closed). Portals with a wake descriptor still need
        :meth:`take_unwoken` and a wake."""
        out, self._out = self._out, {}
        dead = []
        for portal, items in out.items():
            if not portal.send(_Dispatch(items)):
                dead.append(portal)
            elif portal.wake_fd is not None:
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
