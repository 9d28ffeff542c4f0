"""The responses a server keeps for ``previous_response_id``, each with its live conversation."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from aiollama import Conversation


@dataclass
class Stored:
    response: dict[str, Any]
    conv: Conversation
    expires: float
    size: int


class ResponseStore:
    """Responses by id, oldest first out past ``max_items`` or ``max_bytes``, or after ``ttl`` s."""

    def __init__(self, max_items: int = 256, ttl: float = 3600.0, max_bytes: int = 256 << 20) -> None:
        self.max_items, self.ttl, self.max_bytes = max_items, ttl, max_bytes
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.size = 0

    def put(self, response: dict[str, Any], conv: Conversation) -> None:
        size = len(json.dumps(response)) + 4 * len(conv)
        self.items[response["id"]] = Stored(response, conv, time.monotonic() + self.ttl, size)
        self.size += size
        while self.items and (len(self.items) > self.max_items or self.size > self.max_bytes):
            self._drop(next(iter(self.items)))

    def get(self, response_id: str) -> Stored | None:
        stored = self.items.get(response_id)
        if stored is not None and stored.expires < time.monotonic():
            self._drop(response_id)
            return None
        return stored

    def delete(self, response_id: str) -> bool:
        if self.get(response_id) is None:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        stored = self.items.pop(response_id)
        self.size -= stored.size
        stored.conv.close_nowait()

    def close(self) -> None:
        for response_id in list(self.items):
            self._drop(response_id)
