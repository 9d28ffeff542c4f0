"""A set of models in one process: each opened on first use, the least recently used idle one
closed to make room, idle ones closed after their keep_alive, and none closed under its users."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from tiny_model import bert_model, rerank_model

import aiollama
from aiollama import Engine, ModelBusy, ModelEntry, ModelNotLoaded, ModelSet, Overloaded, UnknownModel, models_in

pytestmark = pytest.mark.anyio

SMALL = {"n_ctx": 512, "n_seq_max": 2}


@pytest.fixture(scope="module")
def entries(tiny_path: Path, smollm2_path: Path) -> list[ModelEntry]:
    cache = aiollama.cache_dir() / "test-models"
    return [ModelEntry("chat", tiny_path, SMALL, aliases=("tiny",)),
            ModelEntry("embed", bert_model(cache, smollm2_path), {}),
            ModelEntry("rerank", rerank_model(cache, smollm2_path), {})]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def counting(opened: list[str]) -> Any:
    def opener(entry: ModelEntry) -> Engine:
        opened.append(entry.name)
        return Engine(entry.path, **entry.options)
    return opener


async def test_three_kinds_by_name_each_loaded_on_first_use(entries: list[ModelEntry]) -> None:
    async with ModelSet(entries) as models:
        assert [s.state for s in models.status()] == ["unloaded"] * 3
        async with models.use("tiny") as engine:  # an alias
            reply = await engine.conversation("Hello").stream(max_tokens=4, temperature=0.0)
            assert reply.finish_reason is not None
        async with models.use("embed") as engine:
            [vector] = await engine.embed("a cat")
            assert len(vector) == 64
        async with models.use("rerank") as engine:
            scores = await engine.rerank("a cat", ["a cat sat", "taxes"])
            assert len(scores) == 2 and scores[0] != scores[1]
        status = {s.name: s for s in models.status()}
        assert {n: (s.state, s.kind) for n, s in status.items()} == {
            "chat": ("loaded", "chat"), "embed": ("loaded", "embedding"), "rerank": ("loaded", "rerank")}
        assert all(s.load_seconds is not None and s.bytes > 0 for s in status.values())
        with pytest.raises(UnknownModel):
            models.entry("nope")
        with pytest.raises(InvalidRequestErrorLike):
            await models.loaded("chat").rerank("q", ["d"])  # type: ignore[union-attr]


InvalidRequestErrorLike = aiollama.InvalidRequestError


async def test_past_the_count_limit_the_least_recently_used_idle_model_goes(entries: list[ModelEntry]) -> None:
    async with ModelSet(entries, max_loaded=2) as models:
        await models.load("chat")
        await models.load("embed")
        async with models.use("chat"):
            pass  # chat is now the most recently used
        await models.load("rerank")
        assert {s.name: s.state for s in models.status()} == {
            "chat": "loaded", "embed": "unloaded", "rerank": "loaded"}


async def test_an_idle_model_closes_after_its_keep_alive_and_a_busy_one_does_not(entries: list[ModelEntry]) -> None:
    async with ModelSet(entries, keep_alive=0.2) as models:
        async with models.use("embed"):
            pass
        async with models.use("chat") as engine:
            conv = engine.conversation("Once upon a time")
            stream = conv.stream(max_tokens=400, temperature=0.0, ignore_eos=True)
            await anyio.sleep(1.0)  # a use and a running stream hold it past its keep_alive
            assert models.loaded("chat") is engine
            await stream
        await anyio.sleep(1.0)
        assert models.loaded("embed") is None
        assert models.loaded("chat") is engine  # the open conversation holds it
        await conv.aclose()
        deadline = time.monotonic() + 5
        while models.loaded("chat") is not None and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        assert models.loaded("chat") is None and not engine.serving


async def test_a_model_in_use_is_never_closed_to_make_room(entries: list[ModelEntry]) -> None:
    async with ModelSet(entries, max_loaded=1) as models:
        async with models.use("chat") as engine:
            with pytest.raises(Overloaded):
                await models.load("embed")
            assert engine.serving
        assert (await models.load("embed")).serving and models.loaded("chat") is None


async def test_concurrent_first_uses_load_the_model_once(entries: list[ModelEntry]) -> None:
    opened: list[str] = []
    got: list[Engine] = []
    async with ModelSet(entries, opener=counting(opened)) as models:
        async def one() -> None:
            async with models.use("chat") as engine:
                got.append(engine)
        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(one)
    assert opened == ["chat"] and len(got) == 6 and all(e is got[0] for e in got)


async def test_unloading_waits_for_conversations_or_refuses(entries: list[ModelEntry]) -> None:
    async with ModelSet(entries, autoload=False) as models:
        with pytest.raises(ModelNotLoaded):
            async with models.use("chat"):
                pass
        engine = await models.load("chat")
        conv = engine.conversation("Hi")
        with pytest.raises(ModelBusy):
            await models.unload("chat", wait=False)
        assert engine.serving
        async with anyio.create_task_group() as tg:
            async def close_later() -> None:
                await anyio.sleep(0.3)
                await conv.aclose()
            tg.start_soon(close_later)
            assert await models.unload("chat")  # waits for the conversation
        assert not engine.serving and not await models.unload("chat")


def test_a_models_folder_names_each_model_by_its_file(tmp_path: Path, entries: list[ModelEntry]) -> None:
    (tmp_path / "b.gguf").symlink_to(entries[1].path)
    (tmp_path / "a.gguf").symlink_to(entries[0].path)
    sub = tmp_path / "vision"
    sub.mkdir()
    (sub / "model-q4.gguf").symlink_to(entries[0].path)
    (sub / "mmproj-f16.gguf").symlink_to(entries[0].path)
    (tmp_path / "notes.txt").write_text("not a model")
    found = models_in(tmp_path, n_ctx=256)
    assert [(e.name, e.path.name, dict(e.options)) for e in found] == [
        ("a", "a.gguf", {"n_ctx": 256}), ("b", "b.gguf", {"n_ctx": 256}),
        ("vision", "model-q4.gguf", {"n_ctx": 256, "mmproj": sub / "mmproj-f16.gguf"})]
    with pytest.raises(ValueError):
        ModelSet([ModelEntry("a", entries[0].path), ModelEntry("b", entries[0].path, aliases=("a",))])


async def test_a_budget_per_device_closes_the_least_recently_used_to_make_room(entries: list[ModelEntry]) -> None:
    planned = {e.name: aiollama.plan(e.path, **e.options).by_device() for e in entries}
    assert all(set(p) == {"CPU"} for p in planned.values())  # this machine's tests have no GPU
    budget = {"CPU": planned["chat"]["CPU"] + planned["embed"]["CPU"] + 1}
    async with ModelSet(entries, memory_bytes=budget) as models:
        await models.load("chat")
        await models.load("embed")
        assert [s.state for s in models.status()] == ["loaded", "loaded", "unloaded"]
        assert {s.name: s.kind for s in models.status()}["rerank"] == "rerank"  # planned: known before it loads
        await models.load("rerank")
        assert [s.state for s in models.status()] == ["unloaded", "loaded", "loaded"]
    with pytest.raises(ValueError):
        ModelSet(entries, memory_bytes={"CPU": 0})


async def test_a_snapshot_without_cells_restores_to_the_same_continuation(entries: list[ModelEntry]) -> None:
    path = entries[0].path
    async with Engine(path, **SMALL) as engine:
        conv = engine.conversation()
        await conv.chat([{"role": "user", "content": "Tell me about the sea."}], max_tokens=8, temperature=0.0)
        whole, light = await conv.snapshot(), await conv.snapshot(cells=False)
        assert len(light) < len(whole) / 2
        expected = await conv.chat([{"role": "user", "content": "And the sky?"}], max_tokens=8, temperature=0.0)
        await conv.aclose()
    async with Engine(path, **SMALL) as fresh:  # a new engine: nothing cached
        again = await fresh.restore(light)
        assert again.tokens == conv.tokens[:len(again.tokens)]
        got = await again.chat([{"role": "user", "content": "And the sky?"}], max_tokens=8, temperature=0.0)
        assert got.text == expected.text and got.stats is not None and got.stats.cached_tokens == 0
        await again.aclose()
