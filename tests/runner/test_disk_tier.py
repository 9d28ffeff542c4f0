"""The prefix cache's disk tier through the engine: a closed conversation's prefix survives a
restart and comes back instead of being evaluated, for a transformer and a hybrid model, with the
greedy tokens of a fresh evaluation; a bad file is evaluated past; engines share a directory; the
directory keeps to its bytes; ``clear_cache`` empties it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from tiny_model import lfm2_model

import aiollama
from aiollama import Engine, InvalidRequestError
from aiollama.formats.kvfile import SUFFIX

PROMPT = "The lighthouse keeper wrote in the log every night. " * 12
ONE = dict(temperature=0.0, ignore_eos=True, max_tokens=6)


async def ask(path: Path, prompt: str | list[int], disk: Path | None, **options: Any) -> tuple[list[int], Any, Any]:
    """One greedy answer on an engine of its own: its tokens, its stats, and the engine's."""
    return (await history_of(path, prompt, disk, **options))[:3]


async def history_of(path: Path, prompt: str | list[int], disk: Path | None,
                     **options: Any) -> tuple[list[int], Any, Any, list[int]]:
    extra = {} if disk is None else dict(cache_dir=disk, **options)
    async with Engine(path, n_ctx=1024, n_seq_max=2, **extra) as engine:
        async with engine.conversation(prompt) as conv:
            out = await conv.stream(**ONE)
            history = list(conv.tokens)
        return out.tokens, out.stats, engine.statistics(), history


def lfm2_path(smollm2_path: Path) -> Path:
    return lfm2_model(aiollama.cache_dir() / "test-models", smollm2_path)


def files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == SUFFIX)


@pytest.mark.anyio
@pytest.mark.parametrize("model", ["llama", "lfm2"])
async def test_a_prefix_survives_a_restart(model: str, tiny_path: Path, smollm2_path: Path, tmp_path: Path) -> None:
    path = tiny_path if model == "llama" else lfm2_path(smollm2_path)
    first, stats, _, history = await history_of(path, PROMPT, tmp_path)
    assert stats.cached_tokens == 0 and len(files(tmp_path)) == 1
    # the history closed (prompt and answer) is on disk: a prompt that goes on from it reads it back
    follow_up = history + history[5:25]
    fresh, _, _ = await ask(path, follow_up, None)
    again, stats, engine_stats = await ask(path, follow_up, tmp_path)
    assert again == fresh
    assert engine_stats.disk_loads == 1 and stats.cached_tokens >= len(history) - 1
    if model == "llama":  # a transformer's state is cut to any prefix: the same prompt asked again
        same, stats, engine_stats = await ask(path, PROMPT, tmp_path)
        assert same == first and engine_stats.disk_loads == 1 and stats.cached_tokens > 100


@pytest.mark.anyio
async def test_a_damaged_file_is_evaluated_past_and_removed(tiny_path: Path, tmp_path: Path) -> None:
    first, _, _ = await ask(tiny_path, PROMPT, tmp_path)
    [path] = files(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-50] ^= 0xFF
    path.write_bytes(bytes(raw))
    again, stats, engine_stats = await ask(tiny_path, PROMPT, tmp_path)
    assert again == first and engine_stats.disk_loads == 0 and stats.cached_tokens == 0
    assert [p.name for p in files(tmp_path)] == [path.name]  # removed, then written again at the close
    assert path.read_bytes() != bytes(raw)


@pytest.mark.anyio
async def test_two_engines_share_a_directory(tiny_path: Path, tmp_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=1024, n_seq_max=2, cache_dir=tmp_path) as reader:
        first, _, _ = await ask(tiny_path, PROMPT, tmp_path)  # another engine writes it meanwhile
        with anyio.fail_after(20):
            while reader.statistics().disk_entries == 0:  # published with each step: prompt a step
                async with reader.conversation("x") as probe:
                    await probe.stream(max_tokens=1)
                await anyio.sleep(0.2)
        async with reader.conversation(PROMPT) as conv:
            out = await conv.stream(**ONE)
        assert out.tokens == first and reader.statistics().disk_loads == 1


@pytest.mark.anyio
async def test_the_directory_keeps_to_its_bytes(tiny_path: Path, tmp_path: Path) -> None:
    await ask(tiny_path, PROMPT, tmp_path)
    one = files(tmp_path)[0].stat().st_size
    budget = int(2.5 * one)
    for i in range(4):
        await ask(tiny_path, f"{i} " + PROMPT, tmp_path, cache_disk_bytes=budget)
    sizes = [p.stat().st_size for p in files(tmp_path)]
    assert len(sizes) == 2 and sum(sizes) <= budget


@pytest.mark.anyio
async def test_clear_cache_empties_the_directory(tiny_path: Path, tmp_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=1024, n_seq_max=2, cache_dir=tmp_path) as engine:
        async with engine.conversation(PROMPT) as conv:
            await conv.stream(**ONE)
        with anyio.fail_after(20):
            while not files(tmp_path):
                await anyio.sleep(0.02)
        await engine.clear_cache()
        deadline = time.monotonic() + 20
        while files(tmp_path):
            assert time.monotonic() < deadline
            await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_bad_disk_settings(tiny_path: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="cache_dir"):
        Engine(tiny_path, cache_dir=42)
    with pytest.raises(InvalidRequestError, match="cache_disk_bytes"):
        Engine(tiny_path, cache_dir=tmp_path, cache_disk_bytes=0)
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory")
    with pytest.raises(InvalidRequestError, match="cache_dir"):
        async with Engine(tiny_path, cache_dir=blocker / "cache"):
            pass
