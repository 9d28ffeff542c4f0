"""Delivery into event loops: posting and waking, and a stream's inbox, on asyncio and trio."""

from __future__ import annotations

import functools

import anyio
import pytest

from aiollama.api.portal import AsyncSink, current_portal
from aiollama.core.outputs import Delta
from aiollama.errors import EngineDead

pytestmark = pytest.mark.anyio


async def _read_into(sink: AsyncSink, got: list[object]) -> None:
    got.append(await sink.get())


async def test_a_reader_waits_until_an_item_is_delivered() -> None:
    sink = AsyncSink(current_portal())
    got: list[object] = []
    read = functools.partial(_read_into, sink, got)

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await anyio.wait_all_tasks_blocked()
        assert got == []
        item = Delta("a", (97,))
        sink.deliver(item)
    assert got == [item]


async def test_a_cancelled_reader_leaves_the_other_waiting_and_woken() -> None:
    sink = AsyncSink(current_portal())
    got: list[object] = []
    read = functools.partial(_read_into, sink, got)

    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as first:
            async with anyio.create_task_group() as inner:
                inner.start_soon(read)
                tg.start_soon(read)
                await anyio.wait_all_tasks_blocked()
                first.cancel()
        await anyio.wait_all_tasks_blocked()
        assert got == []
        item = Delta("b", (98,))
        sink.deliver(item)  # the reader left waiting gets it; the cancelled one took nothing
    assert got == [item]
    sink.deliver(Delta("c", (99,)))
    assert (await sink.get()).text == "c"


async def test_what_is_sent_runs_on_the_loop_only_once_woken_and_in_order() -> None:
    portal = current_portal()
    ran: list[int] = []
    assert portal.send(lambda: ran.append(1))
    assert portal.send(lambda: ran.append(2))
    await anyio.wait_all_tasks_blocked()
    assert ran == []  # nothing runs before a wake
    portal.wake()
    portal.wake()  # a second wake before the loop ran: not asked twice
    await anyio.wait_all_tasks_blocked()
    assert ran == [1, 2]
    assert portal.send(lambda: ran.append(3))
    portal.wake()  # after a run, the next post needs a wake of its own
    await anyio.wait_all_tasks_blocked()
    assert ran == [1, 2, 3]


async def test_a_waiting_reader_of_an_engine_that_ended_gets_its_error() -> None:
    failure: list[BaseException] = []
    sink = AsyncSink(current_portal(), failure=lambda: failure[0] if failure else None)
    got: list[object] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(_read_into, sink, got))
        await anyio.wait_all_tasks_blocked()
        failure.append(EngineDead("gone"))  # the engine ended without answering this reader
        with anyio.fail_after(10):
            while not got:
                await anyio.sleep(0.05)
    (item,) = got
    assert isinstance(item, Delta) and isinstance(item.error, EngineDead)
