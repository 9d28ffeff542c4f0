"""Stored responses on disk (``serve --responses-db PATH``): each response's JSON and its
conversation's history (``Conversation.snapshot(cells=False)``: its tokens and chat, no KV cells),
in an SQLite file, so that ``previous_response_id`` goes on after a restart.

SQLite is embedded: nothing to run beside the server. Several processes may share one file
(replicas on one host): each call opens its own connection, writes are transactions, and the
journal is write-ahead, so readers never wait for a writer. The store's bounds hold on disk as in
memory: at most ``max_items`` responses, ``max_bytes`` of them (JSON and history), none older than
``ttl`` seconds (wall-clock time, which a restart does not reset); the oldest go first.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    stored REAL NOT NULL,
    response TEXT NOT NULL,
    history BLOB NOT NULL,
    size INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (stored);
"""


class ResponseDB:
    """The responses of an SQLite file at ``path`` (made if missing)."""

    def __init__(self, path: str | os.PathLike[str], *, max_items: int, ttl: float, max_bytes: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.path, self.max_items, self.ttl, self.max_bytes, self._clock = os.fspath(path), max_items, ttl, max_bytes, clock
        with self._connect() as db:
            db.executescript(SCHEMA)

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30.0)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            with db:  # one transaction
                yield db
        finally:
            db.close()

    def put(self, response_id: str, response: str, history: bytes) -> None:
        """Keep a response (its JSON text) and its history; then the oldest go past the bounds."""
        size = len(response) + len(history)
        with self._connect() as db:
            if size <= self.max_bytes and self.max_items > 0:
                db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                           (response_id, self._clock(), response, history, size))
            self._bound(db)

    def get(self, response_id: str) -> tuple[str, bytes] | None:
        """A response's JSON text and history, unless it is gone or expired."""
        with self._connect() as db:
            row = db.execute("SELECT response, history FROM responses WHERE id = ? AND stored > ?",
                             (response_id, self._clock() - self.ttl)).fetchone()
        return None if row is None else (str(row[0]), bytes(row[1]))

    def delete(self, response_id: str) -> bool:
        with self._connect() as db:
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def count(self) -> tuple[int, int]:
        """(responses, bytes) kept."""
        with self._connect() as db:
            n, size = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
        return int(n), int(size)

    def _bound(self, db: sqlite3.Connection) -> None:
        db.execute("DELETE FROM responses WHERE stored <= ?", (self._clock() - self.ttl,))
        db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY stored DESC LIMIT -1 OFFSET ?)",
                   (self.max_items,))
        total = db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0]
        if total > self.max_bytes:
            oldest: list[Any] = db.execute("SELECT id, size FROM responses ORDER BY stored").fetchall()
            gone = []
            for response_id, size in oldest:
                if total <= self.max_bytes:
                    break
                gone.append((response_id,))
                total -= size
            db.executemany("DELETE FROM responses WHERE id = ?", gone)
