"""Background responses: a generation detached from its connection, polled, rejoined mid-stream
after the client dropped (no event lost or repeated), and cancelled; driven by the official openai
client and httpx against a real server process."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import httpx
import pytest
from server_process import Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.anyio

SERVER_OPTIONS = ("--n-ctx", "8192", "--n-seq-max", "4", "--model-name", "tiny", "--log-level", "warning")
ASK = {"model": "tiny", "input": "Tell me about the sea.", "temperature": 0}


def events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


async def poll(c: Any, response_id: str) -> Any:
    deadline = time.monotonic() + 60
    while True:
        found = await c.responses.retrieve(response_id)
        if found.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return found
        await anyio.sleep(0.05)


async def test_a_background_response_is_polled_to_the_same_answer(server: Server) -> None:
    async with server.client() as c:
        foreground = await c.responses.create(**ASK, max_output_tokens=16)
        started = await c.responses.create(**ASK, max_output_tokens=16, background=True)
        assert started.background and started.status in ("in_progress", "completed")
        done = await poll(c, started.id)
        assert done.status == "incomplete" and done.output_text == foreground.output_text
        follow_up = await c.responses.create(model="tiny", input="And the sky?", previous_response_id=done.id,
                                             max_output_tokens=4, temperature=0)
        assert follow_up.output_text  # a background response is stored, and continued as any other


async def test_a_dropped_client_rejoins_mid_stream_without_losing_or_repeating_an_event(server: Server) -> None:
    async with server.client() as c:
        foreground = await c.responses.create(**ASK, max_output_tokens=60)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        first: list[str] = []
        async with http.stream("POST", "/v1/responses", json={**ASK, "max_output_tokens": 60, "background": True,
                                                               "stream": True}) as answer:
            async for line in answer.aiter_lines():
                first.append(line)
                if len(events(first)) == 6:
                    break  # the client drops here
        seen = events(first)
        response_id = seen[0]["response"]["id"]
        rest: list[str] = []
        async with http.stream("GET", f"/v1/responses/{response_id}",
                               params={"stream": "true", "starting_after": seen[-1]["sequence_number"]}) as again:
            async for line in again.aiter_lines():
                rest.append(line)
        whole = seen + events(rest)
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    assert whole[-1]["type"] == "response.incomplete"
    text = "".join(e["delta"] for e in whole if e["type"] == "response.output_text.delta")
    assert text == foreground.output_text == whole[-1]["response"]["output"][0]["content"][0]["text"]


async def test_a_background_response_is_cancelled(server: Server) -> None:
    async with server.client() as c:
        started = await c.responses.create(**ASK, max_output_tokens=4000, background=True)
        cancelled = await c.responses.cancel(started.id)
        assert cancelled.status == "cancelled"
        assert (await c.responses.retrieve(started.id)).status == "cancelled"
        stored = await c.responses.create(**ASK, max_output_tokens=2)
        with pytest.raises(openai.BadRequestError):
            await c.responses.cancel(stored.id)  # only a background response can be
        with pytest.raises(openai.NotFoundError):
            await c.responses.cancel("resp_" + "0" * 32)
        with pytest.raises(openai.BadRequestError):
            await c.responses.create(**ASK, background=True, store=False)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        late = await http.get(f"/v1/responses/{started.id}", params={"stream": "true", "starting_after": 0})
        assert late.status_code == 200 and "response.in_progress" in late.text  # its events stay to be replayed
