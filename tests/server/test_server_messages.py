"""Anthropic's Messages API, driven by the official anthropic client against a real server process:
whole and streamed replies, a tool-use round trip, stop sequences, token counts, thinking blocks
and the errors of what the server cannot do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from server_process import TIMEOUT, Server
from tiny_model import reasoning_model

import aiollama

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.anyio

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}
HELLO = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0}  # on the wire, as older clients send it (the current client has no argument for it)



SERVER_OPTIONS = ("--n-ctx", "8192", "--n-seq-max", "4", "--model-name", "tiny", "--log-level", "warning",
                  "--api-key", "sesame")


def client(server: Server, key: str = "sesame") -> Any:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key=key, max_retries=0, timeout=TIMEOUT)


async def test_a_whole_reply_and_its_stream_agree(server: Server) -> None:
    async with client(server) as c:
        whole = await c.messages.create(model="tiny", max_tokens=12, messages=HELLO, extra_body=GREEDY,
                                        system="Be brief.")
        async with c.messages.stream(model="tiny", max_tokens=12, messages=HELLO, extra_body=GREEDY,
                                     system="Be brief.") as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_message()
        counted = await c.messages.count_tokens(model="tiny", messages=HELLO, system="Be brief.")
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "tiny"
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    [block] = whole.content
    assert block.type == "text" and block.text
    assert streamed.content[0].text == block.text and streamed.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    # every prompt token is counted once: evaluated, or read from the cache (the second time)
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert streamed.usage.cache_read_input_tokens > 0
    assert counted.input_tokens == streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens


async def test_a_stop_sequence_is_named(server: Server) -> None:
    async with client(server) as c:
        free = await c.messages.create(model="tiny", max_tokens=24, messages=HELLO, extra_body=GREEDY)
        text = free.content[0].text
        word = text.split()[len(text.split()) // 2]
        stopped = await c.messages.create(model="tiny", max_tokens=24, messages=HELLO, extra_body=GREEDY,
                                          stop_sequences=["\u2603", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert text.startswith(stopped.content[0].text) and word not in stopped.content[0].text


async def test_an_output_format_constrains_the_reply(server: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    async with client(server) as c:
        reply = await c.messages.create(model="tiny", max_tokens=40, messages=HELLO,
                                        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert reply.stop_reason == "end_turn" and set(json.loads(reply.content[0].text)) == {"n"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_tool_use_round_trip(server: Server, stream: bool) -> None:
    async with client(server) as c:
        kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 60, "extra_body": GREEDY, "tools": [WEATHER],
                                  "tool_choice": {"type": "any"}}
        ask = [{"role": "user", "content": "Weather in Oslo?"}]
        if stream:
            async with c.messages.stream(messages=ask, **kwargs) as s:
                deltas = [e.delta.type async for e in s if e.type == "content_block_delta"]
                first = await s.get_final_message()
            assert "input_json_delta" in deltas and "text_delta" not in deltas
        else:
            first = await c.messages.create(messages=ask, **kwargs)
        assert first.stop_reason == "tool_use"
        [use] = [b for b in first.content if b.type == "tool_use"]
        assert use.name == "get_weather" and isinstance(use.input["city"], str) and use.id.startswith("toolu_")
        history = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": [{"type": "text", "text": "clear, 18 C"}]}]}]
        reply = await c.messages.create(model="tiny", max_tokens=8, extra_body=GREEDY, tools=[WEATHER],
                                        messages=history)
    assert reply.content and reply.stop_reason in ("max_tokens", "end_turn")
    assert reply.usage.cache_read_input_tokens > 0  # the question and the call were in the cache


async def test_what_cannot_be_served_is_refused(server: Server) -> None:
    async with client(server) as c:
        with pytest.raises(anthropic.BadRequestError, match="image"):
            await c.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
        with pytest.raises(anthropic.BadRequestError, match="web_search"):
            await c.messages.create(model="tiny", max_tokens=4, messages=HELLO,
                                    tools=[{"type": "web_search_20250305", "name": "web_search"}])
        with pytest.raises(anthropic.BadRequestError, match="thinking"):  # this template has no switch
            await c.messages.create(model="tiny", max_tokens=4, messages=HELLO, thinking={"type": "disabled"})
        with pytest.raises(anthropic.BadRequestError, match="temperature"):
            await c.messages.create(model="tiny", max_tokens=4, messages=HELLO, extra_body={"temperature": 1.5})
        with pytest.raises(anthropic.BadRequestError, match="effort"):  # this template reads no reasoning_effort
            await c.messages.create(model="tiny", max_tokens=4, messages=HELLO, output_config={"effort": "low"})
        with pytest.raises(anthropic.BadRequestError, match="mcp_servers"):
            await c.messages.create(model="tiny", max_tokens=4, messages=HELLO, extra_body={"mcp_servers": []})
        with pytest.raises(anthropic.BadRequestError) as refused:
            await c.messages.create(model="tiny", max_tokens=4, messages=[{"role": "system", "content": "x"}])
        assert refused.value.body["type"] == "error"
        assert refused.value.body["error"]["type"] == "invalid_request_error"
        ok = await c.messages.create(model="tiny", max_tokens=2, messages=HELLO)  # and the next one is served
        assert ok.usage.output_tokens == 2
    async with client(server, key="wrong") as c:
        with pytest.raises(anthropic.AuthenticationError):
            await c.messages.create(model="tiny", max_tokens=2, messages=HELLO)


async def test_thinking_blocks_the_switch_and_the_budget_in_both_apis(smollm2_path: Path) -> None:
    model = reasoning_model(aiollama.cache_dir() / "test-models", smollm2_path)
    s = Server(model, "--n-ctx", "4096", "--n-seq-max", "2", "--model-name", "r", "--log-level", "warning")
    try:
        async with client(s) as c:
            thinking = await c.messages.create(model="r", max_tokens=8, messages=HELLO, extra_body=GREEDY,
                                               thinking={"type": "enabled", "budget_tokens": 2048})
            plain = await c.messages.create(model="r", max_tokens=8, messages=HELLO, extra_body=GREEDY,
                                            thinking={"type": "disabled"})
            # the budget closes the block: thinking, then the answer
            budgeted = await c.messages.create(model="r", max_tokens=24, messages=HELLO, extra_body=GREEDY,
                                               thinking={"type": "enabled", "budget_tokens": 3})
            async with c.messages.stream(model="r", max_tokens=24, messages=HELLO, extra_body=GREEDY,
                                         thinking={"type": "enabled", "budget_tokens": 3}) as stream:
                deltas = [e.delta.type async for e in stream if e.type == "content_block_delta"]
                streamed = await stream.get_final_message()
            async with openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as oc:
                chat = await oc.chat.completions.create(model="r", messages=HELLO, max_tokens=24, temperature=0,
                                                        extra_body={"reasoning_budget": 3})
                off = await oc.chat.completions.create(
                    model="r", messages=HELLO, max_tokens=8, temperature=0,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
                responded = await oc.responses.create(model="r", input="Hi", max_output_tokens=8, temperature=0)
                with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
                    await oc.chat.completions.create(model="r", messages=HELLO, max_tokens=2, reasoning_effort="low")
                with pytest.raises(openai.BadRequestError, match="no_such_switch"):
                    await oc.chat.completions.create(model="r", messages=HELLO, max_tokens=2,
                                                     extra_body={"chat_template_kwargs": {"no_such_switch": 1}})
            counted = {kind: (await c.messages.count_tokens(model="r", messages=HELLO, thinking=thinking)).input_tokens
                       for kind, thinking in (("on", {"type": "enabled", "budget_tokens": 2048}),
                                              ("off", {"type": "disabled"}))}
    finally:
        s.stop()
    # the template opened a thinking block: the reply so far is all thinking
    assert [b.type for b in thinking.content] == ["thinking"] and thinking.content[0].thinking
    # told not to think, the template wrote an empty block: the reply is text
    assert [b.type for b in plain.content] == ["text"]
    assert counted["off"] > counted["on"]  # the empty block's tokens
    assert chat.choices[0].message.model_extra["reasoning_content"] and chat.choices[0].message.content
    # the tokens thought in: the budget's 3, the forced closing, and none of the answer's
    assert 3 <= chat.usage.completion_tokens_details.reasoning_tokens < chat.usage.completion_tokens
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    assert responded.usage.output_tokens_details.reasoning_tokens == responded.usage.output_tokens == 8
    assert not (off.choices[0].message.model_extra or {}).get("reasoning_content") and off.choices[0].message.content
    assert [b.type for b in budgeted.content] == ["thinking", "text"]
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in budgeted.content]


async def test_the_servers_reasoning_budget_applies_where_a_request_gives_none(smollm2_path: Path) -> None:
    model = reasoning_model(aiollama.cache_dir() / "test-models", smollm2_path)
    s = Server(model, "--n-ctx", "2048", "--n-seq-max", "2", "--model-name", "r", "--log-level", "warning",
               "--reasoning-budget", "2", "--reasoning-budget-message", "Enough.")
    try:
        async with openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as oc:
            bounded = await oc.chat.completions.create(model="r", messages=HELLO, max_tokens=24, temperature=0)
            longer = await oc.chat.completions.create(model="r", messages=HELLO, max_tokens=24, temperature=0,
                                                      extra_body={"reasoning_budget": 16})
        async with client(s) as c:  # Messages' budget_tokens overrides it too
            own = await c.messages.create(model="r", max_tokens=24, messages=HELLO, extra_body=GREEDY,
                                          thinking={"type": "enabled", "budget_tokens": 16})
    finally:
        s.stop()
    thought = bounded.choices[0].message.model_extra["reasoning_content"]
    assert thought.rstrip().endswith("Enough.") and bounded.choices[0].message.content
    assert len(longer.choices[0].message.model_extra["reasoning_content"]) > len(thought)
    assert len(own.content[0].thinking) > len(thought)  # its own budget, the server's message
