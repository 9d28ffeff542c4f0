"""Speculation with a draft model: its greedy guesses save decode steps and never change the greedy
text, through forks and rewinds; a model of another vocabulary is refused; a full draft context
starts afresh."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import gather
from tiny_model import quantized_model, spm_model

import aiollama
from aiollama import Engine, EngineConfig, InvalidRequestError
from aiollama.config import DRAFT_MODEL_TOKENS
from aiollama.native import Model
from aiollama.runner.drafter import Drafter

GREEDY: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)
PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):", "Hello " * 30]


@pytest.fixture(scope="module")
def other_draft(smollm2_path: Path) -> Path:
    """The tiny model quantized: it guesses like the tiny model most of the time, not always."""
    return quantized_model(aiollama.cache_dir() / "test-models", smollm2_path, "q8_0")


async def streams(model: Path, draft: Path | None, **params: Any) -> tuple[list[tuple[int, ...]], int, list[Any]]:
    async with Engine(model, n_ctx=4096, n_seq_max=8, draft_model=draft) as engine:
        convs = [engine.conversation(p) for p in PROMPTS]
        outs = await gather(*[c.stream(max_tokens=40, **params) for c in convs])
        return [tuple(o.tokens) for o in outs], engine.statistics().decode_steps, [o.stats for o in outs]


@pytest.mark.anyio
async def test_a_draft_model_saves_steps_and_changes_nothing(tiny_path: Path) -> None:
    plain, plain_steps, _ = await streams(tiny_path, None, **GREEDY)
    drafted, steps, stats = await streams(tiny_path, tiny_path, **GREEDY)  # the same model: every guess right
    assert drafted == plain
    assert steps < plain_steps / 3
    assert all(s.drafted > 0 and s.accepted == s.drafted for s in stats)


@pytest.mark.anyio
async def test_wrong_guesses_change_nothing(tiny_path: Path, other_draft: Path) -> None:
    plain, _, _ = await streams(tiny_path, None, **GREEDY)
    drafted, _, stats = await streams(tiny_path, other_draft, **GREEDY)
    assert drafted == plain
    assert sum(s.accepted for s in stats) < sum(s.drafted for s in stats)


@pytest.mark.anyio
async def test_one_seeded_stream_is_the_same_with_a_draft_model(tiny_path: Path) -> None:
    texts = []
    for draft in (None, tiny_path):
        async with Engine(tiny_path, n_ctx=2048, draft_model=draft) as engine:
            out = await engine.conversation("Once upon a time").stream(max_tokens=40, temperature=0.9, seed=4,
                                                                       ignore_eos=True)
            texts.append(out.tokens)
    assert texts[0] == texts[1]


@pytest.mark.anyio
async def test_forks_and_rewinds_draft_from_their_own_history(tiny_path: Path, other_draft: Path) -> None:
    results = []
    for draft in (None, other_draft):
        async with Engine(tiny_path, n_ctx=4096, n_seq_max=4, draft_model=draft) as engine:
            root = engine.conversation("The lighthouse keeper climbed the stairs")
            await root.stream(max_tokens=24, **GREEDY)
            fork = root.fork()
            root.rewind(10)
            a, b = await gather(root.stream(max_tokens=20, **GREEDY), fork.stream(max_tokens=20, **GREEDY))
            results.append((tuple(root.tokens), tuple(fork.tokens), a.text, b.text))
    assert results[0] == results[1]


def test_a_full_draft_context_starts_afresh(tiny_path: Path) -> None:
    with Model(tiny_path) as target:
        drafter = Drafter(tiny_path, target.vocab, n_ctx=64, n_batch=64, n_seq_max=4, n_threads=1, n_gpu_layers=0)
        try:
            size = drafter.ctx.n_ctx * 3 // 5  # two of them do not fit (evaluated in several batches)
            history = list(range(500, 500 + size))
            first = drafter.draft([(0, history, 4)])[0]
            assert len(first) == 4
            assert drafter.draft([(1, list(range(5000, 5000 + size)), 4)]) == [()]
            assert drafter.resets == 1
            assert drafter.draft([(0, history, 4)])[0] == first  # evaluated again from nothing
            assert drafter.draft([(0, history + list(first[:2]), 2)])[0] == first[2:]  # a kept prefix
        finally:
            drafter.close()


@pytest.mark.anyio
async def test_a_draft_model_of_another_vocabulary_is_refused(tiny_path: Path) -> None:
    spm = spm_model(aiollama.cache_dir() / "test-models")
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        async with Engine(tiny_path, draft_model=spm):
            pass


def test_draft_model_settings() -> None:
    assert EngineConfig(draft_model="x.gguf").draft_tokens == DRAFT_MODEL_TOKENS
    assert EngineConfig(draft_model="x.gguf", draft_tokens=3).draft_tokens == 3
    with pytest.raises(InvalidRequestError, match="draft_model"):
        EngineConfig(draft_model=5)  # type: ignore[arg-type]
