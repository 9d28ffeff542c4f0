"""The whole engine (facade, decode thread, scheduler, finish rules, delivery) against a fake
executor: no model, no llama.cpp, on asyncio and trio.

The fake model's next token depends on the history it reads back from a fake KV cache only, so a
conversation must produce exactly what it produces alone, whatever the scheduling did to it
(batching, joins, forks, preemption, re-evaluation, injected faults)."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from fake_executor import EOS, FakeExecutor, next_token, solo_tokens
from helpers import decode_threads, gather, wait_for

from aiollama import (
    Engine,
    EngineClosed,
    EngineConfig,
    EngineDead,
    FinishReason,
    GrammarError,
    Overloaded,
)
from aiollama.sched.step import Copy, StepStatus

pytestmark = pytest.mark.anyio

GREEDY: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)


class Fakes:
    """A factory for the engine that remembers the executor it built."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.executor: FakeExecutor | None = None

    def __call__(self, config: EngineConfig) -> FakeExecutor:
        self.executor = FakeExecutor(config, **self.kwargs)
        return self.executor


def engine_of(fakes: Fakes, **options: Any) -> Engine:
    options = {"n_ctx": 512, "n_seq_max": 4, "n_batch": 64, "step_tokens": 32, **options}
    return Engine(executor=fakes, **options)


def slow(plan: Any) -> None:
    """A step as long as a small model's, so that a test can act while streams run."""
    time.sleep(0.002)


@pytest.fixture
async def fake() -> AsyncIterator[tuple[Engine, FakeExecutor]]:
    fakes = Fakes()
    async with engine_of(fakes) as engine:
        assert fakes.executor is not None
        yield engine, fakes.executor
    assert fakes.executor.closed


def prompt(i: int, n: int = 10) -> list[int]:
    return [65 + (i * 7 + k) % 26 for k in range(n)]


async def test_batched_streams_give_what_each_gives_alone(fake: tuple[Engine, FakeExecutor]) -> None:
    engine, _ = fake
    convs = [engine.conversation(prompt(i, 5 + i)) for i in range(6)]  # 6 over 4 seq ids
    outs = await gather(*(c.stream(max_tokens=20, **GREEDY) for c in convs))
    for i, out in enumerate(outs):
        assert out.tokens == solo_tokens(prompt(i, 5 + i), 20)
        assert out.finish_reason is FinishReason.LENGTH
        assert out.text == bytes(out.tokens).decode()
        assert list(convs[i].tokens) == prompt(i, 5 + i) + out.tokens


async def test_a_late_joiner_and_long_prompts_are_chunked() -> None:
    fakes = Fakes(fault=slow)
    async with engine_of(fakes, n_ctx=4096) as engine:
        assert fakes.executor is not None
        await late_joiner(engine, fakes.executor)


async def late_joiner(engine: Engine, executor: FakeExecutor) -> None:
    early = engine.conversation(prompt(1))
    stream = early.stream(max_tokens=100_000, **GREEDY)
    await wait_for(engine, lambda s: s.tokens_generated >= 5)
    late = engine.conversation(prompt(2, 150))
    late_out = await late.stream(max_tokens=5, **GREEDY)
    stream.cancel()
    early_out = await stream
    assert early_out.tokens == solo_tokens(prompt(1), len(early_out.tokens))
    assert late_out.tokens == solo_tokens(prompt(2, 150), 5)
    # while the long prompt was evaluated, the running stream had its row in every step
    chunks = [p for p in executor.plans if any(len(s.tokens) > 1 and s.conv == late.id for s in p.slices)]
    assert len(chunks) >= 4
    assert all(any(s.conv == early.id for s in p.slices) for p in chunks)


async def test_finish_rules(tiny_fakes_eog: Fakes) -> None:
    async with engine_of(tiny_fakes_eog) as engine:
        base = prompt(3)
        expect = solo_tokens(base, 200, eog_every=7)
        n = expect.index(EOS)
        async with engine.conversation(base) as conv:
            out = await conv.stream(max_tokens=200, temperature=0.0)
            assert out.finish_reason is FinishReason.EOG
            assert out.tokens == expect[:n]  # the end-of-generation token is not shown...
            assert list(conv.tokens) == base + expect[:n + 1]  # ...but it is in the history
        async with engine.conversation(base) as conv:
            text = bytes(expect[:n]).decode()
            stop = text[2:4]
            out = await conv.stream(max_tokens=200, temperature=0.0, stop=[stop])
            assert out.finish_reason is FinishReason.STOP and out.text == text[:2]
        async with engine.conversation(base) as conv:
            out = await conv.stream(max_tokens=3, temperature=0.0)
            assert out.finish_reason is FinishReason.LENGTH and len(out.tokens) == 3


@pytest.fixture
def tiny_fakes_eog() -> Fakes:
    return Fakes(eog_every=7)


async def test_the_context_end_finishes_with_length() -> None:
    async with engine_of(Fakes(), n_ctx=64, n_seq_max=1) as engine, engine.conversation(prompt(4)) as conv:
        out = await conv.stream(max_tokens=1000, **GREEDY)
        assert out.finish_reason is FinishReason.LENGTH and len(conv) == 64 and len(out.tokens) == 54


async def test_prompts_during_a_stream_follow_it(fake: tuple[Engine, FakeExecutor]) -> None:
    engine, executor = fake
    async with engine.conversation(prompt(5)) as conv:
        stream = conv.stream(max_tokens=12, **GREEDY)
        conv.prompt([33, 34])
        assert list(conv.tokens)[-2:] == [33, 34]  # shown after what has arrived so far
        out = await stream
        assert list(conv.tokens) == prompt(5) + out.tokens + [33, 34]
        more = await conv.stream(max_tokens=4, **GREEDY)
        assert more.tokens == solo_tokens(prompt(5) + out.tokens + [33, 34], 4)
        # the fake cache holds exactly the conversation's history, token by token
        seq_id = next(s.seq_id for p in reversed(executor.plans) for s in p.slices if s.conv == conv.id)
        assert executor.kv.tokens(seq_id) == list(conv.tokens)[:-1]


async def test_forks_share_the_prefix_and_continue_alone(fake: tuple[Engine, FakeExecutor]) -> None:
    engine, executor = fake
    parent = engine.conversation(prompt(6, 100))
    first = await parent.stream(max_tokens=3, **GREEDY)
    children = [parent.fork() for _ in range(3)]
    assert all(c.tokens == parent.tokens for c in children)
    outs = await gather(*(c.stream(max_tokens=8, **GREEDY) for c in children))
    history = prompt(6, 100) + first.tokens
    assert all(o.tokens == solo_tokens(history, 8) for o in outs)
    assert any(isinstance(op, Copy) and op.n >= 100 for p in executor.plans for op in p.ops)
    # the 100-token prefix was evaluated once: the children added their own tokens only
    assert engine.statistics().tokens_evaluated <= 100 + 3 + 3 * 9 + 3


@pytest.mark.parametrize("host_cache_bytes", [0, 1 << 20], ids=["drop", "park"])
async def test_preemption_in_a_small_cache_keeps_every_answer(host_cache_bytes: int) -> None:
    async with engine_of(Fakes(), n_ctx=96, n_seq_max=4, host_cache_bytes=host_cache_bytes) as engine:
        convs = [engine.conversation(prompt(i, 12)) for i in range(5)]
        outs = await gather(*(c.stream(max_tokens=24, **GREEDY) for c in convs))
        assert [o.tokens for o in outs] == [solo_tokens(prompt(i, 12), 24) for i in range(5)]
        stats = engine.statistics()
        assert stats.kv_cells_used <= 96 and stats.preemptions > 0
        if host_cache_bytes:  # parked and put back: nothing was evaluated twice
            assert stats.restores > 0 and stats.tokens_evaluated <= 5 * (12 + 23)
        else:  # dropped and evaluated again
            assert stats.tokens_evaluated > 5 * (12 + 23)


async def test_a_cancel_interrupts_a_long_prefill() -> None:
    hold = threading.Event()
    fakes = Fakes(hold=hold)
    async with engine_of(fakes, n_batch=512, step_tokens=512) as engine:
        executor = fakes.executor
        assert executor is not None
        conv = engine.conversation(prompt(7, 400))
        stream = conv.stream(max_tokens=4, **GREEDY)
        await anyio.to_thread.run_sync(executor.prefilling.wait, 10)
        stream.cancel()
        assert (await stream).finish_reason is FinishReason.CANCELLED
        stats = await wait_for(engine, lambda s: s.active == 0)
        assert stats.aborted_steps == 1 and stats.kv_cells_used == 200  # the half computed is kept
        hold.set()
        again = await conv.stream(max_tokens=3, **GREEDY)
        assert again.tokens == solo_tokens(prompt(7, 400), 3)
        assert engine.statistics().tokens_evaluated == 400 + 2  # the kept half was not evaluated again


def every_third(status: StepStatus) -> Callable[[Any], StepStatus | None]:
    calls = [0]

    def fault(plan: Any) -> StepStatus | None:
        calls[0] += 1
        return status if calls[0] % 3 == 0 else None
    return fault


@pytest.mark.parametrize("draft", [0, 4], ids=["plain", "drafts"])
@pytest.mark.parametrize("status", [StepStatus.NO_KV_SLOT, StepStatus.ABORTED])
async def test_recoverable_faults_change_no_answer(status: StepStatus, draft: int) -> None:
    # an aborted step with drafts leaves cells past the history (the draft's) and without logits
    # (the pending token's): they go, and the pending token is evaluated again
    async with engine_of(Fakes(fault=every_third(status), period=5), draft_tokens=draft) as engine:
        convs = [engine.conversation(prompt(i, 40)) for i in range(3)]
        outs = await gather(*(c.stream(max_tokens=15, **GREEDY) for c in convs))
        assert [o.tokens for o in outs] == [solo_tokens(prompt(i, 40), 15, period=5) for i in range(3)]


async def test_a_failed_step_kills_the_engine_for_everyone() -> None:
    failing = threading.Event()

    def fault(plan: Any) -> StepStatus | None:
        slow(plan)
        return StepStatus.FAILED if failing.is_set() else None

    fakes = Fakes(fault=fault)
    with pytest.raises(EngineDead, match="injected FAILED"):
        async with engine_of(fakes, n_ctx=8192, n_seq_max=2) as engine:
            streams = [engine.conversation(prompt(i)).stream(max_tokens=10_000, **GREEDY) for i in range(3)]
            await wait_for(engine, lambda s: s.active == 2 and s.queued == 1)
            failing.set()
            for s in streams:
                with pytest.raises(EngineDead):
                    await s
            with pytest.raises(EngineDead):
                engine.conversation("after")
    assert fakes.executor is not None and fakes.executor.closed
    assert decode_threads() == []


async def test_no_kv_slot_with_nothing_to_free_gives_up() -> None:
    fakes = Fakes(fault=lambda plan: StepStatus.NO_KV_SLOT)
    with pytest.raises(EngineDead, match="no KV slot"):
        async with engine_of(fakes) as engine:
            with pytest.raises(EngineDead):
                await engine.conversation(prompt(8)).stream(max_tokens=2, **GREEDY)


async def test_overloaded_and_admission() -> None:
    async with engine_of(Fakes(fault=slow), n_ctx=8192, n_seq_max=1, max_queued=1) as engine:
        running = engine.conversation(prompt(1)).stream(max_tokens=10_000, **GREEDY)
        await wait_for(engine, lambda s: s.active == 1)
        waiting = engine.conversation(prompt(2)).stream(max_tokens=2, **GREEDY)
        with pytest.raises(Overloaded, match="max_queued"):
            engine.conversation(prompt(3)).stream(max_tokens=2)
        running.cancel()
        assert (await running).finish_reason is FinishReason.CANCELLED
        assert len((await waiting).tokens) == 2
        await engine.conversation(prompt(3)).stream(max_tokens=1)  # room again


async def test_a_sampler_the_executor_refuses_is_the_streams_error(fake: tuple[Engine, FakeExecutor]) -> None:
    engine, _ = fake
    async with engine.conversation(prompt(1)) as conv:
        with pytest.raises(GrammarError):
            await conv.stream(grammar="root ::= x")
        assert len((await conv.stream(max_tokens=2, **GREEDY)).tokens) == 2
    stats = engine.statistics()
    assert (stats.active, stats.queued, stats.live) == (0, 0, 0)


async def test_closing_ends_streams_and_frees_everything() -> None:
    fakes = Fakes(fault=slow)
    async with engine_of(fakes, n_ctx=8192) as engine:
        convs = [engine.conversation(prompt(i)) for i in range(6)]
        streams = [c.stream(max_tokens=10_000, **GREEDY) for c in convs]
        await wait_for(engine, lambda s: s.active == 4 and s.queued == 2)
        await convs[0].aclose()
        await wait_for(engine, lambda s: s.live == 5)
    for s in streams[1:]:
        with pytest.raises(EngineClosed):
            await s
    assert fakes.executor is not None and fakes.executor.closed and not engine.serving


async def test_statistics_count_what_happened(fake: tuple[Engine, FakeExecutor]) -> None:
    engine, executor = fake
    out = await engine.conversation(prompt(9, 20)).stream(max_tokens=5, **GREEDY)
    stats = engine.statistics()
    assert stats.tokens_generated == 5 and stats.tokens_evaluated == 20 + 4
    assert stats.decode_steps == len(executor.plans) and sum(stats.step_histogram) == stats.decode_steps
    assert out.tokens[0] == next_token(prompt(9, 20), None)


def test_wake_pipes_close_with_their_event_loops() -> None:
    """Each event loop gets a wake pipe; it is closed once the loop is gone, so a process that runs
    many loops (a test suite, a CLI called in a loop) does not run out of descriptors."""
    import asyncio
    import gc
    import os

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0

    async def use_engine() -> None:
        async with engine_of(Fakes()) as engine:
            await engine.conversation(prompt(1)).stream(max_tokens=3, **GREEDY)

    asyncio.run(use_engine())
    gc.collect()
    before = open_fds()
    for _ in range(20):
        asyncio.run(use_engine())
    gc.collect()
    assert open_fds() <= before + 2
