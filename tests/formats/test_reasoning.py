"""Reasoning models and tool-capable templates: thinking blocks are told apart from the answer (in
the library's completions and the server's ``reasoning_content``), a constraint starts after the
thinking block, and tools reach a template that has a place for them. The model is the tiny one
with SmolLM2's vocabulary plus ``<think>``/``</think>`` tokens and a Qwen-style template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from chat_cases import llama_cpp_dir
from helpers import scripted
from tiny_model import reasoning_model

import aiollama
from aiollama import Chunk, Engine, FinishReason
from aiollama.formats import reasoning
from aiollama.formats.chat import ChatTemplate
from aiollama.formats.messages import normalize
from aiollama.formats.reply import ReplyReader
from aiollama.native.chat import ChatTemplates
from aiollama.server.shape import ChatChoice

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def opening_model(smollm2_path: Path) -> Path:
    """Its template opens a thinking block in the generation prompt."""
    return reasoning_model(aiollama.cache_dir() / "test-models", smollm2_path)


@pytest.fixture(scope="module")
def plain_model(smollm2_path: Path) -> Path:
    """Its template leaves the model to open a thinking block (or not)."""
    return reasoning_model(aiollama.cache_dir() / "test-models", smollm2_path, opens_thinking=False)


# the text


@pytest.mark.parametrize(("text", "inside", "expected", "pending"), [
    ("<think>weigh it</think>\n\n42", False, ("weigh it", "42"), False),
    ("  <think>\nweigh it\n</think>42", False, ("weigh it", "42"), False),
    ("<think>still going", False, ("still going", ""), True),
    ("weigh it</think>\n42", True, ("weigh it", "42"), False),
    ("weigh it", True, ("weigh it", ""), True),
    ("weigh it</think>42", False, ("weigh it", "42"), False),  # the template opened it, unannounced
    ("no thinking at all", False, ("", "no thinking at all"), False),
    ("<th", False, ("", "<th"), True),  # could still become the opening marker
    ("", False, ("", ""), True),
    ("a <think> in the middle", False, ("", "a <think> in the middle"), False),
])
def test_split(text: str, inside: bool, expected: tuple[str, str], pending: bool) -> None:
    assert reasoning.split(text, inside=inside) == expected
    assert reasoning.pending(text, inside=inside) is pending


def test_opened() -> None:
    assert reasoning.opened("<|im_start|>assistant\n<think>\n")
    assert not reasoning.opened("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not reasoning.opened("<|im_start|>assistant\n")


def stream_choice(choice: ChatChoice, pieces: list[str], reason: FinishReason = FinishReason.EOG) -> list[dict[str, Any]]:
    deltas = []
    for piece in pieces:
        deltas += choice.feed(Chunk(piece, [0]))
    return deltas + choice.finish(reason)


def joined(deltas: list[dict[str, Any]], key: str) -> str:
    return "".join(d["delta"].get(key) or "" for d in deltas)


def choice_for(template: str, tools: list[dict[str, Any]] | None = None) -> ChatChoice:
    """A chat choice read as a vendor template's replies are (llama.cpp's parser of its format)."""
    chat = ChatTemplate(ChatTemplates((llama_cpp_dir() / "models" / "templates" / template).read_text()))
    return ChatChoice(0, ReplyReader(chat.parser(chat.render(normalize("Hi"), tools=tools))), lambda t: b"")


@pytest.mark.parametrize("inside", [False, True])
def test_streamed_reasoning_never_leaks_into_content(inside: bool) -> None:
    # Qwen3.5's generation prompt opens the thinking block; Qwen3's leaves the model to open it
    template = "Qwen3.5-4B.jinja" if inside else "Qwen-Qwen3-0.6B.jinja"
    text = ("" if inside else "<think>") + "Paris is in France.</think>\n\nParis"
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # markers split across chunks
    deltas = stream_choice(choice_for(template), pieces)
    assert joined(deltas, "reasoning_content") == "Paris is in France."
    assert joined(deltas, "content") == "Paris"
    assert not any("<" in joined([d], "content") or "<" in joined([d], "reasoning_content") for d in deltas)
    assert deltas[-1]["finish_reason"] == "stop"
    whole = choice_for(template)
    for piece in pieces:
        whole.feed(Chunk(piece, [0]))
    message = whole.message(FinishReason.EOG)["message"]
    assert message["reasoning_content"] == "Paris is in France." and message["content"] == "Paris"


def test_streamed_tool_call_after_thinking() -> None:
    text = ('<think>I need the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>')
    deltas = stream_choice(choice_for("Qwen-Qwen3-0.6B.jinja", [WEATHER]), [text[i:i + 5] for i in range(0, len(text), 5)])
    assert joined(deltas, "reasoning_content") == "I need the weather."
    assert joined(deltas, "content") == ""
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Oslo"}
    assert deltas[-1]["finish_reason"] == "tool_calls"


# gpt-oss's Harmony channels: what the model generates after the template's "<|start|>assistant"
# (the stream shows <|start|>, <|channel|>, <|message|> and <|constrain|>, its preserved tokens)

HARMONY_ANSWER = "<|channel|>analysis<|message|>Simple geography.<|end|><|start|>assistant<|channel|>final<|message|>Paris."
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}')


def test_harmony_channels_split_into_reasoning_and_content() -> None:
    assert reasoning.split(HARMONY_ANSWER.replace("<|end|>", "")) == ("Simple geography.", "Paris.")
    assert reasoning.pending("<|channel|>analysis<|message|>Still think") is True
    assert reasoning.pending("<|chan") is True
    whole = choice_for("openai-gpt-oss-120b.jinja", [WEATHER])
    whole.feed(Chunk(HARMONY_CALL, [0]))
    message = whole.message(FinishReason.EOG)
    assert message["finish_reason"] == "tool_calls" and message["message"]["reasoning_content"] == "Need the weather tool."
    [call] = message["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("text", [HARMONY_ANSWER, HARMONY_CALL])
@pytest.mark.parametrize("size", [1, 4, 9])
def test_streamed_harmony_never_leaks_markup(text: str, size: int) -> None:
    deltas = stream_choice(choice_for("openai-gpt-oss-120b.jinja", [WEATHER]),
                           [text[i:i + size] for i in range(0, len(text), size)])
    thought, content = joined(deltas, "reasoning_content"), joined(deltas, "content")
    assert "<|" not in thought and "<|" not in content and "|>" not in thought + content
    assert thought in ("Simple geography.", "Need the weather tool.")
    if text is HARMONY_ANSWER:
        assert content == "Paris." and deltas[-1]["finish_reason"] == "stop"
    else:
        assert content == "" and deltas[-1]["finish_reason"] == "tool_calls"


# constraints start after the thinking block


@pytest.mark.anyio
async def test_a_constraint_starts_after_a_block_the_template_opened(opening_model: Path) -> None:
    async with Engine(opening_model, n_ctx=512) as engine:
        end = engine.tokenize(reasoning.END, add_special=False)
        assert len(end) == 1
        conv = engine.conversation()
        stream = conv.chat("What is six times seven?", json_schema=SCHEMA, max_tokens=40, logit_bias={end[0]: 60})
        assert stream.in_thinking
        result = await stream
        assert result.finish_reason is FinishReason.EOG
        assert result.text.startswith(reasoning.END)
        assert set(json.loads(result.content)) == {"answer"}
        # With the block's end forbidden the model thinks on: the constraint never cuts the block
        # short, and no end-of-generation token can end the reply inside it (only the length limit).
        # (Unbiased, a random model sampled with a random seed closes the block now and then.)
        conv2 = engine.conversation()
        result = await conv2.chat("What is six times seven?", json_schema=SCHEMA, max_tokens=24,
                                  logit_bias={end[0]: -100})
        assert result.finish_reason is FinishReason.LENGTH
        assert result.content == "" and reasoning.END not in result.text


@pytest.mark.anyio
async def test_a_constraint_may_follow_a_block_the_model_opens(plain_model: Path) -> None:
    async with Engine(plain_model, n_ctx=512) as engine:
        start, end = engine.tokenize(reasoning.START + reasoning.END, add_special=False)
        conv = engine.conversation()
        stream = conv.chat("What is six times seven?", json_schema=SCHEMA, max_tokens=48,
                           logit_bias={start: 60, end: 40})
        assert not stream.in_thinking
        result = await stream
        assert result.finish_reason is FinishReason.EOG
        assert result.text.startswith(reasoning.START)
        assert set(json.loads(result.content)) == {"answer"}
        # Without the bias toward thinking, the constraint allows the answer at once.
        conv2 = engine.conversation()
        result = await conv2.chat("What is six times seven?", json_schema=SCHEMA, max_tokens=48,
                                  logit_bias={start: -100})
        assert result.reasoning == ""
        assert set(json.loads(result.text)) == {"answer"}


@pytest.mark.anyio
async def test_raw_streams_of_a_reasoning_model_split_too(opening_model: Path) -> None:
    async with Engine(opening_model, n_ctx=512) as engine:
        end = engine.tokenize(reasoning.END, add_special=False)[0]
        conv = engine.conversation(engine.render_chat("Hi"))
        result = await conv.stream(regex="[0-9]{2}", logit_bias={end: 60}, max_tokens=12)
        assert result.finish_reason is FinishReason.EOG
        assert result.reasoning == "" and len(result.content) == 2 and result.content.isdigit()


# tools reach a template that has a place for them


@pytest.mark.anyio
async def test_tools_reach_the_template(plain_model: Path) -> None:
    async with Engine(plain_model, n_ctx=1024) as engine:
        rendered = engine.render_chat("Weather in Oslo?", tools=[WEATHER])
        assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in rendered
        assert "Weather in Oslo?" in rendered
        history = [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"},
        ]
        rendered = engine.render_chat(history, tools=[WEATHER])
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in rendered
        assert "<tool_response>\n4 degrees, rain\n</tool_response>" in rendered
        # A chat turn appends exactly that render; a reply in the template's format is read as a
        # call, and a required call is held to llama.cpp's grammar of that format
        conv = engine.conversation()
        conv.append_chat(history, tools=[WEATHER], tool_choice="required")
        assert list(conv.tokens) == engine.tokenize(rendered, add_special=True, special=True)
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call>'
        result = await conv.stream(max_tokens=60, temperature=0, logits_processors=[scripted(engine, call, len(conv))])
        assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [("get_weather", {"city": "Bergen"})]
        assert result.content == "" and result.finish_reason == "eog"
        # where the script leaves the format, the grammar keeps the reply in it
        bad = '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'
        conv = engine.conversation()
        conv.append_chat(history, tools=[WEATHER], tool_choice="required")
        result = await conv.stream(max_tokens=60, temperature=0, logits_processors=[scripted(engine, bad, len(conv))])
        assert "launch_rockets" not in result.text


def test_a_malformed_tool_is_refused_by_render_chat(tiny_path: Path) -> None:
    with aiollama.SyncEngine(tiny_path, n_ctx=256) as engine:
        with pytest.raises(aiollama.InvalidRequestError, match="tools"):
            engine.render_chat("hi", tools=[{"type": "function"}])


# the thinking budget


def closing_tag(engine: Engine) -> str:
    """The closing marker of the template's thinking block, as llama.cpp's chat layer finds it."""
    tags: list[str] = engine.chat_template.render(normalize("Hi")).params["thinking_end_tags"]
    assert tags[0].strip() == reasoning.END
    return tags[0]


@pytest.mark.anyio
async def test_a_reasoning_budget_closes_the_block_after_its_tokens(opening_model: Path) -> None:
    async with Engine(opening_model, n_ctx=512) as engine:
        end = engine.tokenize(reasoning.END, add_special=False)[0]
        closing = engine.tokenize(closing_tag(engine), add_special=False, special=True)  # as llama-server closes it
        # the bias keeps the random model from ever closing the block itself
        free = await engine.conversation().chat("Hi", max_tokens=24, temperature=0, logit_bias={end: -100})
        assert end not in free.tokens and free.content == ""
        result = await engine.conversation().chat("Hi", max_tokens=24, temperature=0, logit_bias={end: -100},
                                                   reasoning_budget=5)
        assert result.tokens[:5] == free.tokens[:5]  # the same thinking, up to the budget
        assert result.tokens[5:5 + len(closing)] == closing
        assert len(result.tokens) == 24 and result.content  # then the answer
        told = await engine.conversation().chat("Hi", max_tokens=40, temperature=0, logit_bias={end: -100},
                                                 reasoning_budget=2, reasoning_budget_message="Time is up.")
        assert told.reasoning.rstrip().endswith("Time is up.") and told.content
        at_once = await engine.conversation().chat("Hi", max_tokens=8, temperature=0, reasoning_budget=0)
        assert at_once.tokens[:len(closing)] == closing and at_once.reasoning == ""


@pytest.mark.anyio
async def test_a_reasoning_budget_counts_from_a_block_the_model_opens(plain_model: Path) -> None:
    async with Engine(plain_model, n_ctx=512) as engine:
        start, end = engine.tokenize(reasoning.START + reasoning.END, add_special=False)
        closing = engine.tokenize(closing_tag(engine), add_special=False, special=True)
        result = await engine.conversation().chat("Hi", max_tokens=20, temperature=0,
                                                   logit_bias={start: 60, end: -100}, reasoning_budget=3)
        assert result.tokens[0] == start and result.tokens[4:4 + len(closing)] == closing
        # a reply that does not think is left alone
        plain = {"max_tokens": 12, "temperature": 0, "logit_bias": {start: -100}}
        free = await engine.conversation().chat("Hi", **plain)
        budgeted = await engine.conversation().chat("Hi", reasoning_budget=0, **plain)
        assert budgeted.tokens == free.tokens


def test_a_bad_reasoning_budget_is_refused() -> None:
    from aiollama.errors import InvalidRequestError
    from aiollama.sampling import SamplingParams

    with pytest.raises(InvalidRequestError, match="reasoning_budget"):
        SamplingParams(reasoning_budget=-1)
    with pytest.raises(InvalidRequestError, match="reasoning_budget_message"):
        SamplingParams(reasoning_budget=1, reasoning_budget_message=3)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_chat_template_kwargs_reach_the_template_or_fail(opening_model: Path) -> None:
    from aiollama.errors import ChatTemplateError

    async with Engine(opening_model, n_ctx=512) as engine:
        assert engine.chat_template_reads("enable_thinking") and not engine.chat_template_reads("reasoning_effort")
        off = engine.render_chat("Hi", chat_template_kwargs={"enable_thinking": False})
        assert off.endswith("<think>\n\n</think>\n\n") and off != engine.render_chat("Hi")
        conv = engine.conversation()
        stream = conv.chat("Hi", max_tokens=4, chat_template_kwargs={"enable_thinking": False})
        assert not stream.in_thinking
        await stream
        conv.chat("And?", max_tokens=2, chat_template_kwargs={"enable_thinking": True})  # turn by turn
        for bad in ({"reasoning_effort": "low"}, {"messages": []}):
            with pytest.raises(ChatTemplateError):
                engine.conversation().chat("Hi", chat_template_kwargs=bad)


def test_a_reasoning_budget_closes_a_harmony_analysis() -> None:
    budget = reasoning.Budget(2, [90], inside=False, harmony_closing=[1, 2, 3])
    for piece in (b"<|channel|>", b"analysis", b"<|message|>", b"We", b" need"):
        assert budget.forcing is None
        budget.took(piece)
    forced = []
    while budget.forcing is not None:
        forced.append(budget.forcing)
        budget.took(b"x")
    assert forced == [1, 2, 3] and budget.done  # the final channel's header, then the model answers
    closed = reasoning.Budget(5, [90], inside=False, harmony_closing=[1, 2, 3])
    for piece in (b"<|channel|>analysis<|message|>", b"Short.", b"<|start|>", b"assistant"):
        closed.took(piece)
    assert closed.done and closed.forcing is None  # closed by the model before the budget
    plain = reasoning.Budget(0, [90], inside=False, harmony_closing=[1, 2, 3])
    plain.took(b"Hello")
    assert plain.done and plain.forcing is None  # no thinking at all: left alone
