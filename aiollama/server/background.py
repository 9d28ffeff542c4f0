"""Background responses (``background: true`` on ``/v1/responses``): generations that run detached
from the connection that asked for them, and whose events a client can rejoin.

A run keeps every event it sent, numbered as its ``sequence_number`` (the i-th event is number i),
until it ends and its time to live passes; at most ``max_events`` of them (past that the run is
cancelled: a reply that long is not kept whole). A client follows a run from any point
(``GET /v1/responses/{id}?stream=true&starting_after=N``: the events after N, then live ones as
they come), polls it (``GET /v1/responses/{id}``: the response as it stands), or cancels it
(``POST /v1/responses/{id}/cancel``). A client that goes away leaves the run going.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

MAX_EVENTS = 100_000


@dataclass
class Run:
    """One background response: its events so far, and the response as it stands."""

    id: str
    response: dict[str, Any]
    events: list[str] = field(default_factory=list)
    done: bool = False
    expires: float = float("inf")
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    changed: anyio.Event = field(default_factory=anyio.Event)

    def add(self, event: str) -> None:
        self.events.append(event)
        if '"response": {' in event:  # response.created, .in_progress, .completed...: the response as it stands
            payload = json.loads(event.split("data: ", 1)[1])
            if isinstance(payload.get("response"), dict):
                self.response = payload["response"]
        self._wake()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


class Runs:
    """The background responses of one app, each kept until it ends plus ``ttl`` seconds."""

    def __init__(self, ttl: float, max_events: int = MAX_EVENTS, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.max_events, self._clock = ttl, max_events, clock
        self.items: dict[str, Run] = {}

    def start(self, tg: anyio.abc.TaskGroup, run: Run, events: AsyncIterator[str]) -> None:
        """Drive ``events`` (the run's server-sent events) to their end, detached from any request."""
        self.sweep()
        self.items[run.id] = run
        tg.start_soon(self._drive, run, events)

    async def _drive(self, run: Run, events: AsyncIterator[str]) -> None:
        try:
            with run.scope:
                async for event in events:
                    run.add(event)
                    if len(run.events) >= self.max_events:
                        run.scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()  # type: ignore[attr-defined]
            if run.scope.cancel_called:
                run.response = {**run.response, "status": "cancelled"}
            run.done, run.expires = True, self._clock() + self.ttl
            run._wake()

    def get(self, run_id: str) -> Run | None:
        self.sweep()
        return self.items.get(run_id)

    def cancel(self, run_id: str) -> Run | None:
        run = self.get(run_id)
        if run is not None and not run.done:
            run.scope.cancel()
        return run

    async def follow(self, run: Run, after: int) -> AsyncIterator[str]:
        """The run's events after number ``after``, then the live ones until it ends."""
        at = max(0, after + 1)
        while True:
            changed = run.changed
            while at < len(run.events):
                yield run.events[at]
                at += 1
            if run.done:
                return
            await changed.wait()

    def sweep(self) -> None:
        now = self._clock()
        for run_id in [r for r, run in self.items.items() if run.done and run.expires <= now]:
            del self.items[run_id]

    def close(self) -> None:
        for run in self.items.values():
            run.scope.cancel()
