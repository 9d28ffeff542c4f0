"""Speculation on a hybrid model (the tiny LFM2: short convolutions beside attention; a tiny
Qwen3.5 with an MTP block, and its MoE variant: gated delta nets beside attention; a tiny
Nemotron-H MoE with one: Mamba-2 layers beside attention; a tiny Bailing-MoE 3 with one: Kimi
delta attention beside latent attention; a tiny Qwen4-exp with one: gated delta nets beside a
sparse attention, in hyper-connections; a tiny DeepSeek V4 with one: attention over a window and
compressed blocks, whose compressors keep a state), whose recurrent state drops a rejected draft by rolling
back within its last decode (llama.cpp's snapshots, ``aiollama.runner.removal``): greedy text
identical to no drafts, with n-gram drafts, a draft model and MTP drafts, across streams, forks and
new turns; a model whose state llama.cpp cannot roll back refuses drafts, a request drafting more
than the snapshots hold is refused, and MTP is refused where llama.cpp does not run it or cannot
roll the state back (a tiny Qwen3-Next)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from helpers import gather
from tiny_model import lfm2_model, mamba_model
from tiny_mtp import hybrid_mtp_model, qwen35_mtp_model
from tiny_mtp_families import DEEPSEEK4, QWEN4EXP, deepseek4_mtp_model, qwen4exp_mtp_model

import aiollama
from aiollama import Engine, FinishReason
from aiollama.errors import InvalidRequestError, UnsupportedModel
from aiollama.sched.rowcost import RowCost

pytestmark = pytest.mark.anyio

PROMPTS = [[1, *([504, 3426, 314, 3599, 284] * 6)], [1, *([260, 2116, 1030] * 8)],
           [1, *([42, 43, 44, 45, 46, 47] * 4)], [1, 504, 3426, 314, 3599, 284, 260, 2116, 504, 3426]]
# a random model's text never repeats itself; biased to four tokens it does, in patterns that
# break off now and then: n-gram drafts are taken, and rejected
BIAS = {token: 40.0 for token in (500, 501, 502, 503)}
GREEDY: dict[str, Any] = dict(max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias=BIAS)
END = 2  # an end-of-generation token of SmolLM2's vocabulary


@pytest.fixture(autouse=True)
def unfitted_row_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is drafted here must not hang on the machine's load: the row cost (fitted from the
    steps' timings, sched/rowcost.py) stays unknown, and drafts follow the draft length's policy."""
    monkeypatch.setattr(RowCost, "fit", lambda self: None)


@pytest.fixture(scope="module")
def lfm2(smollm2_path: Path) -> Path:
    return lfm2_model(aiollama.cache_dir() / "test-models", smollm2_path)


@pytest.fixture(scope="module")
def qwen35_agree(smollm2_path: Path) -> Path:
    return qwen35_mtp_model(aiollama.cache_dir() / "test-models", smollm2_path, agree=True)


@pytest.fixture(scope="module")
def qwen35_random(smollm2_path: Path) -> Path:
    return qwen35_mtp_model(aiollama.cache_dir() / "test-models", smollm2_path, agree=False)


async def outputs(path: Path, sampling: dict[str, Any] = GREEDY, **options: Any) -> tuple[list[list[int]], Any]:
    async with Engine(path, n_ctx=2048, n_seq_max=4, **options) as engine:
        outs = await gather(*(engine.conversation(p).stream(**sampling) for p in PROMPTS))
        return [o.tokens for o in outs], engine.statistics()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
async def test_n_gram_drafts_on_a_hybrid_model_give_the_text_without_them(lfm2: Path, overlap: bool) -> None:
    plain, _ = await outputs(lfm2)
    drafted, stats = await outputs(lfm2, draft_tokens=4, overlap=overlap)
    assert drafted == plain
    # drafts were taken, and rejected ones rolled back (the text above depends on it)
    assert 0 < stats.accepted_tokens < stats.drafted_tokens, stats


async def test_streams_that_a_stop_string_ends_mid_step_go_on_as_without_drafts(lfm2: Path) -> None:
    """A stop string ends streams while overlapped steps with drafts are in flight (their rows
    thrown away: the state goes back to a checkpoint); the next turn gives the same text. The next
    turns run one after another: prompted together, which of them share a step depends on when
    the prompts arrive, and so may the rounding of their logits (one stream's second turn came out
    otherwise once in a full run, and never in forty runs of this test alone)."""
    stopping = {**GREEDY, "stop": [" k they they", " k k k"]}

    async def turns(**options: Any) -> tuple[list[tuple[str, list[int], FinishReason]], int]:
        async with Engine(lfm2, n_ctx=2048, n_seq_max=4, **options) as engine:
            convs = [engine.conversation(p) for p in PROMPTS]
            first = await gather(*(c.stream(**stopping) for c in convs))
            second = []
            for c in convs:
                c.prompt([504, 3426])
                second.append(await c.stream(**GREEDY))
            outs = [(o.text, o.tokens, o.finish_reason) for o in first + second]
            return outs, engine.statistics().discarded_tokens

    plain, _ = await turns()
    assert sum(reason is FinishReason.STOP for _, _, reason in plain[:4]) >= 2
    drafted, discarded = await turns(draft_tokens=4, overlap=True)
    assert drafted == plain
    assert discarded > 0  # rows of stopped streams were in flight, and thrown away


async def test_stop_strings_end_mtp_drafting_streams_mid_step_as_without_drafts(qwen35_agree: Path) -> None:
    """MTP drafts on the hybrid Qwen3.5, overlapped steps: stop strings (pieces of two plain
    replies) end streams while drafted rows are in flight; both turns as without drafts."""
    async def turns(stop: list[str], **options: Any) -> tuple[list[tuple[str, list[int], FinishReason]], Any]:
        async with Engine(qwen35_agree, n_ctx=2048, n_seq_max=4, **options) as engine:
            convs = [engine.conversation(p) for p in PROMPTS]
            first = await gather(*(c.stream(**{**GREEDY, "logit_bias": {}, "stop": stop}) for c in convs))
            for c in convs:
                c.prompt([504, 3426])
            second = await gather(*(c.stream(**{**GREEDY, "logit_bias": {}, "max_tokens": 30}) for c in convs))
            return [(o.text, o.tokens, o.finish_reason) for o in first + second], engine.statistics()

    replies = [text for text, _, _ in (await turns([]))[0][:2]]
    stop = [replies[0][len(replies[0]) // 3:][:6], replies[1][len(replies[1]) // 2:][:6]]
    plain, _ = await turns(stop)
    assert sum(reason is FinishReason.STOP for _, _, reason in plain[:4]) >= 2
    drafted, stats = await turns(stop, mtp=True, overlap=True)
    assert drafted == plain
    assert stats.accepted_tokens > 0 and stats.discarded_tokens > 0


async def test_a_draft_model_on_a_hybrid_model_gives_the_text_without_it(lfm2: Path, tiny_path: Path) -> None:
    plain, _ = await outputs(lfm2)
    drafted, stats = await outputs(lfm2, draft_model=tiny_path, draft_tokens=3)
    assert drafted == plain
    assert stats.drafted_tokens > stats.accepted_tokens  # a random draft model: rejected, rolled back


def mtp_hybrid(smollm2_path: Path, arch: str, agree: bool) -> Path:
    cache = aiollama.cache_dir() / "test-models"
    if arch == QWEN4EXP:
        return qwen4exp_mtp_model(cache, smollm2_path, agree=agree)
    if arch == DEEPSEEK4:
        return deepseek4_mtp_model(cache, smollm2_path, agree=agree)
    return hybrid_mtp_model(cache, smollm2_path, arch, agree=agree)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "nemotron_h_moe", "bailingmoe3", QWEN4EXP, DEEPSEEK4])
async def test_mtp_drafts_on_a_hybrid_model_give_the_text_without_them(smollm2_path: Path, arch: str,
                                                                       overlap: bool) -> None:
    """Qwen3.5's layout, Qwen3.5-MoE's (experts in every layer and in the MTP block), Nemotron-H
    MoE's (Mamba-2 layers; a head of its own kind), Bailing-MoE 3's (Kimi delta attention beside
    latent attention), Qwen4-exp's (hyper-connections, and a sparse attention that attends to
    the cells an indexer picks among pooled blocks) and DeepSeek V4's (a window beside compressed
    blocks, whose compressors keep a state per sequence; hyper-connections): llama.cpp runs the MTP block in a context of
    its own with an attention cache only, the target's recurrent state rolls back what the head
    guessed wrong."""
    unbiased = {**GREEDY, "logit_bias": {}}
    for agree in (True, False):
        model = mtp_hybrid(smollm2_path, arch, agree)
        plain, before = await outputs(model, unbiased)
        drafted, stats = await outputs(model, unbiased, mtp=True, overlap=overlap)
        assert drafted == plain
        if agree:  # every guess taken: a step gives several tokens
            assert stats.accepted_tokens == stats.drafted_tokens > 0 and stats.decode_steps < before.decode_steps / 3
        else:  # guessed wrong: rolled back
            assert stats.drafted_tokens > stats.accepted_tokens


async def test_mtp_on_qwen3_next_is_refused_where_llama_cpp_cannot_roll_its_state_back(smollm2_path: Path) -> None:
    """Qwen3-Next: llama.cpp at the pinned tag loads its MTP block and runs the head, but keeps no
    snapshots of its gated-delta-net state (``llm_arch_supports_rs_rollback``), so a rejected draft
    could not be dropped from it. The engine and the plan refuse MTP with a typed error that says
    what to change; the model itself runs, and gives the same text twice."""
    model = hybrid_mtp_model(aiollama.cache_dir() / "test-models", smollm2_path, "qwen3next", agree=True)
    with pytest.raises(UnsupportedModel, match=r"cannot roll back.*\(give no mtp\)"):
        async with Engine(model, n_ctx=512, n_seq_max=2, mtp=True):
            pass
    with pytest.raises(UnsupportedModel, match=r"\(give no mtp\)"):
        aiollama.plan(model, n_ctx=512, n_seq_max=2, mtp=True)
    first, _ = await outputs(model, {**GREEDY, "logit_bias": {}})
    again, stats = await outputs(model, {**GREEDY, "logit_bias": {}})
    assert first == again and all(len(tokens) == 40 for tokens in first)
    assert stats.drafted_tokens == 0


@pytest.mark.parametrize("drafts", ["n-gram", "mtp", "mtp-nemotron", "mtp-bailing", "mtp-qwen4exp", "mtp-deepseek4"])
async def test_forks_and_turns_after_drafts_give_what_a_fresh_conversation_gives(drafts: str, smollm2_path: Path,
                                                                                 request: pytest.FixtureRequest) -> None:
    """A fork or a new turn copies (or shares) the state a drafted step left, rollback and all:
    replies of several lengths, and replies that an end token, made likelier, ends on a row of a
    draft, the rows after it cut back just before the fork copies the state (random models: a state
    with the rejected tokens in it would change the text)."""
    if drafts == "n-gram":
        model, options = request.getfixturevalue("lfm2"), {"draft_tokens": 4}
        ending: dict[str, Any] = {**GREEDY, "ignore_eos": False, "logit_bias": {**BIAS, END: 38.0}}
        cases = [(PROMPTS[0], {**GREEDY, "max_tokens": n}) for n in range(6, 30, 2)]
    else:
        arch = {"mtp": "qwen35", "mtp-nemotron": "nemotron_h_moe", "mtp-bailing": "bailingmoe3",
                "mtp-qwen4exp": QWEN4EXP, "mtp-deepseek4": DEEPSEEK4}[drafts]
        model = mtp_hybrid(smollm2_path, arch, False)
        options = {"mtp": True}
        ending, cases = {**GREEDY, "ignore_eos": False, "logit_bias": {END: 35.0}}, []
    cases += [([*PROMPTS[0], 100 + i], ending) for i in range(12)]
    expected: list[tuple[list[int], list[int], list[int]]] = []  # (history after the reply, fork's, next turn's)
    async with Engine(model, n_ctx=2048, n_seq_max=4) as plain:
        for n, (prompt, sampling) in enumerate(cases):
            conv = plain.conversation(prompt, cache_salt=f"a{n}")
            await conv.stream(**sampling)
            history = list(conv.tokens)
            fork = (await plain.conversation(history + [504], cache_salt=f"b{n}").stream(**GREEDY)).tokens
            turn = (await plain.conversation(history + [505], cache_salt=f"c{n}").stream(**GREEDY)).tokens
            expected.append((history, fork, turn))
    cut_at_the_end = 0
    async with Engine(model, n_ctx=4096, n_seq_max=4, **options) as engine:
        for n, ((prompt, sampling), (history, fork, turn)) in enumerate(zip(cases, expected)):
            conv = engine.conversation(prompt, cache_salt=str(n))
            reply = await conv.stream(**sampling)
            assert list(conv.tokens) == history
            assert reply.stats is not None
            cut_at_the_end += reply.finish_reason is FinishReason.EOG and reply.stats.accepted < reply.stats.drafted
            child = conv.fork()
            child.prompt([504])
            conv.prompt([505])
            got_fork = await child.stream(**GREEDY)  # first: the parent's state is still the reply's end
            got_turn = await conv.stream(**GREEDY)
            assert (got_fork.tokens, got_turn.tokens) == (fork, turn), n
            # the whole state is shared (with the reply's last token when a draft took it)
            assert got_fork.stats is not None and got_fork.stats.cached_tokens >= len(history) - 1
            await gather(conv.aclose(), child.aclose())
        assert engine.statistics().drafted_tokens > engine.statistics().accepted_tokens
    assert cut_at_the_end > 0


async def test_a_model_whose_state_cannot_roll_back_refuses_drafts(smollm2_path: Path, lfm2: Path) -> None:
    mamba = mamba_model(aiollama.cache_dir() / "test-models", smollm2_path)
    with pytest.raises(UnsupportedModel, match="cannot roll back.*draft_tokens=0"):
        async with Engine(mamba, n_ctx=256, draft_tokens=4):
            pass
    with pytest.raises(UnsupportedModel, match="give no mtp"):
        async with Engine(lfm2, n_ctx=256, mtp=True):
            pass
    with pytest.raises(UnsupportedModel, match="draft model .* recurrent or hybrid"):
        async with Engine(smollm2_path, n_ctx=256, draft_model=lfm2):
            pass
    async with Engine(mamba, n_ctx=256) as engine:  # without drafts it serves; a request's own are refused
        conv = engine.conversation([1, 504, 3426, 314] * 4)
        with pytest.raises(InvalidRequestError, match="draft_tokens=4: .* at most 0 tokens"):
            await conv.stream(max_tokens=12, temperature=0.0, ignore_eos=True, draft_tokens=4)
        out = await conv.stream(max_tokens=12, temperature=0.0, ignore_eos=True, draft_tokens=0)
        assert len(out.tokens) == 12 and engine.statistics().drafted_tokens == 0


async def test_a_request_drafting_more_than_the_state_rolls_back_is_refused_and_the_others_go_on(
        lfm2: Path) -> None:
    async with Engine(lfm2, n_ctx=2048, n_seq_max=4, draft_tokens=2) as engine:
        async def refused_then_shorter() -> Any:
            await anyio.sleep(0.05)  # the others are running
            with pytest.raises(InvalidRequestError, match="draft_tokens=3: .* at most 2 tokens"):
                await engine.conversation(PROMPTS[2]).stream(**{**GREEDY, "draft_tokens": 3})
            return await engine.conversation(PROMPTS[2]).stream(**{**GREEDY, "draft_tokens": 1})

        outs = await gather(*(engine.conversation(p).stream(**GREEDY) for p in PROMPTS[:2]), refused_then_shorter())
        assert [len(o.tokens) for o in outs] == [40] * 3
        assert engine.statistics().accepted_tokens > 0
