"""N-gram speculation: drafts from a conversation's own history save decode steps and never change
the text (greedy or seeded), whatever ends the stream in the middle of a draft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fake_executor import FakeExecutor

from aiollama import Engine, EngineConfig, InvalidRequestError
from aiollama.sched.speculation import DraftLength, draft

GREEDY: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)


# drafting


@pytest.mark.parametrize(("tokens", "limit", "expected"), [
    ([1, 2, 3, 4, 9, 1, 2, 3], 4, (4, 9, 1, 2)),  # after the latest earlier "1 2 3"
    ([1, 2, 3, 4, 9, 1, 2, 3], 2, (4, 9)),
    ([5, 1, 2, 7, 1, 2, 8, 1, 2], 3, (8, 1, 2)),  # the latest occurrence wins
    ([1, 2, 3, 4], 4, ()),  # no earlier occurrence
    ([7, 7, 7, 7], 3, (7,)),  # overlapping: the continuation is the history's own end
    ([1, 2, 3], 0, ()),
    ([], 4, ()),
    ([256, 1, 256, 1], 2, (256, 1)),  # ids whose bytes could match misaligned
    ([65536 + 1, 2, 1, 65536 + 1, 2], 1, (1,)),
])
def test_draft(tokens: list[int], limit: int, expected: tuple[int, ...]) -> None:
    assert draft(tokens, limit) == expected


def test_a_misaligned_byte_match_is_not_a_token_match() -> None:
    # 0x00000100 then 0x00000002: bytes "00 01 00 00 02 00 00 00"; a byte search for the 2-gram
    # (1, 512) = "01 00 00 00 00 02 00 00" finds nothing aligned
    assert draft([256, 2, 1, 512, 7, 1, 512], 3) == (7, 1, 512)


def test_draft_length_adapts() -> None:
    length = DraftLength(8)
    assert length.current == 2  # it starts short: a draft that does not agree costs little
    length.record(2, 2)
    length.record(4, 4)
    assert length.current == 8
    length.record(8, 0)
    length.record(4, 0)
    assert length.current == 2
    length.record(2, 2)
    assert length.current == 4
    length.record(4, 1)
    assert length.current == 3  # what was taken and two more
    length.record(3, 3)
    length.record(6, 5)
    assert length.current == 7
    length.record(7, 7)
    assert length.current == 8  # never past the limit
    assert (length.drafted, length.accepted) == (40, 24)


def test_a_first_draft_partly_taken_goes_on_and_a_rejected_one_pauses_only_while_nothing_was_taken() -> None:
    length = DraftLength(8)
    length.record(2, 1)
    assert length.offer() == 3
    length.record(3, 0)
    assert length.offer() == 1  # a token was taken before: halve, no pause
    fresh = DraftLength(8)
    fresh.record(2, 0)
    assert fresh.offer() == 0  # nothing taken yet: pause


def test_drafts_that_never_agree_pause_longer_and_longer_and_resume_when_one_does() -> None:
    from aiollama.sched.speculation import PAUSE_GROWTH, PAUSE_MAX, PAUSE_MIN

    length = DraftLength(8)
    offered = []
    for _ in range(600):  # every draft rejected
        n = length.offer()
        offered.append(n)
        if n:
            length.record(n, 0)
    # the first draft rejected whole: no second try before a pause
    assert offered[:1 + PAUSE_MIN] == [2] + [0] * PAUSE_MIN
    assert offered[1 + PAUSE_MIN] == 1  # a probe after the pause
    second = 2 + PAUSE_MIN + PAUSE_MIN * PAUSE_GROWTH  # the next one after a longer pause
    assert offered[2 + PAUSE_MIN:second] == [0] * (second - 2 - PAUSE_MIN) and offered[second] == 1
    assert [n for n in offered[:96] if n] == [2, 1, 1]  # a 96-token reply tries 4 draft rows
    assert sum(1 for n in offered if n) < 8  # 600 decodes, a handful of draft rows
    assert length.pause == PAUSE_MAX
    while length.offer() == 0:
        pass
    length.record(1, 1)  # the probe is taken: drafting grows again
    assert length.pause == PAUSE_MIN and [length.offer() for _ in range(1)] == [2]


# the engine, against a fake model that copies its history


class Copier:
    def __init__(self, period: int | None = 7, eog_every: int | None = None) -> None:
        self.period, self.eog_every = period, eog_every
        self.executor: FakeExecutor | None = None

    def __call__(self, config: EngineConfig) -> FakeExecutor:
        self.executor = FakeExecutor(config, period=self.period, eog_every=self.eog_every)
        return self.executor


PROMPT = [65 + i % 26 for i in range(20)]


async def run(engine_draft: int, period: int | None = 7, **params: Any) -> tuple[list[int], list[int], int, Any]:
    copier = Copier(period)
    async with Engine(executor=copier, n_ctx=512, n_seq_max=4, draft_tokens=engine_draft) as engine:
        conv = engine.conversation(PROMPT)
        result = await conv.stream(**params)
        steps = engine.statistics().decode_steps
        again = await conv.stream(max_tokens=5, **GREEDY)  # the history the next stream continues
        return result.tokens, list(conv.tokens) + again.tokens, steps, result.stats


@pytest.mark.anyio
async def test_drafts_save_steps_and_change_nothing() -> None:
    plain, plain_history, plain_steps, _ = await run(0, max_tokens=64, **GREEDY)
    fast, fast_history, fast_steps, stats = await run(8, max_tokens=64, **GREEDY)
    assert fast == plain and fast_history == plain_history
    assert fast_steps * 3 < plain_steps
    assert stats.drafted >= stats.accepted > 40


@pytest.mark.anyio
@pytest.mark.parametrize("params", [
    {"max_tokens": 13},  # the limit falls inside a draft
    {"max_tokens": 64, "stop": ["DEF"]},  # so does a stop string
])
async def test_an_end_inside_a_draft_leaves_a_consistent_history(params: dict[str, Any]) -> None:
    plain = await run(0, **params, **GREEDY)
    fast = await run(8, **params, **GREEDY)
    assert fast[0] == plain[0] and fast[1] == plain[1]


@pytest.mark.anyio
async def test_drafts_that_miss_cost_nothing_but_rows() -> None:
    plain, plain_history, _, _ = await run(0, period=None, max_tokens=40, **GREEDY)
    fast, fast_history, _, stats = await run(8, period=None, max_tokens=40, **GREEDY)
    assert fast == plain and fast_history == plain_history
    assert stats.accepted < stats.drafted


@pytest.mark.anyio
async def test_the_engine_counts_the_draft_tokens_and_those_taken() -> None:
    async with Engine(executor=Copier(7), n_ctx=512, n_seq_max=4, draft_tokens=8) as engine:
        result = await engine.conversation(PROMPT).stream(max_tokens=64, **GREEDY)
        stats = engine.statistics()
    assert result.stats is not None and stats.drafted_tokens == result.stats.drafted > 0
    assert stats.accepted_tokens == result.stats.accepted > 0


@pytest.mark.anyio
async def test_streams_choose_per_stream() -> None:
    _, _, steps_off, stats = await run(8, max_tokens=32, draft_tokens=0, **GREEDY)
    assert stats.drafted == 0 and steps_off >= 32
    _, _, steps_on, stats = await run(0, max_tokens=32, draft_tokens=4, **GREEDY)
    assert 0 < stats.drafted and steps_on < steps_off


def test_bad_draft_settings() -> None:
    with pytest.raises(InvalidRequestError, match="draft_tokens"):
        EngineConfig(draft_tokens=-1)
    with pytest.raises(InvalidRequestError, match="draft_tokens"):
        EngineConfig(draft_tokens=1000)


# a real model


COPY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. She lit the great lamp, "
        "wound the clockwork that turned the lens, and wrote the weather in her logbook. ")


@pytest.mark.anyio
@pytest.mark.smollm2
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}])
async def test_smollm2_text_is_the_same_with_drafts(smollm2_path: Path, sampling: dict[str, Any]) -> None:
    texts, stats = [], []
    for draft_tokens in (0, 8):
        async with Engine(smollm2_path, n_ctx=2048, draft_tokens=draft_tokens) as engine:
            conv = engine.conversation()
            result = await conv.chat("Repeat this text exactly:\n\n" + COPY * 2, max_tokens=96, **sampling)
            texts.append(result.tokens)
            stats.append((engine.statistics().decode_steps, result.stats))
    assert texts[0] == texts[1]
    if sampling["temperature"] == 0.0:
        assert stats[1][1].accepted > 20 and stats[1][0] < stats[0][0] / 2
