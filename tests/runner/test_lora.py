"""LoRA adapters: an adapter written with gguf in llama.cpp's layout gives the logits of a model
whose weights have it merged in; the engine applies each conversation's adapters, keeps their
cached cells apart, and serves conversations of different adapters by turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from server_process import Server
from tiny_model import write_lora, write_tiny_model

from aiollama import Engine
from aiollama.errors import InvalidRequestError, ModelLoadError
from aiollama.native import Batch, Context, DecodeStatus, LoraAdapter, Model

TOKENS = [1, 504, 3426, 314, 3599, 284, 260, 2116]


@pytest.fixture(scope="module")
def adapter(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("lora") / "adapter.gguf"
    return path, write_lora(path, tiny_path)


@pytest.fixture(scope="module")
def merged(adapter: tuple[Path, dict[str, np.ndarray]], smollm2_path: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with the adapter merged in at scale 0.5."""
    path = tmp_path_factory.mktemp("merged") / "merged.gguf"
    return write_tiny_model(path, smollm2_path, deltas={k: 0.5 * v for k, v in adapter[1].items()})


def _logits(model_path: Path, lora: tuple[Path, float] | None = None) -> np.ndarray:
    with Model(model_path) as model, Context(model, n_ctx=256, n_seq_max=1) as ctx, Batch(64) as batch:
        adapter = LoraAdapter(model, lora[0]) if lora is not None else None
        try:
            if adapter is not None:
                ctx.set_adapters([(adapter, lora[1])])  # type: ignore[index]
            last = batch.add_tokens(TOKENS, 0, 0, output_last=True)
            assert ctx.decode(batch) is DecodeStatus.OK
            return np.frombuffer(ctx.logits_buffer(last), dtype=np.float32).copy()
        finally:
            ctx.close()
            if adapter is not None:
                adapter.close()


def test_an_adapter_gives_the_logits_of_its_merged_weights(
        tiny_path: Path, adapter: tuple[Path, dict[str, np.ndarray]], merged: Path) -> None:
    base, with_adapter, want = _logits(tiny_path), _logits(tiny_path, (adapter[0], 0.5)), _logits(merged)
    assert np.abs(with_adapter - want).max() < 1e-3 * max(1.0, float(np.abs(want).max()))
    assert np.abs(base - want).max() > 0.1  # the adapter changes the answer


def test_a_file_that_is_no_adapter_is_refused(tiny_path: Path) -> None:
    with Model(tiny_path) as model:
        with pytest.raises(ModelLoadError, match="LoRA"):
            LoraAdapter(model, tiny_path)  # a model, not an adapter


async def _greedy(engine: Engine, **options: Any) -> tuple[list[int], int]:
    conv = engine.conversation(TOKENS, **options)
    result = await conv.stream(max_tokens=6, temperature=0)
    await conv.aclose()
    assert result.stats is not None
    return result.tokens, result.stats.cached_tokens


@pytest.mark.anyio
async def test_conversations_choose_their_adapters_and_take_turns(
        tiny_path: Path, adapter: tuple[Path, dict[str, np.ndarray]], merged: Path) -> None:
    async with Engine(merged, n_ctx=512) as engine:
        want_merged, _ = await _greedy(engine)
    async with Engine(tiny_path, n_ctx=512, lora={"a": adapter[0]}) as engine:
        want_base, _ = await _greedy(engine)
        tuned, cached = await _greedy(engine, lora={"a": 0.5})
        assert tuned == want_merged and tuned != want_base
        assert cached == 0  # the base model's cells of the same prompt are not this adapter's
        again, cached = await _greedy(engine, lora={"a": 0.5})
        assert again == tuned and cached > 0  # but the same adapter's are
        # both sets at once: the steps take turns, and each conversation gets its own answer
        together: list[list[int]] = [[], [], []]

        async def run(i: int, options: dict[str, Any]) -> None:
            together[i] = (await _greedy(engine, **options))[0]

        async with anyio.create_task_group() as tg:
            for i, options in enumerate(({}, {"lora": {"a": 0.5}}, {"lora": {"a": 0.0}})):
                tg.start_soon(run, i, options)
        assert together == [want_base, want_merged, want_base]
        with pytest.raises(InvalidRequestError, match="no LoRA adapter 'b'"):
            engine.conversation(lora={"b": 1.0})
        with pytest.raises(InvalidRequestError, match="scale"):
            engine.conversation(lora={"a": float("nan")})


@pytest.mark.anyio
async def test_a_stream_switches_its_conversations_adapters(
        tiny_path: Path, adapter: tuple[Path, dict[str, np.ndarray]], merged: Path) -> None:
    async with Engine(merged, n_ctx=512) as engine:
        want_merged, _ = await _greedy(engine)
    async with Engine(tiny_path, n_ctx=512, lora={"a": adapter[0]}) as engine:
        want_base, _ = await _greedy(engine)
        conv = engine.conversation(TOKENS)
        plain = await conv.stream(max_tokens=6, temperature=0)
        assert plain.tokens == want_base
        conv.rewind(6)
        tuned = await conv.stream(max_tokens=6, temperature=0, lora={"a": 0.5})
        assert tuned.tokens == want_merged
        assert tuned.stats is not None and tuned.stats.cached_tokens == 0  # the history again, under the adapter
        conv.rewind(6)
        back = await conv.stream(max_tokens=6, temperature=0, lora={})
        assert back.tokens == want_base
        assert back.stats is not None and back.stats.cached_tokens >= len(TOKENS) - 1  # the cells it left behind
        conv.rewind(6)
        same = await conv.stream(max_tokens=6, temperature=0)  # no lora: the adapters stay as they are
        assert same.tokens == want_base
        fork = conv.fork()  # a fork switches alone: its parent keeps its adapters
        forked = await fork.stream(max_tokens=6, temperature=0, lora={"a": 0.5})
        fresh = engine.conversation(list(conv.tokens), lora={"a": 0.5}, cache_salt="fresh")
        assert forked.tokens == (await fresh.stream(max_tokens=6, temperature=0)).tokens
        with pytest.raises(InvalidRequestError, match="no LoRA adapter 'b'"):
            conv.stream(lora={"b": 1.0})
        assert (await conv.stream(max_tokens=2, temperature=0)).finish_reason == "length"  # nothing was started


def test_requests_choose_the_servers_adapters(
        tiny_path: Path, adapter: tuple[Path, dict[str, np.ndarray]], merged: Path) -> None:
    async def reference() -> str:
        async with Engine(merged, n_ctx=512) as engine:
            conv = engine.conversation(TOKENS)
            return (await conv.stream(max_tokens=6, temperature=0)).text

    want = anyio.run(reference)
    server = Server(tiny_path, "--n-ctx", "1024", "--n-seq-max", "2", "--log-level", "warning",
                    "--lora", f"a={adapter[0]}")
    try:
        def text(**extra: Any) -> tuple[int, Any]:
            body = {"prompt": TOKENS, "max_tokens": 6, "temperature": 0, **extra}
            status, _, answer = server.post("/v1/completions", json.dumps(body).encode())
            return status, answer["choices"][0]["text"] if status == 200 else answer

        assert text(lora=[{"id": 0, "scale": 0.5}]) == (200, want)
        assert text(lora=[{"name": "a", "scale": 0.5}]) == (200, want)
        assert text()[1] != want
        status, answer = text(lora=[{"id": 3, "scale": 1.0}])
        assert status == 400 and answer["error"]["param"] == "lora"
        status, answer = text(lora={"a": 1})
        assert status == 400 and answer["error"]["param"] == "lora"
    finally:
        server.stop()
