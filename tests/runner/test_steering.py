"""Steering and seeing each conversation: logits processors, classifier-free guidance between two
conversations, priorities, and where each generation's time went."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import numpy as np
import pytest
from fake_executor import FakeExecutor, next_token
from helpers import GREEDY, gather, wait_for

from aiollama import (
    ConversationBusy,
    Engine,
    EngineConfig,
    InvalidRequestError,
    LogitsProcessorError,
    SamplingParams,
    SyncEngine,
)
from aiollama.sched.scheduler import AGING_SECONDS, Scheduler, SchedulerConfig


def fake(config: EngineConfig) -> FakeExecutor:
    return FakeExecutor(config)


# classifier-free guidance, on the fake model (which checks the lockstep: a guided row without
# its guide's row in the same step fails the engine)


@pytest.mark.anyio
async def test_guidance_scale_one_is_the_plain_stream() -> None:
    async with Engine(executor=fake, n_ctx=512, n_seq_max=4) as engine:
        plain = await engine.conversation("the positive prompt").stream(max_tokens=24, **GREEDY)
        conv, negative = engine.conversation("the positive prompt"), engine.conversation("a negative one")
        guided = await conv.stream(max_tokens=24, guidance=negative, guidance_scale=1.0, **GREEDY)
        assert guided.tokens == plain.tokens
        assert list(negative.tokens) == list(b"a negative one") + guided.tokens


@pytest.mark.anyio
async def test_guidance_changes_the_output_and_keeps_both_in_step() -> None:
    async with Engine(executor=fake, n_ctx=512, n_seq_max=4, step_tokens=8) as engine:
        # prompts of very different lengths, evaluated in chunks: the two meet at their last tokens
        conv = engine.conversation("short")
        negative = engine.conversation("a much longer negative prompt, evaluated over several steps")
        others = [engine.conversation(chr(97 + i) * 30) for i in range(2)]
        streams = [c.stream(max_tokens=30, **GREEDY) for c in others]
        guided = await conv.stream(max_tokens=30, guidance=negative, guidance_scale=3.0, **GREEDY)
        await gather(*streams)
        plain = await engine.conversation("short").stream(max_tokens=30, **GREEDY)
        assert guided.tokens != plain.tokens and len(guided.tokens) == 30
        assert negative.tokens[-30:] == tuple(guided.tokens)
        # both histories continue where they are: the next streams see the guided tokens
        after = await negative.stream(max_tokens=1, **GREEDY)
        assert after.tokens == [next_token(negative.tokens[:-1], None)]


@pytest.mark.anyio
async def test_a_guiding_conversation_is_busy_and_its_prompts_wait() -> None:
    async with Engine(executor=fake, n_ctx=512, n_seq_max=4) as engine:
        conv, negative = engine.conversation("pos"), engine.conversation("neg")
        stream = conv.stream(max_tokens=8, guidance=negative, guidance_scale=2.0, **GREEDY)
        with pytest.raises(ConversationBusy):
            negative.stream(max_tokens=1)
        with pytest.raises(ConversationBusy):
            negative.rewind(1)
        with pytest.raises(ConversationBusy):
            engine.conversation("x").stream(guidance=negative)
        negative.prompt("!")
        done = await stream
        assert negative.tokens == tuple(b"neg") + tuple(done.tokens) + tuple(b"!")


@pytest.mark.anyio
async def test_closing_the_guide_ends_the_guided_stream_only() -> None:
    async with Engine(executor=fake, n_ctx=512, n_seq_max=4) as engine:
        conv, negative, bystander = (engine.conversation(p) for p in ("pos", "neg", "other"))
        guided = conv.stream(max_tokens=None, guidance=negative, guidance_scale=2.0, ignore_eos=True)
        other = bystander.stream(max_tokens=40, **GREEDY)
        async for _ in guided:
            break
        await negative.aclose()
        with pytest.raises(Exception, match="guiding this one was closed|cancelled|closed"):
            async for _ in guided:
                pass
        assert len((await other).tokens) == 40
        assert len((await conv.stream(max_tokens=3, **GREEDY)).tokens) == 3


@pytest.mark.anyio
async def test_bad_guidance() -> None:
    async with Engine(executor=fake, n_ctx=512, n_seq_max=4) as engine, \
            Engine(executor=fake, n_ctx=512, n_seq_max=4) as other_engine:
        conv = engine.conversation("pos")
        for kwargs, match in [
            ({"guidance": "no"}, "same engine"),
            ({"guidance": other_engine.conversation("x")}, "same engine"),
            ({"guidance": conv}, "own stream"),
            ({"guidance": engine.conversation()}, "empty"),
            ({"guidance_scale": 2.0}, "needs guidance"),
            ({"guidance": engine.conversation("x"), "guidance_scale": float("nan")}, "finite"),
            ({"guidance": engine.conversation("x"), "context_shift": True}, "shift"),
        ]:
            with pytest.raises(InvalidRequestError, match=match):
                conv.stream(**kwargs)
        assert len((await conv.stream(max_tokens=2)).tokens) == 2  # nothing was left half done


# priorities


@pytest.mark.anyio
async def test_a_high_priority_stream_goes_before_the_queued_low_ones() -> None:
    first_token: dict[str, float] = {}  # when each got its first token, by the engine's own timings

    def slow(config: EngineConfig) -> FakeExecutor:  # 2 ms a step: the endless stream stays readable
        return FakeExecutor(config, fault=lambda plan: time.sleep(0.002))

    async with Engine(executor=slow, n_ctx=1024, n_seq_max=1) as engine:
        running = engine.conversation("running").stream(max_tokens=None, ignore_eos=True, context_shift=True)
        await wait_for(engine, lambda s: s.active == 1)

        async def drain() -> None:  # read it: an unread endless stream only piles up
            async for _ in running:
                pass

        async def one(name: str, priority: int) -> None:
            created = time.perf_counter()
            done = await engine.conversation(name).stream(max_tokens=4, priority=priority, **GREEDY)
            assert done.stats is not None
            first_token[name] = created + done.stats.time_to_first_token

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain)
            for i, (name, priority) in enumerate([("low1", 5), ("low2", 5), ("high", -1), ("mid", 0)]):
                tg.start_soon(one, name, priority)
                await wait_for(engine, lambda s, n=i + 1: s.queued == n)
            running.cancel()
        assert sorted(first_token, key=first_token.__getitem__) == ["high", "mid", "low1", "low2"]


def test_a_waiting_low_priority_stream_is_not_starved() -> None:
    now = [0.0]
    sched = Scheduler(SchedulerConfig(n_ctx=4096, n_seq_max=4, n_batch=64, step_tokens=64, max_running=1),
                      clock=lambda: now[0])
    for conv in range(4):
        sched.add(conv, [1, 2, 3])
    sched.submit(0)
    sched.schedule()  # 0 runs
    sched.submit(1, priority=5)  # low, waits
    now[0] += 4 * AGING_SECONDS
    sched.submit(2, priority=0)  # better, but 1 has waited four levels' worth
    sched.finish(0)
    assert sched.schedule().admitted == (2,)
    sched.finish(2)
    now[0] += 2 * AGING_SECONDS  # 1 now counts as priority -1
    sched.submit(3, priority=0)
    assert sched.schedule().admitted == (1,)


def test_priority_is_checked() -> None:
    with pytest.raises(InvalidRequestError, match="priority"):
        SamplingParams(priority=2**40)
    with pytest.raises(InvalidRequestError, match="priority"):
        SamplingParams(priority="high")  # type: ignore[arg-type]


# timings


@pytest.mark.anyio
async def test_timings_add_up() -> None:
    async with Engine(executor=fake, n_ctx=1024, n_seq_max=1) as engine:
        first = engine.conversation("first").stream(max_tokens=40, **GREEDY)
        started = time.perf_counter()
        completion = await engine.conversation("second prompt").stream(max_tokens=20, **GREEDY)
        wall = time.perf_counter() - started
        await first
        stats = completion.stats
        assert stats is not None
        assert stats.queue_seconds > 0 and stats.prefill_seconds >= 0 and stats.decode_seconds > 0
        assert stats.total_seconds == pytest.approx(stats.queue_seconds + stats.prefill_seconds + stats.decode_seconds)
        assert stats.total_seconds <= wall and wall - stats.total_seconds < 0.5
        assert stats.time_to_first_token < stats.total_seconds
        assert stats.decode_steps == 20
        assert stats.prompt_tokens == len(b"second prompt") and stats.cached_tokens == 0
        assert stats.prompt_evaluated == stats.prompt_tokens
        again = await engine.conversation("second prompt").stream(max_tokens=5, **GREEDY)
        assert again.stats is not None and again.stats.prompt_evaluated + again.stats.cached_tokens \
            == again.stats.prompt_tokens and again.stats.cached_tokens > 0


# logits processors, on the tiny real model


@pytest.mark.anyio
async def test_a_processor_that_bans_a_token_never_sees_it_sampled(tiny_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=256, n_seq_max=4) as engine:
        plain = await engine.conversation("Hello there").stream(max_tokens=12, **GREEDY)
        banned = set(plain.tokens[:3])
        seen: list[tuple[int, ...]] = []

        def ban(tokens: tuple[int, ...], logits: np.ndarray) -> None:
            seen.append(tokens)
            assert logits.dtype == np.float32 and logits.shape == (engine.n_vocab,)
            logits[list(banned)] = -np.inf

        conv = engine.conversation("Hello there")
        out = await conv.stream(max_tokens=12, logits_processors=[ban], **GREEDY)
        assert not banned & set(out.tokens) and len(out.tokens) == 12
        assert seen[0] == tuple(conv.tokens[:-12]) and seen[-1] == tuple(conv.tokens[:-1])


@pytest.mark.anyio
async def test_a_processor_may_return_the_row(tiny_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=256, n_seq_max=4) as engine:
        target = 300

        def only(tokens: tuple[int, ...], logits: np.ndarray) -> np.ndarray:
            row = np.full_like(logits, -np.inf)
            row[target] = 0.0
            return row

        out = await engine.conversation("Hi").stream(max_tokens=4, logits_processors=[only], **GREEDY)
        assert out.tokens == [target] * 4


@pytest.mark.anyio
async def test_a_processor_that_raises_ends_only_its_stream(tiny_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=256, n_seq_max=4, draft_tokens=4) as engine:
        calls = 0

        def flaky(tokens: tuple[int, ...], logits: np.ndarray) -> None:
            nonlocal calls
            calls += 1
            if calls == 3:
                raise ValueError("boom")

        def wrong(tokens: tuple[int, ...], logits: np.ndarray) -> object:
            return [1, 2]

        bystander = engine.conversation("One two three one two three one two").stream(max_tokens=30, **GREEDY)
        conv = engine.conversation("One two three one two three")
        with pytest.raises(LogitsProcessorError, match="boom") as info:
            await conv.stream(max_tokens=20, logits_processors=[flaky], **GREEDY)
        assert isinstance(info.value.__cause__, ValueError)
        with pytest.raises(LogitsProcessorError, match="returned list"):
            await engine.conversation("x").stream(max_tokens=3, logits_processors=[wrong])
        assert len((await bystander).tokens) == 30
        assert len((await conv.stream(max_tokens=5, **GREEDY)).tokens) == 5  # its history is consistent
        assert engine.statistics().active == 0


def test_processors_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="logits_processors"):
        SamplingParams(logits_processors=[1])  # type: ignore[list-item]
    assert SamplingParams(logits_processors=print).logits_processors == (print,)  # type: ignore[arg-type]


def test_guidance_on_the_tiny_model_with_plain_threads(tiny_path: Path) -> None:
    with SyncEngine(tiny_path, n_ctx=256, n_seq_max=4) as engine:
        plain = engine.conversation("The weather today").stream(max_tokens=16, **GREEDY).result()
        conv, negative = engine.conversation("The weather today"), engine.conversation("Rain and storms")
        same = conv.stream(max_tokens=16, guidance=negative, guidance_scale=1.0, **GREEDY).result()
        assert same.tokens == plain.tokens
        conv.rewind(16)
        negative.rewind(16)
        steered = conv.stream(max_tokens=16, guidance=negative, guidance_scale=4.0, **GREEDY).result()
        assert steered.tokens != plain.tokens
        assert list(negative.tokens[-16:]) == steered.tokens
