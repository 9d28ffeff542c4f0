"""Tool calls read from generated text in each format models write, and the schema that
``tool_choice`` constrains a reply to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiollama import InvalidRequestError
from aiollama.formats.toolcalls import (
    call_schema,
    describe,
    might_be_call,
    parse,
    tool_names,
    tool_schemas,
)

NAMES = {"get_weather", "get_time"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]


def calls_of(text: str) -> tuple[str, list[tuple[str, object]]]:
    content, calls = parse(text, NAMES)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("text", "content", "calls"), [
    # Hermes and Qwen: one block a call, text before them is content
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "", [("get_weather", {"city": "Oslo"})]),
    ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me look.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ('<tool_call>{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),  # cut at the end tag
    # Mistral
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]',
     "", [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    # Llama 3, with "parameters"
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', "", [("get_time", {"zone": "UTC"})]),
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', "", [("get_time", {"zone": "UTC"})]),
    # plain JSON, arguments as a JSON string, in a code fence, as a list
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}', "", [("get_weather", {"city": "Lima"})]),
    ('```json\n{"name": "get_time", "arguments": {}}\n```', "", [("get_time", {})]),
    ('[{"name": "get_time", "arguments": {}}]', "", [("get_time", {})]),
    # Qwen3-Coder, Qwen3.5/3.6: XML, values read as JSON where they parse
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>", "", [("get_weather", {"city": "Oslo", "days": 3})]),
    ("Checking.\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nNew\nYork\n</parameter>\n</function>\n</tool_call>",
     "Checking.", [("get_time", {}), ("get_weather", {"city": "New\nYork"})]),
    ("<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>", "", [("get_weather", {"city": "Lima"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLima", "", [("get_weather", {"city": "Lima"})]),  # cut off
    # GLM-4.5 and later
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>2</arg_value>\n</tool_call>", "", [("get_weather", {"city": "Oslo", "days": 2})]),
    ("<tool_call>get_time</tool_call>", "", [("get_time", {})]),
    # Kimi-K2, as its template writes calls (ids functions.NAME:INDEX), text before them
    ('I will check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
     '{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}'
     '<|tool_call_end|><|tool_calls_section_end|>',
     "I will check.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{"zone": "UTC"}',
     "", [("get_time", {"zone": "UTC"})]),  # cut off
])
def test_calls_in_every_format(text: str, content: str, calls: list[tuple[str, object]]) -> None:
    assert calls_of(text) == (content, calls)


@pytest.mark.parametrize("text", [
    "It is sunny in Oslo.",
    '{"name": "launch_rockets", "arguments": {}}',  # not a tool offered
    '{"city": "Oslo"}',  # JSON, but not a call
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
    '{"name": "get_weather", "arguments": "not json"}',
    '[{"name": "get_time", "arguments": {}}, {"name": "unknown", "arguments": {}}]',  # not all calls
    "<tool_call>\n<function=launch_rockets>\n</function>\n</tool_call>",  # XML, not a tool offered
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call><tool_call>{broken</tool_call>",
])
def test_text_that_is_not_a_call_stays_content(text: str) -> None:
    assert parse(text, NAMES) == (text, [])


def test_calls_have_openai_ids_and_indexes() -> None:
    _, calls = parse('[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]', NAMES)
    shaped = [c.openai(i) for i, c in enumerate(calls)]
    assert [s["index"] for s in shaped] == [0, 1]
    assert all(s["id"].startswith("call_") and s["type"] == "function" for s in shaped)
    assert shaped[0]["id"] != shaped[1]["id"]


def test_might_be_call_holds_back_only_what_could_start_one() -> None:
    for text in ("", "  ", "<tool", "<tool_call>{", "[TOOL", "{", "```"):
        assert might_be_call(text)
    for text in ("Hello", "The answer", "<b>bold</b>"):
        assert not might_be_call(text)


def test_tool_choice_schemas() -> None:
    assert call_schema(TOOLS, "auto") is None and call_schema(TOOLS, "none") is None
    required = call_schema(TOOLS, "required")
    assert required is not None
    assert [o["properties"]["name"]["const"] for o in required["anyOf"]] == ["get_weather", "get_time"]
    assert required["anyOf"][1]["properties"]["arguments"] == {"type": "object"}  # no parameters given
    named = call_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert named is not None and named["properties"]["arguments"] == TOOLS[0]["function"]["parameters"]  # type: ignore[index]
    with pytest.raises(InvalidRequestError, match="not among the tools"):
        call_schema(TOOLS, {"type": "function", "function": {"name": "launch_rockets"}})
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        call_schema(TOOLS, "sometimes")


@pytest.mark.parametrize("tools", [[{"type": "function"}], [{"function": {"name": ""}}], ["get_time"],
                                   [{"type": "retrieval", "function": {"name": "x"}}]])
def test_malformed_tools(tools: list[object]) -> None:
    with pytest.raises(InvalidRequestError, match=r"tools\[0\]"):
        tool_names(tools)  # type: ignore[arg-type]


def test_describe_lists_every_function() -> None:
    text = describe(TOOLS)
    assert all(json.dumps(t["function"]) in text for t in TOOLS)


def test_xml_arguments_follow_the_tool_schema() -> None:
    # a string parameter stays text even where it reads as JSON; others are read as JSON
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "zip": {"type": "string"}, "count": {"type": "integer"}, "exact": {"type": "boolean"}}}}}]
    text = ("<tool_call>\n<function=lookup>\n<parameter=zip>\n01234\n</parameter>\n<parameter=count>\n5\n"
            "</parameter>\n<parameter=exact>\ntrue\n</parameter>\n</function>\n</tool_call>")
    [call] = parse(text, tool_schemas(tools))[1]
    assert json.loads(call.arguments) == {"zip": "01234", "count": 5, "exact": True}
    assert might_be_call("<function=lo") and might_be_call("<functi")


@pytest.mark.parametrize("text", [
    'Let me look that up for you.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    'Let me look that up for you.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
    '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>',
])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_text_before_a_call_streams_and_the_call_never_leaks(text: str, size: int) -> None:
    from aiollama import Chunk, FinishReason
    from aiollama.server.shape import ChatChoice

    choice = ChatChoice(0, {"get_weather": {}}, lambda t: b"")
    deltas = []
    for i in range(0, len(text), size):
        deltas += choice.feed(Chunk(text[i:i + size], [0]))
    streamed = "".join(d["delta"].get("content") or "" for d in deltas)
    assert streamed.startswith("Let me look that up for you")  # shown before the reply ends
    deltas += choice.finish(FinishReason.EOG)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert content.strip() == "Let me look that up for you." and "<" not in content
    [call] = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert deltas[-1]["finish_reason"] == "tool_calls"


@pytest.mark.anyio
async def test_call_markers_show_in_the_stream_even_as_control_tokens(smollm2_path: Path) -> None:
    """Kimi-K2's call markers are control tokens, which llama.cpp does not show as text; the
    stream shows them (as llama-server's preserved tokens), and no other control token."""
    from tiny_model import copy_tokenizer, write_tiny_model

    import aiollama
    from aiollama import Engine

    path = aiollama.cache_dir() / "test-models" / "tiny-kimi-markers-v1.gguf"
    if not path.is_file():
        fields = {k: f.contents() for k, f in copy_tokenizer(smollm2_path).items()}  # type: ignore[attr-defined]
        fields["tokenizer.ggml.tokens"] = list(fields["tokenizer.ggml.tokens"]) + ["<|tool_call_begin|>"]
        fields["tokenizer.ggml.token_type"] = list(fields["tokenizer.ggml.token_type"]) + [3]  # control
        write_tiny_model(path, None, tokenizer=fields, seed=5)
    async with Engine(path, n_ctx=256) as engine:
        marker = engine.tokenize("<|tool_call_begin|>", special=True)
        other = engine.tokenize("<|im_start|>", special=True)
        assert len(marker) == 1 and len(other) == 1
        shown = await engine.conversation("Hi").stream(max_tokens=1, logit_bias={marker[0]: 100})
        assert shown.tokens == marker and shown.text == "<|tool_call_begin|>"
        hidden = await engine.conversation("Hi").stream(max_tokens=1, logit_bias={other[0]: 100})
        assert hidden.tokens == other and hidden.text == ""
