"""5,000 conversations created, streamed and closed: across the second half the process's memory and
Python's object counts stay flat, and no ResourceWarning is raised."""

from __future__ import annotations

import gc
import sys
import tracemalloc
import warnings
from collections import Counter
from pathlib import Path

import anyio
import pytest
from helpers import GREEDY

from aiollama import Engine
from aiollama.native import open_handles

pytestmark = [pytest.mark.anyio, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for RSS")]

TOTAL = 5000
CONCURRENT = 16
RSS_GROWTH_LIMIT = 20 * 2**20
HOST_BUDGET = 256 * 2**10


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def object_counts() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.get_objects())


async def churn(engine: Engine, start: int, stop: int) -> None:
    """Conversations ``start..stop``, CONCURRENT at a time; a few are forked, a few cancelled."""

    async def one(i: int) -> None:
        async with engine.conversation(f"Conversation number {i} says") as conv:
            if i % 10 == 0:
                async with conv.fork() as child:
                    await child.stream(max_tokens=2, **GREEDY)
            stream = conv.stream(max_tokens=4, **GREEDY)
            if i % 7 == 0:
                async for _ in stream:
                    break  # dropped mid-generation
            else:
                assert len((await stream).tokens) == 4

    for base in range(start, stop, CONCURRENT):
        async with anyio.create_task_group() as tg:
            for i in range(base, min(base + CONCURRENT, stop)):
                tg.start_soon(one, i)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_5000_conversations_leak_nothing(tiny_path: Path) -> None:
    handles = open_handles()
    with warnings.catch_warnings(record=True) as caught, anyio.fail_after(600):
        warnings.simplefilter("always")
        # a host budget small enough to fill in the first half: the cache reaches its steady state
        async with Engine(tiny_path, n_ctx=2048, n_seq_max=CONCURRENT, n_batch=256,
                          host_cache_bytes=HOST_BUDGET) as engine:
            await churn(engine, 0, TOTAL // 2)
            mid_rss, mid_objects, mid_stats = rss(), object_counts(), engine.statistics()
            tracemalloc.start()
            traced_start = tracemalloc.get_traced_memory()[0]
            await churn(engine, TOTAL // 2, TOTAL)
            traced_growth = tracemalloc.get_traced_memory()[0] - traced_start
            tracemalloc.stop()
            end_rss, end_objects, end_stats = rss(), object_counts(), engine.statistics()
        gc.collect()
    growth = {k: n for k, n in (end_objects - mid_objects).items() if n > 0}
    report = (f"RSS {mid_rss / 2**20:.1f} -> {end_rss / 2**20:.1f} MiB, "
              f"traced Python memory +{traced_growth / 1024:.1f} KiB, "
              f"objects {sum(mid_objects.values())} -> {sum(end_objects.values())}, growth {growth}")
    print(report)
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert end_rss - mid_rss < RSS_GROWTH_LIMIT, report
    assert traced_growth < 2 * 2**20, report
    assert sum(growth.values()) < 200, report  # a few interpreter caches, not one per conversation
    assert (end_stats.live, end_stats.active, end_stats.queued) == (0, 0, 0)
    # what is left is the prefix cache, within its bounds
    assert end_stats.seq_ids_used == end_stats.cache_entries
    assert end_stats.kv_cells_used == end_stats.kv_cells_cached <= 2048
    assert end_stats.parked_bytes <= HOST_BUDGET
    assert end_stats.tokens_generated > mid_stats.tokens_generated
    assert open_handles() == handles
