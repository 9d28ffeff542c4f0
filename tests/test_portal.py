"""Delivery into event loops: the wake pipe and a stream's inbox, on asyncio and trio."""

from __future__ import annotations

import functools
import os

import anyio
import pytest

from aiollama.boundary import Delta
from aiollama.portal import WAKE_READ, AsyncSink, current_portal

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


async def test_the_wake_pipe_is_emptied_however_much_was_written() -> None:
    portal = current_portal()
    pipe = portal._pipe  # type: ignore[union-attr]
    ran: list[int] = []
    pipe.post(lambda: ran.append(1))
    os.write(pipe.wake_fd, b"x" * (3 * WAKE_READ + 5))
    pipe.run_posted()
    assert ran == [1]
    with pytest.raises(BlockingIOError):
        os.read(pipe._read, 1)
    os.write(pipe.wake_fd, b"x" * WAKE_READ)  # exactly one read's worth
    pipe.run_posted()
    with pytest.raises(BlockingIOError):
        os.read(pipe._read, 1)
