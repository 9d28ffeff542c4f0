"""The responses a server keeps for ``previous_response_id``, each with its live conversation (and,
with a database, on disk: :mod:`aiollama.server.response_db`).

A stored conversation holds more than its JSON: the KV cells of its tokens (or, parked, as many
bytes in host memory) and the embedding rows of its pictures. The store counts all of it against
its byte budget, drops the oldest past its count or its bytes, and drops expired ones at once (a
sweep every second, and at every use), not only when someone asks for them. A dropped response's
conversation is closed: its cells go back to the engine (kept only as evictable prefix cache).

With a database, every stored response is also written there with its history (its tokens and
chat, no KV cells), off the event loop; one that is no longer in memory (dropped, or from before a
restart, or stored by another replica of the same file) is brought back from it: its conversation
restored in the engine and its tokens evaluated again, or found in the prefix cache.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from aiollama import Conversation, Engine
from aiollama.errors import AiollamaError, ConversationFileError
from aiollama.server.response_db import ResponseDB

SWEEP_SECONDS = 1.0


@dataclass
class Stored:
    response: dict[str, Any]
    conv: Conversation
    expires: float
    size: int


@dataclass(frozen=True)
class Sizing:
    """What a stored conversation costs: bytes per KV cell (a token's keys and values in every
    layer) and per picture row (an embedding the projector made, kept to evaluate it again)."""

    cell_bytes: int = 0
    row_bytes: int = 0

    @classmethod
    def of(cls, model_info: Mapping[str, Any]) -> Sizing:
        return cls(int(model_info.get("kv_bytes_per_cell", 0)), 4 * int(model_info.get("n_embd", 0)))

    def of_conversation(self, tokens: tuple[int, ...]) -> int:
        pictures = sum(1 for t in tokens if t < 0)  # a picture's rows stand in the history as negative ids
        return len(tokens) * self.cell_bytes + pictures * self.row_bytes


class ResponseStore:
    """Responses by id, oldest first out past ``max_items`` or ``max_bytes``, or ``ttl`` seconds
    after they were stored. ``clock`` is for tests."""

    def __init__(self, max_items: int = 256, ttl: float = 3600.0, max_bytes: int = 256 << 20,
                 clock: Callable[[], float] = time.monotonic, db: ResponseDB | None = None) -> None:
        if max_items < 0 or ttl <= 0 or max_bytes < 0:
            raise ValueError("the response store needs max_items >= 0, ttl > 0 and max_bytes >= 0")
        self.max_items, self.ttl, self.max_bytes = max_items, ttl, max_bytes
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.size = 0
        self.sizing = Sizing()
        self.dropped = {"count": 0, "bytes": 0, "expired": 0}  # why responses went
        self._clock = clock
        self.db = db

    def put(self, response: dict[str, Any], conv: Conversation) -> None:
        """Keep ``response`` and its conversation (closed at once where nothing may be kept)."""
        self.sweep()
        size = len(json.dumps(response)) + self.sizing.of_conversation(conv.tokens)
        if self.max_items == 0 or size > self.max_bytes:
            conv.close_nowait()
            return
        self.items[response["id"]] = Stored(response, conv, self._clock() + self.ttl, size)
        self.size += size
        while len(self.items) > self.max_items:
            self._drop(next(iter(self.items)), "count")
        while self.size > self.max_bytes:
            self._drop(next(iter(self.items)), "bytes")

    async def keep(self, response: dict[str, Any], conv: Conversation) -> None:
        """:meth:`put`, and with a database its history on disk too (a response too large for the
        database, or one its conversation cannot be read for, stays in memory only)."""
        if self.db is not None and self.max_items:
            try:
                history = await conv.snapshot(cells=False)
            except AiollamaError:  # the engine is closing: it stays in memory only, for as long as that lasts
                history = None
            if history is not None:
                await anyio.to_thread.run_sync(self.db.put, response["id"], json.dumps(response), history)
        self.put(response, conv)

    def get(self, response_id: str) -> Stored | None:
        self.sweep()
        return self.items.get(response_id)

    async def response(self, response_id: str) -> dict[str, Any] | None:
        """A stored response's JSON: in memory, else in the database."""
        stored = self.get(response_id)
        if stored is not None:
            return stored.response
        found = await self._from_db(response_id)
        return None if found is None else dict(json.loads(found[0]))

    async def restore(self, response_id: str, engine: Engine) -> Stored | None:
        """A stored response with its conversation: in memory, else brought back from the database
        into ``engine`` (a history saved from another model is not found)."""
        stored = self.get(response_id)
        found = None if stored is not None else await self._from_db(response_id)
        if found is None:
            return stored
        try:
            conv = await engine.restore(found[1])
        except ConversationFileError:  # another model's, or damaged: not this server's to go on from
            return None
        self.put(json.loads(found[0]), conv)
        return self.get(response_id)

    async def _from_db(self, response_id: str) -> tuple[str, bytes] | None:
        return None if self.db is None else await anyio.to_thread.run_sync(self.db.get, response_id)

    async def delete(self, response_id: str) -> bool:
        on_disk = self.db is not None and await anyio.to_thread.run_sync(self.db.delete, response_id)
        if self.get(response_id) is None:
            return on_disk
        self._drop(response_id)
        return True

    def sweep(self) -> int:
        """Drop every expired response now; how many went. Entries expire in the order they were
        stored (one ``ttl`` for all), so only the oldest are looked at."""
        now, n = self._clock(), 0
        while self.items:
            response_id, stored = next(iter(self.items.items()))
            if stored.expires > now:
                break
            self._drop(response_id, "expired")
            n += 1
        return n

    def _drop(self, response_id: str, why: str | None = None) -> None:
        stored = self.items.pop(response_id)
        self.size -= stored.size
        if why is not None:
            self.dropped[why] += 1
        stored.conv.close_nowait()

    def close(self) -> None:
        for response_id in list(self.items):
            self._drop(response_id)
