"""Speculation with the model's own multi-token-prediction (MTP) layers, on tiny transformers in the
layouts of GLM-4.5 (tests/tiny_mtp.py), DeepSeek V3 (latent attention), DeepSeek V3.2 and GLM-5
(its sparse attention: an indexer picks the cells a token attends to), Step 3.5 and MiMo-V2
(sliding-window layers beside full ones), Hunyuan V3 and Cohere's mixture of experts
(tests/tiny_mtp_families.py): greedy and seeded text the same as without drafts, through forks,
rewinds, preemption and overlapped steps; a head that agrees with the model has every draft taken;
the MTP context holds what it would hold had it read the whole history at once; typed errors for
settings that cannot work."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import gather
from tiny_model import bert_model
from tiny_mtp import mtp_model, write_mtp_model
from tiny_mtp_families import (
    COHERE2MOE,
    DEEPSEEK2,
    DEEPSEEK32,
    GLM_DSA,
    HY_V3,
    MIMO2,
    STEP35,
    family_mtp_model,
    write_deepseek_mtp_model,
)

import aiollama
from aiollama import Engine, EngineConfig, InvalidRequestError, UnsupportedModel
from aiollama.config import DRAFT_MODEL_TOKENS
from aiollama.native import Batch, Context, Model
from aiollama.runner.mtp import MtpDrafter

GREEDY: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)
PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):", "Hello " * 30]


FAMILIES = ["glm4moe", DEEPSEEK2, DEEPSEEK32, GLM_DSA, STEP35, MIMO2, HY_V3, COHERE2MOE]


def family_model(smollm2_path: Path, arch: str, agree: bool) -> Path:
    cache = aiollama.cache_dir() / "test-models"
    if arch == "glm4moe":
        return mtp_model(cache, smollm2_path, agree=agree)
    return family_mtp_model(cache, smollm2_path, arch, agree=agree)


@pytest.fixture(scope="module", params=FAMILIES)
def agreeing(smollm2_path: Path, request: pytest.FixtureRequest) -> Path:
    return family_model(smollm2_path, request.param, True)


@pytest.fixture(scope="module", params=FAMILIES)
def random_head(smollm2_path: Path, request: pytest.FixtureRequest) -> Path:
    return family_model(smollm2_path, request.param, False)


async def streams(model: Path, mtp: bool, *, n_ctx: int = 4096, prompts: Sequence[str] = PROMPTS,
                  **options: Any) -> tuple[list[tuple[int, ...]], int, list[Any]]:
    async with Engine(model, n_ctx=n_ctx, n_seq_max=len(prompts), mtp=mtp, **options) as engine:
        convs = [engine.conversation(p) for p in prompts]
        outs = await gather(*[c.stream(max_tokens=40, **GREEDY) for c in convs])
        return [tuple(o.tokens) for o in outs], engine.statistics().decode_steps, [o.stats for o in outs]


@pytest.mark.anyio
async def test_an_agreeing_head_saves_steps_and_changes_nothing(agreeing: Path) -> None:
    plain, plain_steps, _ = await streams(agreeing, False)
    drafted, steps, stats = await streams(agreeing, True)
    assert drafted == plain
    assert steps < plain_steps / 3
    assert all(s.drafted > 0 and s.accepted == s.drafted for s in stats)


@pytest.mark.anyio
async def test_a_random_head_changes_nothing(random_head: Path) -> None:
    plain, _, _ = await streams(random_head, False)
    drafted, _, stats = await streams(random_head, True)
    assert drafted == plain
    assert sum(s.drafted for s in stats) > 0
    assert sum(s.accepted for s in stats) < sum(s.drafted for s in stats)


# the caches the deterministic mode cannot keep in position order (it refuses them): the sparse
# attention's indexer cache, and the sliding window's, which reuses a sequence's old cells
UNORDERED = (DEEPSEEK32, GLM_DSA, STEP35, MIMO2, COHERE2MOE)


@pytest.mark.anyio
@pytest.mark.parametrize(("arch", "agree"), [(arch, agree) for arch in FAMILIES for agree in (True, False)
                                             if agree or arch not in UNORDERED],
                         ids=lambda x: x if isinstance(x, str) else "agreeing" if x else "random_head")
async def test_preempted_and_overlapped_streams_are_the_same(arch: str, agree: bool, smollm2_path: Path) -> None:
    """Eight streams in a cache that holds about four: streams are preempted and resumed (their MTP
    entries removed and fed again), and the steps overlap. In the deterministic mode: otherwise a
    resumed stream's cells land elsewhere, the rounding of its logits changes, and a near tie of
    the random model may fall the other way (seen: log-probabilities -1.110 and -1.122). Where the
    mode refuses the cache, the agreeing head only, whose text the rounding does not change (its
    layers add nothing to the residual stream)."""
    model = family_model(smollm2_path, arch, agree)
    prompts = [f"Story number {i}: once upon a time" for i in range(8)]
    ordered = arch not in UNORDERED
    plain, _, _ = await streams(model, False, n_ctx=256, prompts=prompts, deterministic=ordered)
    drafted, _, stats = await streams(model, True, n_ctx=256, prompts=prompts, deterministic=ordered, overlap=True)
    assert drafted == plain
    assert sum(s.drafted for s in stats) > 0


@pytest.mark.anyio
async def test_a_seeded_stream_is_the_same_with_mtp(random_head: Path) -> None:
    texts = []
    for mtp in (False, True):
        async with Engine(random_head, n_ctx=2048, mtp=mtp) as engine:
            out = await engine.conversation("Once upon a time").stream(max_tokens=40, temperature=0.9, seed=4,
                                                                       ignore_eos=True)
            texts.append(out.tokens)
    assert texts[0] == texts[1]


@pytest.mark.anyio
async def test_forks_and_rewinds_draft_from_their_own_history(agreeing: Path) -> None:
    results = []
    for mtp in (False, True):
        async with Engine(agreeing, n_ctx=4096, n_seq_max=4, mtp=mtp) as engine:
            root = engine.conversation("The lighthouse keeper climbed the stairs")
            await root.stream(max_tokens=24, **GREEDY)
            fork = root.fork()
            root.rewind(10)
            a, b = await gather(root.stream(max_tokens=20, **GREEDY), fork.stream(max_tokens=20, **GREEDY))
            results.append((tuple(root.tokens), tuple(fork.tokens), a.text, b.text, a.stats.accepted, b.stats.accepted))
    assert results[0][:4] == results[1][:4]
    assert results[1][4] > 0 and results[1][5] > 0


def greedy_rows(ctx: Context, first: int, n: int) -> list[int]:
    return [int(np.frombuffer(ctx.logits_buffer(first + i), dtype=np.float32).argmax()) for i in range(n)]


def test_the_entries_are_those_of_the_whole_history_at_once(random_head: Path) -> None:
    """A stream decoded step by step, its drafts mostly rejected (their entries cut), drafts what a
    sequence fed its whole history in one batch drafts: each entry pairs a token with the target's
    state at the position before it."""
    with Model(random_head, load_mtp=True) as model, Context(model, n_ctx=1024, n_batch=128, n_seq_max=2) as ctx, \
            Batch(128) as batch:
        drafter = MtpDrafter(model, ctx, n_threads=1)
        try:
            done: list[int] = []  # the tokens the target evaluated and kept
            pending = model.vocab.tokenize("The keeper of the lighthouse", add_special=True)
            rejected = 0
            for _ in range(12):
                draft = drafter.draft([(0, done + pending, 3)])[0] if done else ()
                tokens = pending + list(draft)
                batch.clear()
                batch.add_tokens(tokens, len(done), 0, output_last=True, n_outputs=len(draft) + 1)
                assert ctx.decode(batch).name == "OK"
                chosen = greedy_rows(ctx, len(pending) - 1, len(draft) + 1)
                taken = 0
                while taken < len(draft) and chosen[taken] == draft[taken]:
                    taken += 1
                rejected += len(draft) - taken
                kept = tokens[:len(pending) + taken]
                ctx.seq_rm(0, len(done) + len(kept), -1)
                drafter.feed([(0, len(done), kept, 0)])
                done += kept
                pending = [chosen[taken]]
            history = done + pending
            assert rejected > 0
            incremental = drafter.draft([(0, history, 4)])[0]
            # the whole history at once, in seq id 1 of both contexts
            batch.clear()
            batch.add_tokens(history[:-1], 0, 1)
            assert ctx.decode(batch).name == "OK"
            drafter.feed([(1, 0, history[:-1], 0)])
            assert drafter.draft([(1, history, 4)])[0] == incremental
            assert len(incremental) == 4
        finally:
            drafter.close()


@pytest.mark.anyio
async def test_a_model_without_mtp_layers_is_refused(tiny_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="multi-token-prediction"):
        async with Engine(tiny_path, mtp=True):
            pass


@pytest.mark.anyio
async def test_an_mtp_head_llama_cpp_would_abort_on_is_refused(smollm2_path: Path, tmp_path: Path) -> None:
    """Two MTP blocks in GLM-4.5's layout (llama.cpp's head runs one, and asserts so), and DeepSeek
    V3's layout with an attention temperature (Mistral Large 3's): refused with the reason where
    llama.cpp would abort the whole process; both run without MTP."""
    two = write_mtp_model(tmp_path / "two-blocks.gguf", smollm2_path, agree=False, n_nextn=2)
    warm = write_deepseek_mtp_model(tmp_path / "warm.gguf", smollm2_path, agree=False, arch=DEEPSEEK2,
                                    temperature_scale=0.1)
    for model, reason in ((two, "2 MTP blocks.*give no mtp"), (warm, "attention temperature.*give no mtp")):
        with pytest.raises(UnsupportedModel, match=reason):
            async with Engine(model, n_ctx=512, mtp=True):
                pass
        async with Engine(model, n_ctx=512) as engine:
            assert len((await engine.conversation("Once upon a time").stream(max_tokens=4, **GREEDY)).tokens) == 4


@pytest.mark.anyio
async def test_an_embedding_model_refuses_drafts(smollm2_path: Path, tiny_path: Path) -> None:
    bert = bert_model(aiollama.cache_dir() / "test-models", smollm2_path)
    with pytest.raises(UnsupportedModel, match="embedding model.*give no mtp"):
        async with Engine(bert, mtp=True):
            pass
    with pytest.raises(UnsupportedModel, match="embedding model.*give no draft_model"):
        async with Engine(bert, draft_model=tiny_path):
            pass
    async with Engine(bert) as engine:  # and without drafts it embeds
        assert len((await engine.embed(["a cat"]))[0]) > 0


def test_mtp_settings() -> None:
    assert EngineConfig(mtp=True).draft_tokens == DRAFT_MODEL_TOKENS
    assert EngineConfig(mtp=True, draft_tokens=3).draft_tokens == 3
    with pytest.raises(InvalidRequestError, match="mtp"):
        EngineConfig(mtp="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="draft_model"):
        EngineConfig(mtp=True, draft_model="x.gguf")


def test_a_full_mtp_context_starts_afresh(agreeing: Path) -> None:
    with Model(agreeing, load_mtp=True) as model, Context(model, n_ctx=256, n_batch=256, n_seq_max=2) as ctx, \
            Batch(256) as batch:
        drafter = MtpDrafter(model, ctx, n_threads=1)  # as many cells as the target
        try:
            size = drafter.ctx.n_ctx * 3 // 5  # two of them do not fit
            histories = {}
            for seq_id in (0, 1):  # one at a time in the target, both in the MTP context
                ctx.seq_rm(0, 0, -1)
                history = [500 + 7 * seq_id + i for i in range(size)]
                batch.clear()
                batch.add_tokens(history, 0, 0, output_last=True)
                assert ctx.decode(batch).name == "OK"
                pending = greedy_rows(ctx, len(history) - 1, 1)[0]
                drafter.feed([(seq_id, 0, history, 0)])
                histories[seq_id] = history + [pending]
                if seq_id == 0:
                    first = drafter.draft([(0, histories[0], 2)])[0]
                    assert len(first) == 2 and drafter.resets == 0
            assert drafter.draft([(1, histories[1], 2)]) == [()]
            assert drafter.resets == 1
            assert drafter.draft([(0, histories[0], 2)]) == [()]  # its entries went too: none until fed again
        finally:
            drafter.close()
