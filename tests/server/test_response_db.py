"""Stored responses on disk: bounded as in memory, shared by processes, and continued after a
server restart from the history a previous process stored (its state read back from the disk tier)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from server_process import Server

from aiollama.server.response_db import ResponseDB

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_bounds_hold_on_disk(tmp_path: Path) -> None:
    clock = Clock()
    db = ResponseDB(tmp_path / "r.db", max_items=3, ttl=60, max_bytes=1000, clock=clock)
    for i in range(5):
        clock.now += 1
        db.put(f"r{i}", json.dumps({"id": f"r{i}"}), b"x" * 100)
    assert db.count()[0] == 3 and db.get("r0") is None and db.get("r4") == ('{"id": "r4"}', b"x" * 100)
    clock.now += 1
    db.put("big", "{}", b"y" * 700)  # 702 bytes: past 1,000 with the three others, so the oldest goes
    assert db.count() == (3, 702 + 2 * 112) and db.get("r2") is None and db.get("r3") is not None
    db.put("huge", "{}", b"z" * 2000)  # larger than the whole budget: not kept
    assert db.get("huge") is None
    clock.now += 61
    assert db.get("r4") is None  # expired, by wall-clock time
    db.put("new", "{}", b"")
    assert db.count()[0] == 1
    assert db.delete("new") and not db.delete("new")


def test_two_processes_share_one_file(tmp_path: Path) -> None:
    one = ResponseDB(tmp_path / "r.db", max_items=10, ttl=60, max_bytes=10_000)
    two = ResponseDB(tmp_path / "r.db", max_items=10, ttl=60, max_bytes=10_000)
    one.put("a", "{}", b"1")
    assert two.get("a") == ("{}", b"1")
    with sqlite3.connect(tmp_path / "r.db") as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_a_chain_goes_on_after_a_restart(tmp_path: Path, tiny_path: Path) -> None:
    options = ("--n-ctx", "4096", "--model-name", "tiny", "--log-level", "warning",
               "--responses-db", str(tmp_path / "responses.db"), "--cache-dir", str(tmp_path / "kv"))
    first = Server(tiny_path, *options)
    try:
        async with first.client() as c:
            one = await c.responses.create(model="tiny", input="Tell me about the sea.", max_output_tokens=8,
                                           temperature=0)
    finally:
        first.stop()
    second = Server(tiny_path, *options)  # a new process: nothing in memory
    try:
        async with second.client() as c:
            assert (await c.responses.retrieve(one.id)).output_text == one.output_text
            two = await c.responses.create(model="tiny", input="And the sky?", previous_response_id=one.id,
                                           max_output_tokens=8, temperature=0)
            assert two.usage.input_tokens > one.usage.input_tokens + one.usage.output_tokens
            # the first answer's state came back from the disk tier instead of being evaluated again
            assert two.usage.input_tokens_details.cached_tokens >= one.usage.input_tokens
            await c.responses.delete(one.id)
            with pytest.raises(Exception) as gone:
                await c.responses.retrieve(one.id)
            assert getattr(gone.value, "status_code", None) == 404
    finally:
        second.stop()
    # the same conversation in one process, for the answer a continuation must give
    fresh = Server(tiny_path, "--n-ctx", "4096", "--model-name", "tiny", "--log-level", "warning")
    try:
        async with fresh.client() as c:
            again = await c.responses.create(model="tiny", input="Tell me about the sea.", max_output_tokens=8,
                                             temperature=0)
            then = await c.responses.create(model="tiny", input="And the sky?", previous_response_id=again.id,
                                            max_output_tokens=8, temperature=0)
    finally:
        fresh.stop()
    assert again.output_text == one.output_text and then.output_text == two.output_text
