"""Whether a draft token pays: the fit of a step's time against its rows, the draft length it
allows, and an engine whose fake decodes cost per row (a CPU) or per step (a GPU)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from fake_executor import FakeExecutor
from helpers import gather

from aiollama import Engine, EngineConfig
from aiollama.sched.rowcost import MIN_STEPS, RowCost
from aiollama.sched.speculation import DraftLength
from aiollama.sched.step import Plan, StepResult

GREEDY: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)


def test_the_fit_finds_the_fixed_and_the_per_row_time() -> None:
    cost = RowCost()
    for i in range(MIN_STEPS - 1):
        cost.add(1 + i % 8, 0.010 + 0.001 * (1 + i % 8))
    assert cost.fit() is None and cost.shares() is None  # too few steps yet
    for i in range(40):
        cost.add(1 + i % 8, 0.010 + 0.001 * (1 + i % 8))
    fixed, per_row = cost.fit()  # type: ignore[misc]
    assert fixed == pytest.approx(0.010) and per_row == pytest.approx(0.001)
    share = cost.shares()
    assert share is not None and share(8) == pytest.approx(8 / 18) and share(0) == 0.0


def test_steps_of_one_size_tell_nothing() -> None:
    cost = RowCost()
    for _ in range(50):
        cost.add(8, 0.02)
    assert cost.fit() is None and cost.shares() is None


def test_a_draft_token_pays_where_it_is_taken_more_often_than_a_row_costs() -> None:
    length = DraftLength(8)
    assert length.worth(0.0) == 8  # nothing known: the length's own policy
    assert length.worth(0.4) == 1  # the prior: one of two taken
    assert length.worth(0.6) == 0
    length.record(8, 7)
    length.record(2, 2)  # 10 of 10 with the prior: 10 / 12
    assert length.worth(0.5) == 3  # 0.83, 0.69, 0.58, then 0.48


class Timed(FakeExecutor):
    """Decodes that take ``fixed + per_row * rows`` seconds (as the step's result says), of a model
    that copies the token 7 back but every fifth, which it makes up: drafts are taken in part."""

    def __init__(self, config: EngineConfig, fixed: float, per_row: float) -> None:
        super().__init__(config, period=7)
        self.fixed, self.per_row = fixed, per_row
        self._rows = 0

    def _choose(self, conv: int, history: list[int]) -> tuple[int, bool]:
        if len(history) % 5 == 0:
            return 65 + (len(history) * 7) % 26, False
        return history[-7], False

    def _execute(self, plan: Plan, discard: frozenset[int] = frozenset()) -> StepResult:
        result = super()._execute(plan, discard)
        rows = sum(len(s.tokens) for s in plan.slices)
        return dataclasses.replace(result, decode_seconds=self.fixed + self.per_row * rows)


async def drafted(fixed: float, per_row: float, streams: int = 8) -> tuple[int, int]:
    async with Engine(executor=lambda c: Timed(c, fixed, per_row), n_ctx=4096, n_seq_max=streams,
                      draft_tokens=8, overlap=False) as engine:
        prompt = [65 + i % 26 for i in range(20)]
        convs = [engine.conversation(prompt) for _ in range(streams)]
        for c in convs:
            await c.stream(max_tokens=4, **GREEDY)  # steps of several sizes: the fit can tell
        stats = engine.statistics()
        before = (stats.drafted_tokens, stats.accepted_tokens)
        await gather(*[c.stream(max_tokens=60, **GREEDY) for c in convs])
        stats = engine.statistics()
        return stats.drafted_tokens - before[0], stats.accepted_tokens - before[1]


@pytest.mark.anyio
async def test_rows_that_cost_their_own_compute_draft_only_what_is_taken_often() -> None:
    """Eight streams whose drafts are taken in part: where a step's time is all rows (a CPU) the
    drafts shrink to what is taken often; where it is all fixed (a GPU) they run long."""
    cpu_drafted, cpu_taken = await drafted(0.002, 0.001)
    gpu_drafted, gpu_taken = await drafted(0.020, 0.00001)
    assert gpu_taken > cpu_taken
    assert cpu_drafted - cpu_taken < (gpu_drafted - gpu_taken) / 2


@pytest.mark.anyio
async def test_where_rows_cost_next_to_nothing_a_full_step_drafts_too() -> None:
    """32 streams fill what a step's drafts could take while the row cost is not known; once it
    is, drafts go on where it is fixed (a GPU: many streams' drafts in one step, up to the batch)
    and stay few where it is all rows (a CPU)."""
    gpu_drafted, gpu_taken = await drafted(0.020, 0.00001, streams=32)
    cpu_drafted, cpu_taken = await drafted(0.002, 0.001, streams=32)
    assert gpu_drafted > 32 * 8 and gpu_taken > 50  # (480 and 96 when written; none while 32 rows capped drafts)
    assert cpu_drafted < gpu_drafted / 4
