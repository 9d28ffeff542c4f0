"""Tool calls: read in each model's own format by llama.cpp's parsers as they stream, read as JSON
from a model told of its tools, and the schema that ``tool_choice`` constrains such a reply to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiollama import InvalidRequestError
from aiollama.formats.toolcalls import (
    call_schema,
    describe,
    json_calls,
    might_be_call,
    tool_names,
)

NAMES = {"get_weather", "get_time"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]


def calls_of(text: str) -> list[tuple[str, object]] | None:
    calls = json_calls(text, NAMES)
    return None if calls is None else [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("text", "calls"), [
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', [("get_time", {"zone": "UTC"})]),
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}', [("get_weather", {"city": "Lima"})]),
    ('```json\n{"name": "get_time", "arguments": {}}\n```', [("get_time", {})]),
    ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
     [("get_time", {}), ("get_weather", {"city": "Rome"})]),
])
def test_json_calls_of_a_model_told_of_its_tools(text: str, calls: list[tuple[str, object]]) -> None:
    assert calls_of(text) == calls


@pytest.mark.parametrize("text", [
    "It is sunny in Oslo.",
    '{"name": "launch_rockets", "arguments": {}}',  # not a tool offered
    '{"city": "Oslo"}',  # JSON, but not a call
    '{"name": "get_weather", "arguments": "not json"}',
    '[{"name": "get_time", "arguments": {}}, {"name": "unknown", "arguments": {}}]',  # not all calls
])
def test_text_that_is_not_a_call_stays_content(text: str) -> None:
    assert json_calls(text, NAMES) is None


def test_calls_have_openai_ids_and_indexes() -> None:
    calls = json_calls('[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]', NAMES) or []
    shaped = [c.openai(i) for i, c in enumerate(calls)]
    assert [s["index"] for s in shaped] == [0, 1]
    assert all(s["id"].startswith("call_") and s["type"] == "function" for s in shaped)
    assert shaped[0]["id"] != shaped[1]["id"]


def test_might_be_call_holds_back_only_what_could_start_one() -> None:
    for text in ("", "  ", "{", "[", "```", '{"name"'):
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


@pytest.mark.parametrize(("template", "text"), [
    ("Qwen-Qwen3-0.6B.jinja",
     'Let me look that up for you.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    ("Kimi-K2-Instruct.jinja",
     "Let me look that up for you.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'),
    ("Qwen3.5-4B.jinja",
     "Let me look that up for you.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
     "</parameter>\n</function>\n</tool_call>"),
])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_a_call_streams_in_its_format_and_its_markers_never_leak(template: str, text: str, size: int) -> None:
    from chat_cases import llama_cpp_dir

    from aiollama import Chunk, FinishReason
    from aiollama.formats.chat import ChatTemplate
    from aiollama.formats.messages import normalize
    from aiollama.formats.reply import ReplyReader
    from aiollama.native.chat import ChatTemplates
    from aiollama.server.shape import ChatChoice

    chat = ChatTemplate(ChatTemplates((llama_cpp_dir() / "models" / "templates" / template).read_text()))
    rendered = chat.render(normalize("Weather in Oslo?"), tools=TOOLS)
    choice = ChatChoice(0, ReplyReader(chat.parser(rendered)), lambda t: b"")
    deltas = []
    for i in range(0, len(text), size):
        deltas += choice.feed(Chunk(text[i:i + size], [0]))
    shown = "".join(d["delta"].get("content") or d["delta"].get("reasoning_content") or "" for d in deltas)
    assert shown.startswith("Let me look that up for you")  # shown before the reply ends
    deltas += choice.finish(FinishReason.EOG)
    shown = "".join(d["delta"].get("content") or d["delta"].get("reasoning_content") or "" for d in deltas)
    assert shown.strip() == "Let me look that up for you." and "<" not in shown
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Oslo"}
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
