"""Recurrent and hybrid models: a recurrent state is only ever the state after a sequence's last
position, so the engine keeps checkpoints of it (:mod:`aiollama.sched.checkpoints`). Every engine
feature that moves a sequence backwards (a rewind, a prefix hit that ends early, a fork before the
end, a preemption, a failed or cancelled decode) must give the tokens a fresh conversation with the
same history gives.

First against the fake executor with a hybrid memory (``fake_kv`` asserts llama.cpp's rules at every
operation and every decode), then on tiny models written with gguf: an LFM2 (short convolutions
beside attention), a Jamba (Mamba beside attention), a Mamba (purely recurrent) and a DeepSeek V4
(compressors with a state beside attention over a window)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_executor import FakeExecutor, solo_tokens
from helpers import gather, wait_for
from server_process import Server
from test_engine_fake import GREEDY, Fakes, engine_of, every_third, prompt
from tiny_model import lfm2_model, mamba_model
from tiny_mtp_families import deepseek4_mtp_model

import aiollama
from aiollama import Engine, EngineConfig, FinishReason
from aiollama.errors import UnsupportedModel
from aiollama.runner.executor import recurrent_config
from aiollama.sched.checkpoints import CHECKPOINT_EVERY
from aiollama.sched.step import Checkpoint, Copy, Restore, StepStatus

pytestmark = pytest.mark.anyio


def hybrid(**kwargs: Any) -> Fakes:
    return Fakes(memory="hybrid", **kwargs)


def ops_of(executor: FakeExecutor | None, kind: type) -> list[Any]:
    assert executor is not None
    return [op for plan in executor.plans for op in plan.ops if isinstance(op, kind)]


async def test_forks_share_the_whole_state_and_a_checkpoint_lies_before_each_prompts_last_token() -> None:
    fakes = hybrid()
    async with engine_of(fakes) as engine:
        parent = engine.conversation(prompt(6, 100))
        first = await parent.stream(max_tokens=3, **GREEDY)
        assert first.tokens == solo_tokens(prompt(6, 100), 3)
        children = [parent.fork() for _ in range(3)]
        outs = await gather(*(c.stream(max_tokens=8, **GREEDY) for c in children))
        history = prompt(6, 100) + first.tokens
        assert all(o.tokens == solo_tokens(history, 8) for o in outs)
        assert all(o.stats is not None and o.stats.cached_tokens == len(history) - 1 for o in outs)
        assert any(op.n == len(history) - 1 for op in ops_of(fakes.executor, Copy))
        assert ops_of(fakes.executor, Checkpoint)


async def test_a_rewind_and_a_shorter_prefix_go_back_to_a_checkpoint() -> None:
    fakes = hybrid()
    async with engine_of(fakes) as engine:
        conv = engine.conversation(prompt(2, 50))
        first = await conv.stream(max_tokens=10, **GREEDY)
        conv.rewind(10)  # regenerate the reply: from the checkpoint before the prompt's last token
        again = await conv.stream(max_tokens=10, **GREEDY)
        assert again.tokens == first.tokens
        assert again.stats is not None and again.stats.cached_tokens == 49
        assert any(op.partial for op in ops_of(fakes.executor, Restore))
        # a new conversation that leaves the first one's history inside its reply starts at the
        # prompt's checkpoint, not at the whole holder (which holds the reply too)
        other = engine.conversation(prompt(2, 50) + [70, 71])
        out = await other.stream(max_tokens=6, **GREEDY)
        assert out.tokens == solo_tokens(prompt(2, 50) + [70, 71], 6)
        assert out.stats is not None and out.stats.cached_tokens == 49
        assert engine.statistics().checkpoints_used >= 2


async def test_long_prefills_leave_checkpoints_along_the_way() -> None:
    n = CHECKPOINT_EVERY + 200
    async with engine_of(hybrid(), n_ctx=4096, n_batch=512, step_tokens=256) as engine:
        conv = engine.conversation(prompt(3, n))
        await conv.stream(max_tokens=2, **GREEDY)
        # an agent's context that changed after the first CHECKPOINT_EVERY tokens
        edited = prompt(3, n)[:CHECKPOINT_EVERY + 50] + [90, 91, 92]
        out = await engine.conversation(edited).stream(max_tokens=4, **GREEDY)
        assert out.tokens == solo_tokens(edited, 4)
        assert out.stats is not None and CHECKPOINT_EVERY <= out.stats.cached_tokens <= CHECKPOINT_EVERY + 50


async def test_long_replies_leave_checkpoints_too() -> None:
    """A chat client sends a reply back as text, and its tokens may differ from the ones generated:
    a checkpoint every CHECKPOINT_EVERY generated tokens bounds what is evaluated again."""
    async with engine_of(hybrid(), n_ctx=4096) as engine:
        conv = engine.conversation(prompt(5, 20))
        reply = await conv.stream(max_tokens=CHECKPOINT_EVERY + 100, **GREEDY)
        resent = prompt(5, 20) + reply.tokens[:CHECKPOINT_EVERY + 50] + [90, 91]
        out = await engine.conversation(resent).stream(max_tokens=4, **GREEDY)
        assert out.tokens == solo_tokens(resent, 4)
        assert out.stats is not None and out.stats.cached_tokens >= CHECKPOINT_EVERY


async def test_streams_that_arrive_together_evaluate_a_shared_prefix_once() -> None:
    """A leader's prefill stops where the others' prompts leave it, and they share its whole state
    there: a system prompt many requests start with is evaluated once, as with attention models."""
    system = prompt(4, 200)
    prompts = [system + prompt(10 + i, 12) for i in range(4)]
    async with engine_of(hybrid(), n_ctx=2048, n_batch=128, step_tokens=64) as engine:
        outs = await gather(*(engine.conversation(p).stream(max_tokens=5, **GREEDY) for p in prompts))
        assert [o.tokens for o in outs] == [solo_tokens(p, 5) for p in prompts]
        # the system prompt once, then each one's 12 tokens and the 4 fed back of its 5
        assert engine.statistics().tokens_evaluated <= 200 + 4 * (12 + 4)


@pytest.mark.parametrize("host_cache_bytes", [0, 1 << 20], ids=["drop", "park"])
async def test_preemption_keeps_every_answer(host_cache_bytes: int) -> None:
    async with engine_of(hybrid(), n_ctx=96, n_seq_max=4, host_cache_bytes=host_cache_bytes) as engine:
        convs = [engine.conversation(prompt(i, 12)) for i in range(5)]
        outs = await gather(*(c.stream(max_tokens=24, **GREEDY) for c in convs))
        assert [o.tokens for o in outs] == [solo_tokens(prompt(i, 12), 24) for i in range(5)]
        assert engine.statistics().preemptions > 0


async def test_failed_decodes_go_back_to_a_checkpoint_and_change_no_answer() -> None:
    async with engine_of(hybrid(fault=every_third(StepStatus.ABORTED))) as engine:
        convs = [engine.conversation(prompt(i, 40)) for i in range(3)]
        outs = await gather(*(c.stream(max_tokens=15, **GREEDY) for c in convs))
        assert [o.tokens for o in outs] == [solo_tokens(prompt(i, 40), 15) for i in range(3)]


async def test_a_cancelled_prefill_leaves_no_half_computed_state() -> None:
    hold = threading.Event()
    fakes = hybrid(hold=hold)
    async with engine_of(fakes, n_batch=512, step_tokens=512) as engine:
        assert fakes.executor is not None
        conv = engine.conversation(prompt(7, 400))
        stream = conv.stream(max_tokens=4, **GREEDY)
        await anyio.to_thread.run_sync(fakes.executor.prefilling.wait, 10)
        stream.cancel()
        assert (await stream).finish_reason is FinishReason.CANCELLED
        await wait_for(engine, lambda s: s.active == 0)
        hold.set()
        again = await conv.stream(max_tokens=3, **GREEDY)
        assert again.tokens == solo_tokens(prompt(7, 400), 3)


# tiny models


@pytest.fixture(scope="module", params=["lfm2", "jamba", "mamba", "deepseek4"])
def recurrent_path(request: pytest.FixtureRequest, smollm2_path: Path) -> Path:
    """A hybrid of short convolutions and attention, one of Mamba and attention, a pure Mamba, and a
    DeepSeek V4 (attention over a window and over compressed blocks, whose compressors keep a state
    per sequence; llama.cpp copies its sequences whole only, and so that the two share state)."""
    cache = aiollama.cache_dir() / "test-models"
    if request.param == "lfm2":
        return lfm2_model(cache, smollm2_path)
    if request.param == "deepseek4":
        return deepseek4_mtp_model(cache, smollm2_path, agree=False)
    return mamba_model(cache, smollm2_path, layers="mama" if request.param == "jamba" else "mm")


PROMPT = [1, 504, 3426, 314, 3599, 284, 260, 2116] * 5
SOLO: dict[str, Any] = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


async def fresh(engine: Engine, history: list[int], salt: str) -> list[int]:
    """What a conversation with this history gives when it shares nothing (a salt of its own)."""
    conv = engine.conversation(history, cache_salt=salt)
    out = await conv.stream(**SOLO)
    await conv.aclose()
    return out.tokens


async def test_every_way_back_gives_what_a_fresh_conversation_gives(recurrent_path: Path, tmp_path: Path) -> None:
    async with Engine(recurrent_path, n_ctx=1024, n_seq_max=4) as engine:
        conv = engine.conversation(PROMPT)
        first = await conv.stream(**SOLO)
        assert first.tokens == await fresh(engine, PROMPT, "a")
        history = PROMPT + first.tokens

        # a prefix hit of the same prompt, from the checkpoint before its last token
        same = engine.conversation(PROMPT)
        out = await same.stream(**SOLO)
        assert out.tokens == first.tokens and out.stats is not None and out.stats.cached_tokens == len(PROMPT) - 1

        # forks: with a prompt of their own (the whole state is shared), and without one
        fork = conv.fork()
        fork.prompt([504, 3426])
        out = await fork.stream(**SOLO)
        assert out.tokens == await fresh(engine, history + [504, 3426], "b")
        assert out.stats is not None and out.stats.cached_tokens == len(history) - 1  # the last reply token: never decoded
        bare = conv.fork()
        out = await bare.stream(**SOLO)
        assert out.tokens == await fresh(engine, history, "c")

        # a rewind: the reply again, from the prompt's checkpoint
        conv.rewind(len(first.tokens))
        out = await conv.stream(**SOLO)
        assert out.tokens == first.tokens and out.stats is not None and out.stats.cached_tokens == len(PROMPT) - 1

        # saved and loaded: the whole state goes and comes back
        path = tmp_path / "conv.bin"
        await conv.save(path)
        loaded = await engine.load(path)
        out = await loaded.stream(**SOLO)
        assert out.tokens == await fresh(engine, list(loaded.tokens[:-len(out.tokens)]), "d")
        assert engine.statistics().checkpoints_used >= 2


async def test_streams_that_share_a_prefix_share_its_state(recurrent_path: Path) -> None:
    prompts = [PROMPT * 2 + [600 + i, 601 + i] for i in range(3)]
    async with Engine(recurrent_path, n_ctx=1024, n_seq_max=4, step_tokens=32) as engine:
        outs = await gather(*(engine.conversation(p).stream(**SOLO) for p in prompts))
        assert [o.tokens for o in outs] == [await fresh(engine, p, str(i)) for i, p in enumerate(prompts)]
        assert sum(o.stats.cached_tokens for o in outs if o.stats is not None) >= 2 * len(PROMPT * 2)


async def test_preempted_streams_of_a_hybrid_model_give_what_they_give_alone(smollm2_path: Path) -> None:
    path = lfm2_model(aiollama.cache_dir() / "test-models", smollm2_path)
    prompts = [PROMPT[i:] + [600 + i] for i in range(5)]
    params = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    async with Engine(path, n_ctx=1024, n_seq_max=1) as engine:
        alone = [(await engine.conversation(p, cache_salt=str(i)).stream(**params)).tokens
                 for i, p in enumerate(prompts)]
    for host in (0, 1 << 24):
        async with Engine(path, n_ctx=192, n_seq_max=5, host_cache_bytes=host) as engine:
            outs = await gather(*(engine.conversation(p).stream(**params) for p in prompts))
            assert [o.tokens for o in outs] == alone
            assert engine.statistics().preemptions > 0


async def test_what_a_recurrent_state_cannot_do_is_refused(recurrent_path: Path) -> None:
    with pytest.raises(UnsupportedModel, match="recurrent or hybrid.*deterministic"):
        async with Engine(recurrent_path, n_ctx=256, deterministic=True):
            pass
    if recurrent_path.name.startswith(("tiny-lfm2", "tiny-deepseek4")):
        return  # their states roll back: drafts are tested in test_recurrent_drafts
    with pytest.raises(UnsupportedModel, match="recurrent or hybrid.*cannot roll back"):
        async with Engine(recurrent_path, n_ctx=256, draft_tokens=4):
            pass


async def test_a_split_cache_asked_for_is_one_cache_that_shares_whole_states(recurrent_path: Path) -> None:
    async with Engine(recurrent_path, n_ctx=1024, kv_unified=False) as engine:
        conv = engine.conversation(PROMPT)
        first = await conv.stream(**SOLO)
        fork = conv.fork()
        fork.prompt([504])
        out = await fork.stream(**SOLO)
        assert out.tokens == await fresh(engine, PROMPT + first.tokens + [504], "a")
        assert out.stats is not None and out.stats.cached_tokens == len(PROMPT) + len(first.tokens) - 1



@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the OpenAI client's
async def test_a_served_hybrid_model_evaluates_only_each_new_turn(smollm2_path: Path) -> None:
    """Over HTTP, as an OpenAI client sends a chat: the whole history each turn. The history's reply
    is rendered by the template, so a turn starts from the checkpoint before the last prompt's end
    or from the whole state of the conversation before it."""
    path = lfm2_model(aiollama.cache_dir() / "test-models", smollm2_path)
    server = Server(path, "--n-ctx", "4096", "--n-seq-max", "4", "--model-name", "tiny", "--log-level", "warning")
    try:
        messages: list[dict[str, str]] = [{"role": "system", "content": "Answer briefly."}]
        usages = []
        async with server.client() as client:
            for question in ("Name a sea.", "And a mountain?", "And a river?"):
                messages.append({"role": "user", "content": question})
                reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                             temperature=0)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                usages.append(reply.usage)
        for before, after in zip(usages, usages[1:]):
            cached = after.prompt_tokens_details.cached_tokens
            assert cached >= before.prompt_tokens - 1, (before, after)
            assert after.prompt_tokens - cached < 40
    finally:
        server.stop()


def test_a_recurrent_model_runs_in_one_cache_with_as_many_cache_ids_as_streams() -> None:
    config = recurrent_config(EngineConfig(n_seq_max=4), "m", "mamba")
    assert (config.kv_unified, config.cache_seq_ids) == (True, 4)  # each id holds a state up front
    assert recurrent_config(EngineConfig(n_seq_max=4, cache_seq_ids=10), "m", "mamba").cache_seq_ids == 10
    split = recurrent_config(EngineConfig(n_seq_max=4, kv_unified=False, cache_seq_ids=0), "m", "mamba")
    assert (split.kv_unified, split.cache_seq_ids) == (True, 4)
    with pytest.raises(UnsupportedModel, match="deterministic"):
        recurrent_config(EngineConfig(deterministic=True), "m", "mamba")
