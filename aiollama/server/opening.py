"""The opening and the waiting of every generating route, written once: the caller's slot held,
the pictures of its messages read, the generation started (the slot given back if that fails), and
then either server-sent events or a whole answer that a client going away cancels."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse

from aiollama.server.images import read_images
from aiollama.server.state import State, serving_engine

T = TypeVar("T")

# One encoder for every event (json.dumps with an option makes one per call): the text as it is,
# not escaped to ASCII
json_text = json.JSONEncoder(ensure_ascii=False).encode


def data_event(payload: Any) -> str:
    """A server-sent event of ``payload`` as JSON."""
    return f"data: {json_text(payload)}\n\n"


async def open_route(state: State, request: HttpRequest, messages: list[dict[str, Any]] | None,
                     start: Callable[[], T]) -> tuple[T, Callable[[], None]]:
    """What ``start`` started, and the release of the caller's slot (held until the answer ends)."""
    release = state.guard.hold(getattr(request.state, "api_key", ""))
    try:
        if messages is not None:
            await read_images(serving_engine(state), messages, state.fetcher)
        return start(), release
    except BaseException:
        release()
        raise


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events, never cached or buffered on the way."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def while_connected(request: HttpRequest, work: Callable[[], Awaitable[None]]) -> bool:
    """Run ``work`` while the client stays: True once it is done, False if the client went away
    first (``work`` is then cancelled, and with it the generation)."""
    finished = False
    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_on_disconnect, request, tg.cancel_scope)
        await work()
        finished = True
        tg.cancel_scope.cancel()
    return finished


async def cancel_on_disconnect(request: HttpRequest, scope: anyio.CancelScope) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
