"""Cache salts: conversations (and server requests) of different salts never share KV cells, cached
or live, nor states parked in host memory; those of one salt share as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_process import Server

from aiollama import Engine
from aiollama.errors import InvalidRequestError
from aiollama.sched.hostcache import HostCache
from aiollama.sched.kvtree import KVCells

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def test_the_tree_finds_a_prefix_only_under_its_salt() -> None:
    cells = KVCells(64)
    a = cells.extend(None, [1, 2, 3, 4], "a")
    plain = cells.extend(None, [1, 2, 3], None)
    assert cells.find([1, 2, 3, 4, 5], 5, "a") == (a, 4)
    assert cells.find([1, 2, 3, 4, 5], 5, "b") == (None, 0)
    assert cells.find([1, 2, 3, 4, 5], 5) == (plain, 3)
    shared = cells.share(a, 2)  # a fork of a salted holder stays under its salt
    assert shared is not None and shared.salt == "a"
    cells.release(a)
    cells.release(shared)
    assert "a" not in cells.roots and cells.used == 3


def test_parked_states_are_found_only_under_their_salt() -> None:
    host = HostCache(1 << 20)
    key = host.reserve([1, 2, 3, 4], 1, "a")
    host.fill(key, b"state")
    assert host.best([1, 2, 3, 4, 5], 5, "b") == (None, 0)
    assert host.best([1, 2, 3, 4, 5], 5) == (None, 0)
    parked, n = host.best([1, 2, 3, 4, 5], 5, "a")
    assert parked is not None and parked.key == key and n == 4
    host.discard(key)
    assert host.best([1, 2, 3, 4, 5], 5, "a") == (None, 0)


@pytest.mark.anyio
async def test_conversations_of_different_salts_share_no_cells(tiny_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=1024) as engine:
        async def cached(salt: str | None, close: bool = True) -> int:
            conv = engine.conversation(PROMPT, cache_salt=salt)
            result = await conv.stream(max_tokens=2, temperature=0)
            if close:
                await conv.aclose()
            assert result.stats is not None
            return result.stats.cached_tokens

        assert await cached("alice") == 0
        assert await cached("bob") == 0  # the same prompt, another salt: nothing found
        assert await cached(None) == 0
        assert await cached("alice") > 20  # the same salt: the prefix is found
        live = engine.conversation(PROMPT, cache_salt="carol")
        await live.stream(max_tokens=2, temperature=0)
        fork = live.fork()  # a fork keeps its parent's salt, and shares its cells
        again = await fork.stream(max_tokens=2, temperature=0)
        assert again.stats is not None and again.stats.cached_tokens > 20
        assert await cached("dave") == 0  # nor are a live conversation's cells shared across salts
        with pytest.raises(InvalidRequestError):
            engine.conversation(cache_salt=3)  # type: ignore[arg-type]


def test_salted_requests_share_no_cells_on_the_server(tiny_path: Path) -> None:
    server = Server(tiny_path, "--n-ctx", "4096", "--n-seq-max", "2", "--log-level", "warning", "--unified-cache")
    try:
        def cached(salt: str | None) -> int:
            body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                    **({"cache_salt": salt} if salt is not None else {})}
            status, _, answer = server.post("/v1/completions", json.dumps(body).encode())
            assert status == 200, answer
            return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert cached("tenant-1") == 0
        assert cached("tenant-2") == 0
        assert cached(None) == 0
        assert cached("tenant-1") > 20
        assert cached(None) > 20
        status, _, answer = server.post("/v1/completions", json.dumps({"prompt": "x", "cache_salt": 5}).encode())
        assert status == 400 and answer["error"]["param"] == "cache_salt"
    finally:
        server.stop()
