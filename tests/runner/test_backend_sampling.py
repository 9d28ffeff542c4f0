"""Backend sampling: a stream's chain runs inside the decode graph where it can, and chooses what
the same chain chooses from the logits (greedy bit for bit; seeded streams the same draws), while
streams that need their rows (log-probabilities, processors) sample from them beside it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import Gate

from aiollama import Engine, EngineConfig, InvalidRequestError
from aiollama.native import Batch, Context, Model, SamplerChain, sample_rows
from aiollama.native.binding import lib, set_log_level
from aiollama.native.sampler_chain import attach

PROMPTS = [f"Story {i}: once upon a time" for i in range(8)]


def test_a_chain_in_the_graph_chooses_the_token_its_logits_give(tiny_path: Path) -> None:
    with Model(tiny_path) as model, Batch(64) as batch:
        with Context(model, n_ctx=512, n_seq_max=2) as ctx, SamplerChain(model.vocab) as chain:
            chain.add_greedy()
            assert attach(ctx, 0, chain)
            row = batch.add_tokens([10, 20, 30, 40], 0, 0, output_last=True)
            assert ctx.decode(batch) == 0
            chosen = lib.llama_get_sampled_token_ith(ctx._get(), row)
            assert chosen >= 0 and sample_rows(ctx, [chain], [row]) == [chosen]
            attach(ctx, 0, None)  # back to the logits
            batch.clear()
            row = batch.add_tokens([chosen], 4, 0, output_last=True)
            assert ctx.decode(batch) == 0
            assert lib.llama_get_sampled_token_ith(ctx._get(), row) == -1
        batch.clear()
        with Context(model, n_ctx=512, n_seq_max=2) as ctx:
            row = batch.add_tokens([10, 20, 30, 40], 0, 0, output_last=True)
            assert ctx.decode(batch) == 0
            assert int(np.argmax(ctx.logits(row))) == chosen
            with SamplerChain(model.vocab) as typical:
                typical.add_typical(0.9).add_dist(1)
                assert not typical.backend_capable
                with pytest.raises(InvalidRequestError, match="graph"):
                    attach(ctx, 0, typical)


async def streams(model: Path, backend: bool, n_ctx: int = 8192, **params: Any) -> list[tuple[int, ...]]:
    gate = Gate()
    async with Engine(model, executor=gate, n_ctx=n_ctx, n_seq_max=9, backend_sampling=backend) as engine:
        convs: list[Any] = []  # opened while the gate holds the decode thread, kept open to the end

        def start() -> list[Any]:
            convs.extend(engine.conversation(p) for p in PROMPTS)
            return [c.stream(max_tokens=32, ignore_eos=True, **params) for c in convs]
        outs = await gate.together(engine, start)
        return [tuple(o.tokens) for o in outs]


@pytest.mark.anyio
@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=0.8, seed=3, top_k=40, top_p=0.9),
    dict(temperature=0.7, seed=9, min_p=0.05, logit_bias={100: 5.0}),
    dict(temperature=0.0, repeat_penalty=1.3),  # penalties stay on the CPU
    dict(temperature=0.8, seed=5, draft_tokens=4),  # steps with a draft leave the graph, the others return
], ids=["greedy", "top-k-p", "min-p-bias", "penalties", "drafts"])
async def test_the_graph_chooses_what_the_logits_give(tiny_path: Path, params: dict[str, Any]) -> None:
    cpu = await streams(tiny_path, False, **params)
    assert await streams(tiny_path, True, **params) == cpu
    assert await streams(tiny_path, True, **params) == cpu


@pytest.mark.anyio
async def test_rows_that_are_read_are_sampled_beside_the_graph(tiny_path: Path) -> None:
    """Streams with log-probabilities or a processor beside streams sampled in the graph, in a
    cache small enough that streams are preempted and resume under other seq ids."""
    seen: list[int] = []

    def processor(tokens: tuple[int, ...], logits: np.ndarray) -> None:
        seen.append(len(tokens))

    async def run(backend: bool) -> list[tuple[Any, ...]]:
        gate = Gate()
        async with Engine(tiny_path, executor=gate, n_ctx=256, n_seq_max=6, backend_sampling=backend) as engine:
            convs: list[Any] = []
            extra: list[dict[str, Any]] = [dict(logprobs=True, top_logprobs=2), dict(logits_processors=[processor])]

            def start() -> list[Any]:
                convs.extend(engine.conversation(p * 3) for p in PROMPTS[:6])
                return [c.stream(max_tokens=40, temperature=0.0, ignore_eos=True, **(extra[i] if i < 2 else {}))
                        for i, c in enumerate(convs)]
            outs = await gate.together(engine, start)
            preempted = engine.statistics().preemptions
            return [(o.tokens, [x.logprob or 0.0 for x in o.logprobs or []]) for o in outs] + [preempted]

    cpu = await run(False)
    backend = await run(True)
    assert [tokens for tokens, _ in backend[:-1]] == [tokens for tokens, _ in cpu[:-1]]
    # A resumed stream's cells land where the freed ones happen to be, and CPU flash attention sums
    # over cells in their order: the log-probabilities agree to rounding, not to the bit. A row read
    # for the wrong stream or step would be off by far more.
    assert backend[0][1] == pytest.approx(cpu[0][1], abs=0.05) and len(cpu[0][1]) == 40
    assert backend[-1] > 0 and seen


def test_backend_sampling_setting() -> None:
    assert EngineConfig(backend_sampling=True).backend_sampling
    with pytest.raises(InvalidRequestError, match="backend_sampling"):
        EngineConfig(backend_sampling="yes")  # type: ignore[arg-type]


async def _leave_then_join(path: Path, backend: bool, reserves: Any) -> tuple[list[list[int]], int]:
    """X streams throughout; A joins, ends, and X decodes on alone; then B joins. Returns the three
    streams' tokens and the graph reservations from A's start until X has decoded 5 tokens after
    A ended."""
    async with Engine(path, n_ctx=512, n_seq_max=2, backend_sampling=backend) as engine:
        x, a, b = (engine.conversation(p) for p in PROMPTS[:3])
        got: list[int] = []
        first = anyio.Event()

        async def run_x() -> None:
            async for chunk in x.stream(max_tokens=160, temperature=0.0, ignore_eos=True):
                got.extend(chunk.tokens)
                first.set()

        async def until(n: int) -> None:
            while len(got) < n:
                await anyio.sleep(0.002)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_x)
            await first.wait()
            before = reserves()
            a_out = await a.stream(max_tokens=4, temperature=0.0, ignore_eos=True)
            await until(len(got) + 5)
            during = reserves() - before
            b_out = await b.stream(max_tokens=8, temperature=0.0, ignore_eos=True)
        return [got, a_out.tokens, b_out.tokens], during


@pytest.mark.anyio
async def test_a_stream_that_ends_leaves_the_graph_as_it_was(tiny_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Taking a chain out of the graph re-reserves the whole graph at the next decode, which the
    streams still running would pay for: an ended stream's chain stays in the graph, idle, until
    its seq id has a row again. A stream that takes that seq id is sampled by its own chain."""
    set_log_level(logging.INFO)  # llama.cpp says "reserving" at INFO
    try:
        with caplog.at_level(logging.INFO, logger="aiollama.llama_cpp"):
            def reserves() -> int:
                return sum("reserving" in r.getMessage() for r in caplog.records)

            cpu, _ = await _leave_then_join(tiny_path, False, reserves)
            graph, during = await _leave_then_join(tiny_path, True, reserves)
    finally:
        set_log_level(logging.WARNING)
    assert graph == cpu
    assert during == 1  # A joining; nothing when it left
