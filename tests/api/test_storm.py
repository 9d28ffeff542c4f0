"""A cancellation storm on the real engine: 500 streams cancelled at random points, then nothing
is left behind and the engine still answers correctly; on an attention model and on a hybrid one,
whose cancelled prefills go back to checkpoints of their recurrent state."""

from __future__ import annotations

import random
from pathlib import Path

import anyio
import pytest
from helpers import GREEDY
from tiny_model import lfm2_model

import aiollama
from aiollama import Engine

pytestmark = pytest.mark.anyio

N_STREAMS = 500


@pytest.mark.parametrize("model", ["llama", "lfm2"])
async def test_cancellation_storm(model: str, tiny_path: Path, smollm2_path: Path) -> None:
    rng = random.Random(1234)
    long_prompt = " ".join(["a prompt long enough to be chunked"] * 40)
    path = tiny_path if model == "llama" else lfm2_model(aiollama.cache_dir() / "test-models", smollm2_path)
    async with Engine(path, n_ctx=4096, n_seq_max=8, step_tokens=64, max_queued=N_STREAMS) as engine:
        probe = "The storm is over and the answer is"
        async with engine.conversation(probe) as conv:
            expected = (await conv.stream(max_tokens=8, **GREEDY)).tokens
        limit = anyio.Semaphore(64)

        async def one(i: int) -> None:
            mode = i % 5
            async with limit:
                conv = engine.conversation(long_prompt if mode == 1 else f"storm {i}: once upon a time")
                if mode == 0:  # before admission
                    stream = conv.stream(max_tokens=50, **GREEDY)
                    stream.cancel()
                    assert (await stream).finish_reason in ("cancelled", "length")
                elif mode == 1:  # mid-prefill
                    stream = conv.stream(max_tokens=50, **GREEDY)
                    await anyio.sleep(rng.random() * 0.01)
                    stream.cancel()
                    await stream
                elif mode == 2:  # mid-generation
                    k = rng.randint(1, 6)
                    async for _ in conv.stream(max_tokens=100, **GREEDY):
                        k -= 1
                        if k <= 0:
                            break
                elif mode == 3:  # during a fork
                    stream = conv.stream(max_tokens=30, **GREEDY)
                    child = conv.fork()
                    child_stream = child.stream(max_tokens=30, **GREEDY) if rng.random() < 0.5 else None
                    stream.cancel()
                    if child_stream is not None:
                        child_stream.cancel()
                        await child_stream
                    await stream
                    await child.aclose()
                else:  # a cancel racing with aclose
                    stream = conv.stream(max_tokens=50, **GREEDY)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(conv.aclose)
                        stream.cancel()
                    await stream
                await conv.aclose()

        with anyio.fail_after(600):
            async with anyio.create_task_group() as tg:
                for i in range(N_STREAMS):
                    tg.start_soon(one, i)
        stats = engine.statistics()
        print(stats)  # shown with pytest -s
        assert stats.tokens_generated > 100 and stats.decode_steps > 10, stats  # the storm did run
        assert (stats.active, stats.queued, stats.live) == (0, 0, 0), stats
        assert stats.kv_cells_used == stats.kv_cells_cached and stats.seq_ids_used == stats.cache_entries, stats
        await engine.clear_cache()
        stats = engine.statistics()
        assert stats.kv_cells_used == 0 and stats.seq_ids_used == 0 and stats.checkpoints == 0, stats
        async with engine.conversation(probe) as conv:
            assert (await conv.stream(max_tokens=8, **GREEDY)).tokens == expected
