"""OpenAI's Responses API over live conversations, driven by the official openai client against a
real server process: a stored response's conversation goes on with only the new input evaluated."""

from __future__ import annotations

import json
from typing import Any

import pytest
from server_process import TIMEOUT, Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}



SERVER_OPTIONS = ("--n-ctx", "8192", "--n-seq-max", "4", "--model-name", "tiny", "--log-level", "warning")


def client(server: Server) -> Any:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


async def test_four_turns_each_evaluate_only_their_new_input(server: Server) -> None:
    async with client(server) as c:
        first = await c.responses.create(model="tiny", input="Tell me about the sea.", instructions="Be brief.",
                                         max_output_tokens=12, temperature=0)
        assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
        assert first.output_text and first.usage.output_tokens == 12
        usages, previous = [first.usage], first
        for question in ("And the mountains?", "And the rivers?", "And the sky?"):
            reply = await c.responses.create(model="tiny", input=question, previous_response_id=previous.id,
                                             max_output_tokens=12, temperature=0)
            assert reply.previous_response_id == previous.id and reply.output_text
            usages.append(reply.usage)
            previous = reply
    for before, after in zip(usages, usages[1:]):
        # the history so far (the earlier input and output) is found in the cache: only the new turn
        # is evaluated
        history = before.input_tokens + before.output_tokens
        assert after.input_tokens > history
        assert after.input_tokens_details.cached_tokens >= history - 1
        assert after.input_tokens - after.input_tokens_details.cached_tokens < 30


async def test_a_stored_response_branches_and_can_be_read_and_deleted(server: Server) -> None:
    async with client(server) as c:
        root = await c.responses.create(model="tiny", input="Once upon a time", max_output_tokens=6, temperature=0)
        a = await c.responses.create(model="tiny", input="Go on.", previous_response_id=root.id,
                                     max_output_tokens=6, temperature=0)
        b = await c.responses.create(model="tiny", input="Go on.", previous_response_id=root.id,
                                     max_output_tokens=6, temperature=0)
        assert a.output_text == b.output_text  # two continuations of the same stored conversation
        got = await c.responses.retrieve(root.id)
        assert got.id == root.id and got.output_text == root.output_text
        await c.responses.delete(root.id)
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(root.id)
        with pytest.raises(openai.NotFoundError):  # never a wrong continuation
            await c.responses.create(model="tiny", input="Go on.", previous_response_id=root.id, max_output_tokens=2)
        unstored = await c.responses.create(model="tiny", input="Hi", store=False, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(unstored.id)


async def test_streaming_gives_the_official_event_sequence(server: Server) -> None:
    async with client(server) as c:
        stream = await c.responses.create(model="tiny", input="Write a line about rain.", max_output_tokens=10,
                                          temperature=0, stream=True)
        events = [e async for e in stream]
        whole = await c.responses.create(model="tiny", input="Write a line about rain.", max_output_tokens=10,
                                         temperature=0)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == whole.output_text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_function_call_round_trip(server: Server, stream: bool) -> None:
    async with client(server) as c:
        kwargs: dict[str, Any] = {"model": "tiny", "tools": [WEATHER], "tool_choice": "required",
                                  "max_output_tokens": 60, "temperature": 0}
        if stream:
            events = [e async for e in await c.responses.create(input="Weather in Oslo?", stream=True, **kwargs)]
            kinds = [e.type for e in events]
            assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" not in kinds
            response = events[-1].response
        else:
            response = await c.responses.create(input="Weather in Oslo?", **kwargs)
        [call] = [item for item in response.output if item.type == "function_call"]
        assert call.name == "get_weather" and "city" in json.loads(call.arguments)
        reply = await c.responses.create(
            model="tiny", previous_response_id=response.id, max_output_tokens=8, temperature=0,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}])
        assert reply.usage.input_tokens_details.cached_tokens >= response.usage.input_tokens


async def test_bad_requests_are_refused(server: Server) -> None:
    async with client(server) as c:
        with pytest.raises(openai.BadRequestError, match="input"):
            await c.responses.create(model="tiny", input=[{"type": "image", "url": "x"}])
        with pytest.raises(openai.BadRequestError, match="web_search"):
            await c.responses.create(model="tiny", input="Hi", tools=[{"type": "web_search"}])
        with pytest.raises(openai.BadRequestError, match="background"):  # a background response is stored
            await c.responses.create(model="tiny", input="Hi", background=True, store=False)
        with pytest.raises(openai.BadRequestError, match="reasoning_effort") as refused:  # this template has none
            await c.responses.create(model="tiny", input="Hi", reasoning={"effort": "low"})
        assert refused.value.body["param"] == "reasoning.effort"
        with pytest.raises(openai.BadRequestError, match="summaries"):
            await c.responses.create(model="tiny", input="Hi", reasoning={"summary": "auto"})
        plain = await c.responses.create(model="tiny", input="Hi", max_output_tokens=2, reasoning={"effort": None})
        assert plain.reasoning is not None and plain.reasoning.effort is None
