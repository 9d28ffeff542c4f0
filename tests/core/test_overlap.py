"""Overlapped steps (``EngineConfig.overlap``): step N+1 is planned and submitted before step N's
tokens go through the finish rules, so a stream that step N ends by a stop string, a cancel or a
closed consumer still has a row in N+1: it is thrown away and its cells go. Whatever happens, the
answers must be those of the plain loop, and so must every later turn of the same conversations.

The fake executor decodes in ``collect``, as a GPU's rows are ready only when they are read, and
its KV cache asserts llama.cpp's rules at every operation (a recurrent state cannot be cut back)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_executor import FakeExecutor, solo_tokens
from helpers import gather, wait_for
from test_engine_fake import Fakes, engine_of, prompt, slow

from aiollama import Engine, EngineConfig, FinishReason, InvalidRequestError
from aiollama.core.engine_core import overlapped

pytestmark = pytest.mark.anyio

STOPS = ["q", "zz", "e"]


def settings(i: int) -> dict[str, Any]:
    """Streams that end every way: max_tokens, stop strings, end of generation (some ignore it)."""
    return dict(max_tokens=3 + (i * 5) % 23, temperature=0.0, ignore_eos=i % 3 == 0,
                stop=[STOPS[i % len(STOPS)]] if i % 2 else [])


async def turns(engine: Engine, n: int) -> tuple[list[Any], int]:
    """Two turns of ``n`` conversations at once (more than run together), then a fork of each."""
    convs = [engine.conversation(prompt(i, 12 + i)) for i in range(n)]
    first = await gather(*(c.stream(**settings(i)) for i, c in enumerate(convs)))
    for i, c in enumerate(convs):
        c.prompt(prompt(i + 3, 5))
    second = await gather(*(c.stream(**settings(i + 1)) for i, c in enumerate(convs)))
    forks = await gather(*(c.fork().stream(**settings(i + 2)) for i, c in enumerate(convs)))
    answers = [(o.tokens, o.text, o.finish_reason) for o in first + second + forks]
    return answers, engine.statistics().discarded_tokens


@pytest.mark.parametrize(("memory", "draft"), [("kv", 0), ("kv", 4), ("hybrid", 0)])
async def test_overlapped_steps_give_what_plain_steps_give(memory: str, draft: int) -> None:
    runs = {}
    for overlap in (False, True):
        fakes = Fakes(memory=memory, eog_every=11)
        async with engine_of(fakes, overlap=overlap, draft_tokens=draft) as engine:
            runs[overlap] = await turns(engine, 10)
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == 0 and runs[True][1] > 0  # stop strings ended streams with rows in flight


async def test_a_stream_cancelled_while_steps_overlap_ends_and_its_conversation_goes_on() -> None:
    fakes = Fakes(fault=slow)
    async with engine_of(fakes, overlap=True) as engine:
        convs = [engine.conversation(prompt(i)) for i in range(3)]
        streams = [c.stream(max_tokens=100_000, temperature=0.0, ignore_eos=True) for c in convs]
        await wait_for(engine, lambda s: s.tokens_generated >= 30)
        streams[1].cancel()
        with anyio.fail_after(5):
            cancelled = await streams[1]
        assert cancelled.finish_reason is FinishReason.CANCELLED
        assert engine.statistics().active == 2  # the others go on
        for s in (streams[0], streams[2]):
            s.cancel()
            await s
        history = list(convs[1].tokens)
        again = await convs[1].stream(max_tokens=6, temperature=0.0, ignore_eos=True)
        assert again.tokens == solo_tokens(history, 6)


def test_steps_overlap_by_default_only_where_the_decode_runs_on_a_gpu() -> None:
    config = EngineConfig(n_ctx=64)
    executor = FakeExecutor(config)
    assert overlapped(executor, config) is None
    assert overlapped(executor, EngineConfig(n_ctx=64, overlap=True)) is executor
    executor.placement = "CUDA0"
    assert overlapped(executor, config) is executor
    assert overlapped(executor, EngineConfig(n_ctx=64, overlap=False)) is None

    class Plain:
        placement = "CUDA0"

        def execute(self) -> None: ...

    assert overlapped(Plain(), config) is None  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="overlap"):
        overlapped(Plain(), EngineConfig(n_ctx=64, overlap=True))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="overlap"):
        EngineConfig(overlap="yes")  # type: ignore[arg-type]


async def on_tiny(path: Path, overlap: bool, **options: Any) -> list[Any]:
    """Six streams on a real model, started in one step: greedy and seeded, stop strings taken from
    what the plain loop wrote, then a second turn of each."""
    async with Engine(path, n_ctx=1024, n_seq_max=4, overlap=overlap, **options) as engine:
        convs = [engine.conversation(f"Tell me about item {i}.") for i in range(6)]
        params = [dict(max_tokens=12 + 3 * i, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True,
                       stop=[STOP_OF[i]] if STOP_OF.get(i) else []) for i in range(6)]
        first = await gather(*(c.stream(**p) for c, p in zip(convs, params)))
        for c in convs:
            c.prompt(" And then?")
        second = await gather(*(c.stream(max_tokens=8, temperature=0.0, ignore_eos=True) for c in convs))
        return [(o.tokens, o.finish_reason) for o in first + second] + [engine.statistics().discarded_tokens]


STOP_OF: dict[int, str] = {}


@pytest.mark.parametrize("options", [dict(deterministic=True), dict(deterministic=True, backend_sampling=True)],
                         ids=["deterministic", "backend-sampling"])
async def test_on_a_model_overlapped_steps_give_what_plain_steps_give(tiny_path: Path, options: dict[str, Any]) -> None:
    STOP_OF.clear()
    plain = await on_tiny(tiny_path, False, **options)
    async with Engine(tiny_path, n_ctx=1024) as engine:  # stop strings from the middle of three replies
        for i in (1, 2, 4):
            text = engine.detokenize(plain[i][0])
            STOP_OF[i] = text[len(text) // 2:len(text) // 2 + 3]
    plain = await on_tiny(tiny_path, False, **options)
    overlap = await on_tiny(tiny_path, True, **options)
    assert sum(reason is FinishReason.STOP for _, reason in plain[:6]) >= 2
    # deterministic: a conversation's logits do not depend on the rows beside it, which the rows of
    # streams that ended change (with backend sampling, the samplers of those streams are still in
    # the graph that decodes their thrown rows)
    assert overlap[:-1] == plain[:-1]
    assert plain[-1] == 0 and overlap[-1] > 0
