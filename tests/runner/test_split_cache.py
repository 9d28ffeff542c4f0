"""A split KV cache (``kv_unified=False``): each seq id has cells of its own, forks and cached
prefixes are copied into them, and everything else works as in a unified cache."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from helpers import GREEDY, gather, solo, wait_for
from server_process import Server

from aiollama import ContextFull, Engine, EngineConfig, InvalidRequestError
from aiollama.cli import parser
from aiollama.native import Context
from aiollama.serve_command import serve_n_ctx

pytestmark = pytest.mark.anyio

N_CTX, N_SEQ = 1024, 4


@pytest.fixture
async def engine(tiny_path: Path) -> AsyncIterator[Engine]:
    async with Engine(tiny_path, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=256, step_tokens=64, kv_unified=False) as e:
        yield e


async def test_each_conversation_holds_its_share_of_the_cache(engine: Engine) -> None:
    assert engine.n_ctx == N_CTX // N_SEQ
    assert engine.statistics().kv_cells_total == N_CTX
    with pytest.raises(ContextFull):
        engine.conversation(engine.tokenize(" word" * (engine.n_ctx + 10)))
    async with engine.conversation("Once upon a time") as conv:
        out = await conv.stream(max_tokens=engine.n_ctx, **GREEDY)
    assert out.finish_reason == "length"
    assert len(engine.tokenize("Once upon a time")) + len(out.tokens) == engine.n_ctx


async def test_streams_together_give_their_solo_text(engine: Engine, tiny_path: Path) -> None:
    prompts = ["The first story", "A second tale", "Third time lucky", "And a fourth one"]
    convs = [engine.conversation(p) for p in prompts]
    outs = await gather(*(c.stream(max_tokens=40, **GREEDY) for c in convs))
    for p, o in zip(prompts, outs):
        assert o.tokens == (await solo(tiny_path, p, max_tokens=40, **GREEDY)).tokens
    for c in convs:
        await c.aclose()


async def test_forks_copy_the_prefix_instead_of_evaluating_it(engine: Engine, tiny_path: Path) -> None:
    prefix = " ".join(["the cat sat on the mat"] * 20)
    async with engine.conversation(prefix) as parent:
        first = await parent.stream(max_tokens=1, **GREEDY)
        base = await wait_for(engine, lambda s: s.active == 0)
        children = [parent.fork() for _ in range(3)]
        outs = await gather(*(c.stream(max_tokens=12, **GREEDY) for c in children))
        stats = engine.statistics()
        # each child evaluates its own tokens only: the prefix came with the copy
        assert stats.tokens_evaluated - base.tokens_evaluated <= 3 * 13
        # a copy is the child's own: the cells are counted once here, held three more times there
        alone = await solo(tiny_path, prefix, max_tokens=13, **GREEDY)
        assert all(o.tokens == alone.tokens[1:] for o in outs)
        assert first.tokens == alone.tokens[:1]
        more = await parent.stream(max_tokens=5, **GREEDY)
        assert more.tokens == alone.tokens[1:6]
        for c in children:
            await c.aclose()


async def test_a_cached_prefix_is_copied_into_a_new_conversation(engine: Engine, tiny_path: Path) -> None:
    prefix = " ".join(["a shared system prompt"] * 20)
    async with engine.conversation(prefix) as first:
        await first.stream(max_tokens=2, **GREEDY)
    before = engine.statistics()
    async with engine.conversation(prefix + " and a question") as second:
        out = await second.stream(max_tokens=10, **GREEDY)
    after = engine.statistics()
    assert after.cache_hit_tokens - before.cache_hit_tokens >= len(engine.tokenize(prefix)) - 1
    assert out.tokens == (await solo(tiny_path, prefix + " and a question", max_tokens=10, **GREEDY)).tokens


async def test_more_conversations_than_seq_ids_take_turns(tiny_path: Path) -> None:
    prompts = [f"Story number {i} begins with a tale of" for i in range(6)]
    async with Engine(tiny_path, n_ctx=512, n_seq_max=2, n_batch=256, step_tokens=64, kv_unified=False) as engine:
        convs = [engine.conversation(p) for p in prompts]
        outs = await gather(*(c.stream(max_tokens=30, **GREEDY) for c in convs))
        for c in convs:
            await c.aclose()
    for p, o in zip(prompts, outs):
        assert o.tokens == (await solo(tiny_path, p, max_tokens=30, **GREEDY)).tokens


async def test_a_history_that_outgrows_its_share_shifts(engine: Engine) -> None:
    async with engine.conversation("Once upon a time") as conv:
        out = await conv.stream(max_tokens=2 * engine.n_ctx, context_shift=True, n_keep=4, **GREEDY)
    assert out.finish_reason == "length" and len(out.tokens) == 2 * engine.n_ctx


async def test_a_saved_conversation_moves_between_split_and_unified_engines(engine: Engine, tiny_path: Path,
                                                                         tmp_path: Path) -> None:
    async with engine.conversation("The saved story goes") as conv:
        await conv.stream(max_tokens=8, **GREEDY)
        await conv.save(tmp_path / "split.aiollama")
        rest = await conv.stream(max_tokens=8, **GREEDY)
    async with Engine(tiny_path, n_ctx=1024, n_seq_max=2) as unified:
        async with await unified.load(tmp_path / "split.aiollama") as loaded:
            await loaded.save(tmp_path / "unified.aiollama")
            before = unified.statistics()
            assert (await loaded.stream(max_tokens=8, **GREEDY)).tokens == rest.tokens
            # the cells came with the file: only the pending token and the new ones were evaluated
            assert unified.statistics().tokens_evaluated - before.tokens_evaluated <= 9
    await engine.clear_cache()  # the cache still holds the first conversation: no help from it
    async with await engine.load(tmp_path / "unified.aiollama") as back:
        before = engine.statistics()
        assert (await back.stream(max_tokens=8, **GREEDY)).tokens == rest.tokens
        assert engine.statistics().tokens_evaluated - before.tokens_evaluated <= 9


def test_the_option_is_checked() -> None:
    with pytest.raises(InvalidRequestError, match="kv_unified"):
        EngineConfig(kv_unified="no")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="unified"):
        EngineConfig(kv_unified=False, deterministic=True)
    assert EngineConfig(kv_unified=False, n_seq_max=4).context_seq_ids(49152) == 4
    assert EngineConfig(kv_unified=False, n_seq_max=4, cache_seq_ids=2).context_seq_ids(49152) == 6


async def test_the_server_splits_its_cache_when_asked(tiny_path: Path) -> None:
    server = Server(tiny_path, "--n-ctx", "1024", "--n-seq-max", "4", "--split-cache", "--log-level", "warning")
    try:
        short = json.dumps({"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}).encode()
        status, _, body = await anyio.to_thread.run_sync(server.post, "/v1/completions", short)
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        # 400 tokens fit the 1,024 cells, not a quarter of them
        long = json.dumps({"prompt": " word" * 400, "max_tokens": 4}).encode()
        status, _, body = await anyio.to_thread.run_sync(server.post, "/v1/completions", long)
        assert status == 400 and "context" in json.dumps(body).lower()
    finally:
        server.stop()


async def test_a_step_gives_llama_cpp_its_sequences_in_seq_id_order(engine: Engine,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # llama.cpp computes a split cache's sequences together only while their ids follow each other
    # in the batch: whatever order the streams joined in, each batch lists them by seq id
    orders: list[list[int]] = []
    decode = Context.decode

    def recording(self: Context, batch: Any, wake: Any = ()) -> Any:
        orders.append(list(batch.first_pos))
        return decode(self, batch, wake)

    monkeypatch.setattr(Context, "decode", recording)
    first = [engine.conversation(p) for p in ("One story", "Two stories", "Three stories", "Four stories")]
    streams = [c.stream(max_tokens=30, **GREEDY) for c in first]  # every seq id taken
    await wait_for(engine, lambda s: s.tokens_generated >= 8)
    await first[1].aclose()  # its seq id now holds its prefix as a cache entry
    late = engine.conversation("A late story")  # takes that id from the entry, last in line
    outs = await gather(streams[0], streams[2], streams[3], late.stream(max_tokens=10, **GREEDY))
    assert [len(o.tokens) for o in outs] == [30, 30, 30, 10]
    assert any(len(o) == 4 for o in orders)
    assert all(o == sorted(o) for o in orders)
    for c in (first[0], first[2], first[3], late):
        await c.aclose()


@pytest.mark.parametrize(("argv", "unified", "n_ctx"), [
    ([], False, 16 * 2048),                                      # each request 2,048 cells, as llama-server's slots
    (["--n-seq-max", "2"], False, 8192),                         # and at least 8,192 in all
    (["--n-ctx", "4096"], False, 4096),
    (["--unified-cache"], True, EngineConfig.n_ctx),
    (["--unified-cache", "-c", "2048"], True, 2048),
])
def test_the_server_splits_its_cache_by_default(argv: list[str], unified: bool, n_ctx: int) -> None:
    args = parser().parse_args(["serve", "m.gguf", *argv])
    assert args.unified_cache is unified and serve_n_ctx(args) == n_ctx


def test_split_and_unified_cannot_both_be_asked() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--split-cache", "--unified-cache"])
