"""The KV memory hierarchy on real llama.cpp with the tiny model: the prefix cache across
conversations, parking in host memory, save and load, rewind, and context shift."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from helpers import GREEDY
from tiny_model import spm_model

import aiollama
from aiollama import (
    ConversationBusy,
    ConversationFileError,
    Engine,
    FinishReason,
    InvalidRequestError,
    ModelMismatch,
    SyncEngine,
)

pytestmark = pytest.mark.anyio

STORY = "Once upon a time, in a village by the sea, there lived an old fisherman who"


async def test_a_closed_conversations_prefix_serves_the_next_one(tiny_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=2048, n_seq_max=4) as engine:
        async with engine.conversation() as first:
            await first.chat("Tell me a story about the sea.", max_tokens=20, **GREEDY)
            history = list(first.tokens)
        before = engine.statistics()
        assert before.cache_entries == 1 and before.kv_cells_cached == len(history) - 1
        async with engine.conversation() as second:  # the same history, resent, and one more turn
            second.prompt(history)
            reply = await second.chat("And then?", max_tokens=5, **GREEDY)
        assert reply.stats is not None and reply.stats.cached_tokens == len(history) - 1
        new_tokens = reply.stats.prompt_tokens - reply.stats.cached_tokens
        assert engine.statistics().tokens_evaluated - before.tokens_evaluated == new_tokens + 4


async def test_a_parked_prefix_comes_back_from_host_memory(tiny_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=512, n_seq_max=2, host_cache_bytes=64 << 20) as engine:
        long_story = " ".join([STORY] * 12)
        async with engine.conversation(long_story) as first:
            await first.stream(max_tokens=4, **GREEDY)
            history = list(first.tokens)
        async with engine.conversation(" ".join(["Something else entirely."] * 40)) as other:
            await other.stream(max_tokens=150, **GREEDY)  # needs the cells the first one left
        stats = engine.statistics()
        assert stats.parks >= 1 and stats.parked >= 1 and stats.parked_bytes > 0
        async with engine.conversation(history + engine.tokenize(" and")) as again:
            out = await again.stream(max_tokens=4, **GREEDY)
        assert out.stats is not None and out.stats.restores == 1
        assert out.stats.cached_tokens >= len(history) - 1
        assert engine.statistics().restores == stats.restores + 1


async def test_save_load_and_continue_as_if_never_interrupted(tiny_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "story.aiollama"
    async with Engine(tiny_path, n_ctx=1024, n_seq_max=2) as engine:
        async with engine.conversation(STORY) as conv:
            first = await conv.stream(max_tokens=10, **GREEDY)
            await conv.save(path)
            uninterrupted = await conv.stream(max_tokens=10, **GREEDY)
    async with Engine(tiny_path, n_ctx=1024, n_seq_max=2) as engine:
        conv = await engine.load(path)
        assert list(conv.tokens) == engine.tokenize(STORY) + first.tokens
        resumed = await conv.stream(max_tokens=10, **GREEDY)
        assert resumed.tokens == uninterrupted.tokens
        # the loaded cells were used: only the last token (never decoded) and the new ones were evaluated
        assert resumed.stats is not None and resumed.stats.cached_tokens == len(conv.tokens) - 11
        assert engine.statistics().tokens_evaluated == 10
        await conv.aclose()


def test_save_and_load_on_threads_keep_the_chat(tiny_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "chat.aiollama"
    with SyncEngine(tiny_path, n_ctx=1024, n_seq_max=2) as engine:
        with engine.conversation() as conv:
            conv.chat("Hello there", max_tokens=4, **GREEDY).result()
            conv.save(path)
            messages, tokens = conv.messages, conv.tokens
        with engine.load(path) as loaded:
            assert loaded.messages == messages and loaded.tokens == tokens
            out = loaded.chat("Tell me more", max_tokens=4, **GREEDY).result()
            assert len(out.tokens) == 4 and len(loaded.messages) == 4


async def test_a_damaged_or_foreign_file_raises_and_changes_nothing(tiny_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "conv.aiollama"
    async with Engine(tiny_path, n_ctx=1024, n_seq_max=2) as engine:
        async with engine.conversation(STORY) as conv:
            expected = (await conv.stream(max_tokens=6, **GREEDY)).tokens
            await conv.save(path)
        data = path.read_bytes()
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0xFF
        cases = {"flipped": bytes(flipped), "cut": data[: len(data) // 3], "other": b"not a conversation\n" * 8}
        for name, content in cases.items():
            bad = tmp_path / f"{name}.aiollama"
            bad.write_bytes(content)
            with pytest.raises(ConversationFileError):
                await engine.load(bad)
        with pytest.raises(FileNotFoundError):
            await engine.load(tmp_path / "missing.aiollama")
        stats = engine.statistics()
        assert (stats.live, stats.active) == (0, 0)
        async with engine.conversation(STORY) as conv:  # still serving, still the same answer
            assert (await conv.stream(max_tokens=6, **GREEDY)).tokens == expected
    other_model = spm_model(aiollama.cache_dir() / "test-models")
    async with Engine(other_model, n_ctx=1024, n_seq_max=2) as engine:
        with pytest.raises(ModelMismatch, match="another model"):
            await engine.load(path)


async def test_rewind_then_regenerate(tiny_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=1024, n_seq_max=2) as engine, engine.conversation(STORY) as conv:
        prompt = list(conv.tokens)
        first = await conv.stream(max_tokens=12, **GREEDY)
        conv.rewind(12)
        assert list(conv.tokens) == prompt
        again = await conv.stream(max_tokens=12, **GREEDY)
        assert again.tokens == first.tokens  # greedy from the same place
        assert again.stats is not None and again.stats.cached_tokens == len(prompt) - 1
        conv.rewind(12)
        other = await conv.stream(max_tokens=12, temperature=1.5, seed=3)
        assert other.tokens != first.tokens and list(conv.tokens)[:len(prompt)] == prompt
        with pytest.raises(InvalidRequestError):
            conv.rewind(len(conv) + 1)
        stream = conv.stream(max_tokens=100, **GREEDY)
        with pytest.raises(ConversationBusy):
            conv.rewind(1)
        await stream.aclose()


async def test_rewinding_a_chat_reply_lets_the_next_stream_replace_it(tiny_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=1024, n_seq_max=2) as engine, engine.conversation() as conv:
        reply = await conv.chat("Name a colour.", max_tokens=6, **GREEDY)
        assert conv.messages[-1] == {"role": "assistant", "content": reply.text}
        conv.rewind(len(reply.tokens))  # back to where the reply began
        assert [m["role"] for m in conv.messages] == ["user"]
        new = await conv.stream(max_tokens=4, temperature=1.0, seed=7)
        assert conv.messages[-1] == {"role": "assistant", "content": new.text}
        follow = await conv.chat("Another one?", max_tokens=3, **GREEDY)
        assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
        conv.rewind(len(follow.tokens) + 3)  # into the middle of the last turn's prompt
        with pytest.raises(aiollama.ChatTemplateError, match="rewound"):
            conv.append_chat("Hello?")


@pytest.mark.parametrize("where", ["engine", "stream"])
async def test_context_shift_keeps_generating_past_the_context(tiny_path: Path, where: str) -> None:
    options = {"context_shift": True, "n_keep": 16} if where == "engine" else {}
    params = {} if where == "engine" else {"context_shift": True, "n_keep": 16}
    async with Engine(tiny_path, n_ctx=256, n_seq_max=1, **options) as engine:
        async with engine.conversation(STORY) as conv:
            start = list(conv.tokens)[:16]
            out = await conv.stream(max_tokens=600, **GREEDY, **params)
            assert out.finish_reason is FinishReason.LENGTH and len(out.tokens) == 600
            assert len(conv) < 256 and list(conv.tokens)[:16] == start
            assert list(conv.tokens)[-20:] == out.tokens[-20:]
            more = await conv.stream(max_tokens=5, **GREEDY, **params)  # and it goes on from there
            assert len(more.tokens) == 5
        async with engine.conversation(STORY) as conv:  # without the policy the end is the end
            out = await conv.stream(max_tokens=600, **GREEDY, context_shift=False)
            assert out.finish_reason is FinishReason.LENGTH and len(conv) == 256


async def test_clear_cache_frees_what_closed_conversations_left(tiny_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=1024, n_seq_max=2) as engine:
        for i in range(3):
            async with engine.conversation(f"{STORY} {i}") as conv:
                await conv.stream(max_tokens=3, **GREEDY)
        assert engine.statistics().cache_entries >= 1
        await engine.clear_cache()
        stats = engine.statistics()
        assert (stats.kv_cells_used, stats.cache_entries, stats.parked) == (0, 0, 0)


async def test_save_of_a_streaming_conversation_is_refused(tiny_path: Path, tmp_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=1024, n_seq_max=2) as engine, engine.conversation(STORY) as conv:
        stream = conv.stream(max_tokens=1000, **GREEDY)
        with pytest.raises(ConversationBusy):
            await conv.save(tmp_path / "busy.aiollama")
        await stream.aclose()
        with anyio.fail_after(10):
            await conv.save(tmp_path / "settled.aiollama")
