"""A generation's first token is handed to its consumer before the next decode starts, where no
other stream waits for that decode; the wait never outlasts ``HAND_OVER_SECONDS``, and a stream
already running never waits for someone else's first token."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from fake_executor import FakeExecutor

import aiollama.core.engine_core as engine_core
from aiollama import Engine, EngineConfig, Stream
from aiollama.sched.step import Plan, StepResult

pytestmark = pytest.mark.anyio
GREEDY: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)


class Watched(FakeExecutor):
    """Records, as each decode is entered, which consumers have their first chunk by then."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.got: dict[str, bool] = {}  # consumer -> has its first chunk (set from its event loop)
        self.entries: list[tuple[int, dict[str, bool]]] = []  # (rows decoded, what the consumers had)
        self.lock = threading.Lock()

    def execute(self, plan: Plan, on_decode: Callable[[], None] | None = None) -> StepResult:
        if plan.slices:
            with self.lock:
                self.entries.append((sum(len(s.tokens) for s in plan.slices), dict(self.got)))
        return super().execute(plan, on_decode)

    def first(self, name: str) -> None:
        with self.lock:
            self.got.setdefault(name, True)


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hand-over that cannot run out: without one, a loop is woken only as the next decode
    starts, so its consumer never has its first chunk when that decode is entered."""
    monkeypatch.setattr(engine_core, "HAND_OVER_SECONDS", 60.0)


def watching() -> tuple[Callable[[EngineConfig], Watched], list[Watched]]:
    """An executor factory for ``Engine(executor=...)``, and the list that will hold what it made."""
    made: list[Watched] = []

    def executor(config: EngineConfig) -> Watched:
        made.append(Watched(config))
        return made[0]
    return executor, made


async def read(watched: Watched, name: str, stream: Stream) -> None:
    """Read ``stream`` to its end, telling ``watched`` once its first tokens have come."""
    async for chunk in stream:
        if chunk.tokens:
            watched.first(name)


@pytest.mark.usefixtures("patient")
async def test_a_lone_stream_s_first_token_reaches_its_loop_before_the_next_decode() -> None:
    executor, made = watching()
    async with Engine(executor=executor, n_ctx=512, n_seq_max=4) as engine:
        watched = made[0]
        await read(watched, "lone", engine.conversation("a prompt of some length").stream(max_tokens=6, **GREEDY))
    prompt_step, next_step = watched.entries[0], watched.entries[1]
    assert prompt_step == (len(b"a prompt of some length"), {})
    assert next_step == (1, {"lone": True})


@pytest.mark.usefixtures("patient")
async def test_a_running_stream_does_not_wait_for_a_newcomer_s_first_token() -> None:
    executor, made = watching()
    async with Engine(executor=executor, n_ctx=8192, n_seq_max=4) as engine:
        watched = made[0]
        running = engine.conversation("first").stream(max_tokens=8000, **GREEDY)  # on until cancelled
        async for chunk in running:
            if chunk.tokens:
                break  # it runs on, unread: every later step has a stream waiting for it
        steps = len(watched.entries)
        await read(watched, "newcomer", engine.conversation("a newcomer's prompt").stream(max_tokens=4, **GREEDY))
        running.cancel()
    later = watched.entries[steps:]
    joined = next(i for i, (rows, _) in enumerate(later) if rows > 1)  # the newcomer's prompt
    assert later[joined + 1][1] == {}  # the step after it did not wait for the newcomer's loop


async def test_a_loop_that_does_not_come_holds_the_engine_no_longer_than_the_bound() -> None:
    async with Engine(executor=FakeExecutor, n_ctx=512, n_seq_max=4) as engine:
        before = engine.statistics().tokens_generated
        stream = engine.conversation("blocked").stream(max_tokens=40, **GREEDY)
        time.sleep(0.5)  # this event loop runs nothing meanwhile: not the first token's delivery either
        during = engine.statistics().tokens_generated - before
        done = await stream
    assert during == 40  # the engine went on after HAND_OVER_SECONDS, and finished the stream
    assert len(done.tokens) == 40
    assert engine_core.HAND_OVER_SECONDS <= 0.01
