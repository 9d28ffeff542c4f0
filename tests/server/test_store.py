"""The store of responses kept for ``previous_response_id``: bounded by count, time and bytes (a
stored conversation's KV cells and pictures counted), expired entries swept without being read,
and a dropped response's conversation closed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from fake_executor import FakeExecutor
from starlette.testclient import TestClient

from aiollama import Engine
from aiollama.server import create_app
from aiollama.server.store import ResponseStore, Sizing


@dataclass
class Conv:
    tokens: tuple[int, ...]
    closed: bool = field(default=False)

    def close_nowait(self) -> None:
        self.closed = True


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def response(n: int) -> dict[str, Any]:
    return {"id": f"resp_{n}", "output": []}


def test_the_oldest_go_past_the_count() -> None:
    store = ResponseStore(max_items=2, ttl=60)
    convs = [Conv((1, 2, 3)) for _ in range(3)]
    for i, conv in enumerate(convs):
        store.put(response(i), conv)  # type: ignore[arg-type]
    assert list(store.items) == ["resp_1", "resp_2"] and convs[0].closed and not convs[1].closed
    assert store.dropped["count"] == 1


def test_expired_responses_are_swept_without_being_read() -> None:
    clock = Clock()
    store = ResponseStore(ttl=10, clock=clock)
    convs = [Conv((1,)), Conv((2,))]
    store.put(response(0), convs[0])  # type: ignore[arg-type]
    clock.now = 5
    store.put(response(1), convs[1])  # type: ignore[arg-type]
    clock.now = 11
    assert store.sweep() == 1 and convs[0].closed and not convs[1].closed
    assert "resp_0" not in store.items and store.get("resp_1") is not None
    clock.now = 16
    assert store.get("resp_1") is None and convs[1].closed and store.size == 0 and store.dropped["expired"] == 2


def test_bytes_count_the_cells_and_pictures_a_conversation_holds() -> None:
    store = ResponseStore(max_bytes=10_000, ttl=60)
    store.sizing = Sizing(cell_bytes=100, row_bytes=1000)
    text, pictured = Conv(tuple(range(20))), Conv((1, 2, -1, -2, -3, 5))
    store.put(response(0), text)  # type: ignore[arg-type]
    plain = store.size
    assert plain >= 20 * 100
    store.put(response(1), pictured)  # type: ignore[arg-type]
    assert store.size - plain >= 6 * 100 + 3 * 1000
    bigger = Conv(tuple(range(60)))  # 6,000 bytes of cells: the oldest must go to make room
    store.put(response(2), bigger)  # type: ignore[arg-type]
    assert text.closed and store.size <= 10_000 and store.dropped["bytes"] >= 1
    alone = Conv(tuple(range(200)))  # larger than the whole budget: never kept
    store.put(response(3), alone)  # type: ignore[arg-type]
    assert alone.closed and "resp_3" not in store.items


def test_bad_bounds_are_refused() -> None:
    for bad in ({"max_items": -1}, {"ttl": 0}, {"max_bytes": -5}):
        with pytest.raises(ValueError):
            ResponseStore(**bad)


def test_an_expired_conversation_frees_its_hold_without_being_read() -> None:
    engine = Engine(executor=FakeExecutor, n_ctx=512, n_seq_max=4, n_batch=64)
    app = create_app(engine=engine, responses_ttl=0.5)
    with TestClient(app) as client:
        client.portal.call(engine.start)  # type: ignore[union-attr]
        answer = client.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 3})
        assert answer.status_code == 200, answer.text
        store = app.state.aiollama.responses
        assert store.sizing.cell_bytes == 64 and len(store.items) == 1
        assert store.size >= 64 * len(next(iter(store.items.values())).conv.tokens)
        live = engine.statistics().live
        assert live >= 1
        deadline = time.monotonic() + 10
        while store.items and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not store.items and store.dropped["expired"] == 1  # swept: nobody asked for it
        while engine.statistics().live >= live and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.statistics().live == live - 1
        assert client.get(f"/v1/responses/{answer.json()['id']}").status_code == 404
        client.portal.call(engine.aclose)  # type: ignore[union-attr]
