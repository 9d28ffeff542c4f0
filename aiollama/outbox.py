"""What one step produced for each consumer, delivered in one hop per event loop.

Pure: it only calls :meth:`~aiollama.boundary.Portal.send`, which never blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiollama.boundary import Item, Portal, Sink


@dataclass(frozen=True)
class _Dispatch:
    """Runs in the consumer's context: hands each item to its sink, in order."""

    items: list[tuple[Sink, Item]]

    def __call__(self) -> None:
        for sink, item in self.items:
            sink.deliver(item)


class Outbox:
    def __init__(self) -> None:
        self._out: dict[Portal, list[tuple[Sink, Item]]] = {}

    def emit(self, sink: Sink, item: Item) -> None:
        self._out.setdefault(sink.portal, []).append((sink, item))

    def flush(self) -> list[Portal]:
        """Send everything emitted since the last flush; return the portals nobody listens to any
        more (their event loop has closed)."""
        out, self._out = self._out, {}
        return [portal for portal, items in out.items() if not portal.send(_Dispatch(items))]

    def discard(self, portal: Portal) -> None:
        """Drop what is waiting for ``portal``."""
        self._out.pop(portal, None)
