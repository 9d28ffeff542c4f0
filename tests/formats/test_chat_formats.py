"""Every model's own format, against llama.cpp's own artifacts: each vendor template of the pinned
tree rendered as llama-server renders it, and each case of llama.cpp's chat-parser tests parsed
(whole and streamed) to the message llama.cpp expects."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from chat_cases import CONVERSATIONS, llama_cpp_dir, load, same_day

from aiollama import ChatTemplateError, InvalidRequestError
from aiollama.formats.chat import ChatTemplate
from aiollama.formats.messages import normalize
from aiollama.formats.reply import ReplyReader
from aiollama.native import Model
from aiollama.native.chat import ChatTemplates
from aiollama.runner.tokenizer import VocabTokenizer

GOLDENS = load("goldens.json")
PARSE_CASES = load("parse_cases.json")

# Where aiollama renders otherwise than llama-server, on purpose (docs/chat-formats.md says why):
# a template with no place for tools gets them described in a system message, where llama-server
# leaves them out of the prompt without a word.
DESCRIBED = "You can call these tools:"


@pytest.fixture(scope="module")
def tokenizer(tiny_path: Path) -> Any:
    model = Model(tiny_path, vocab_only=True)
    yield VocabTokenizer(model.vocab)
    model.close()


def render(template: ChatTemplate, body: dict[str, Any]) -> str:
    return template.render(normalize(body["messages"]), tools=body.get("tools"),
                           chat_template_kwargs=body.get("chat_template_kwargs")).prompt


CASES = [(name, case) for name in sorted(GOLDENS["templates"]) for case in CONVERSATIONS]


@pytest.mark.parametrize(("name", "case"), CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_every_template_renders_as_llama_server(tokenizer: Any, name: str, case: str) -> None:
    golden = GOLDENS["templates"][name][case]
    source = (llama_cpp_dir() / "models" / "templates" / f"{name}.jinja").read_text(encoding="utf-8")
    body = CONVERSATIONS[case]
    why = ""
    try:
        template = ChatTemplate.of(tokenizer, source)
        prompt: str | None = render(template, body)
    except (ChatTemplateError, InvalidRequestError) as exc:
        prompt, why = None, str(exc)
    if "prompt" not in golden:  # llama-server refused it: so does aiollama, with a typed error
        assert prompt is None, f"llama-server refused ({golden['error']}), aiollama rendered"
        return
    expected = same_day(golden["prompt"], datetime.date.fromisoformat(GOLDENS["date"]), datetime.date.today())
    assert prompt is not None, why
    if body.get("tools") and not template.supports_tools:
        assert DESCRIBED in prompt and DESCRIBED not in expected
        return
    assert prompt == expected


def test_the_goldens_cover_every_template() -> None:
    names = {p.stem for p in (llama_cpp_dir() / "models" / "templates").glob("*.jinja")}
    assert names == set(GOLDENS["templates"])
    rendered = sum("prompt" in c for t in GOLDENS["templates"].values() for c in t.values())
    assert rendered > 0.8 * len(names) * len(CONVERSATIONS)


def _templates(name: str) -> ChatTemplates:
    source = (llama_cpp_dir() / "models" / "templates" / name).read_text(encoding="utf-8")
    return ChatTemplates(source)  # as llama.cpp's test reads them: no model, no BOS or EOS text


def _inputs(case: dict[str, Any]) -> dict[str, Any]:
    keys = ("messages", "tools", "tool_choice", "parallel_tool_calls", "reasoning_format", "enable_thinking",
            "add_generation_prompt", "continue_final_message", "json_schema", "chat_template_kwargs")
    return {k: case[k] for k in keys if k in case}


def _same(expected: dict[str, Any], got: Any, *, ids: bool = True) -> None:
    """As llama.cpp's test compares: text stripped, arguments as JSON, ids where one is expected
    (a streamed call's id is the one it went out with, as llama-server's: a format that writes the
    id after the arguments has it only in the whole reply)."""
    assert got.content.strip() == expected["content"].strip()
    assert got.reasoning.strip() == expected["reasoning_content"].strip()
    assert len(got.tool_calls) == len(expected["tool_calls"])
    for call, want in zip(got.tool_calls, expected["tool_calls"]):
        assert call.name == want["name"]
        assert _args(call.arguments) == _args(want["arguments"])
        if want["id"] and ids:
            assert call.id == want["id"]


def _args(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None  # partial arguments are not compared


PARSE_IDS = [f"{i}-{c['template']}" for i, c in enumerate(PARSE_CASES)]


@pytest.mark.parametrize("case", PARSE_CASES, ids=PARSE_IDS)
def test_llama_cpp_parse_cases_whole_and_streamed(case: dict[str, Any]) -> None:
    templates = _templates(case["template"])
    rendered = templates.apply(_inputs(case))
    params = {"format": rendered["format"], "parser": rendered["parser"],
              "generation_prompt": rendered["generation_prompt"], "reasoning_format": case["reasoning_format"],
              "is_continuation": bool(case["continue_final_message"])}
    text = case["input"]
    streamed = ReplyReader(templates.parser(params))
    deltas = []
    data = text.encode()
    at = 0
    while at < len(data):  # a byte at a time, never inside a character
        end = at + 1
        while end < len(data) and data[end] & 0xC0 == 0x80:
            end += 1
        deltas += streamed.feed(data[at:end].decode())
        at = end
    if not case["is_partial"]:
        deltas += streamed.finish()
        whole = ReplyReader(templates.parser(params)).read(text)
        _same(case["expect"], whole)
    _same(case["expect"], streamed.message, ids=False)
    # the deltas concatenate to the message, and no marker text leaks into the content
    assert "".join(d.content for d in deltas) == streamed.message.content[:len("".join(d.content for d in deltas))]
    if not case["is_partial"]:
        assert "".join(d.content for d in deltas) == streamed.message.content
        assert "".join(d.reasoning for d in deltas) == streamed.message.reasoning
        for i, call in enumerate(streamed.message.tool_calls):
            pieces = [c for d in deltas for c in d.calls if c.index == i]
            assert pieces[0].name == call.name and pieces[0].id == call.id
            assert "".join(c.arguments for c in pieces) == call.arguments


def test_the_parse_cases_cover_llama_cpp_tests() -> None:
    assert len(PARSE_CASES) > 300
    assert len({c["template"] for c in PARSE_CASES}) > 40


@pytest.mark.anyio
async def test_a_template_of_ones_own_and_the_default_thinking_switch(tiny_path: Path) -> None:
    from aiollama import Engine

    source = llama_cpp_dir() / "models" / "templates" / "Qwen3.5-4B.jinja"
    async with Engine(tiny_path, n_ctx=512, chat_template=source) as engine:  # a file
        assert engine.render_chat("Hi").endswith("<|im_start|>assistant\n<think>\n")  # thinking on, as llama-server
        assert engine.render_chat("Hi", chat_template_kwargs={"enable_thinking": False}).endswith("</think>\n\n")
        assert engine.chat_template.supports_thinking and engine.chat_template.caps["supports_tools"]
    async with Engine(tiny_path, n_ctx=512, chat_template=source.read_text(), reasoning="off") as engine:  # text
        assert engine.render_chat("Hi").endswith("<think>\n\n</think>\n\n")
        assert engine.render_chat("Hi", chat_template_kwargs={"enable_thinking": True}).endswith("<think>\n")
    with pytest.raises(ChatTemplateError, match="chat template"):
        async with Engine(tiny_path, n_ctx=512, chat_template="{% for m in messages %}"):
            pass
    with pytest.raises(InvalidRequestError, match="reasoning"):
        Engine(tiny_path, reasoning="sometimes")


def test_the_docs_table_is_what_the_templates_do(tokenizer: Any) -> None:
    from chat_cases import ROOT, conformance, conformance_table

    rows = conformance(tokenizer)
    assert not any(r["differs"] for r in rows.values())
    page = (ROOT / "docs" / "chat-formats.md").read_text(encoding="utf-8")
    assert conformance_table(rows) in page
    totals = {k: sum(r[k] for r in rows.values()) for k in ("equal", "refused", "described")}
    assert (f"{totals['equal']} render as llama-server renders them, {totals['refused']} are refused by both, and "
            f"{totals['described']}") in page


def _long(case: dict[str, Any]) -> str | None:
    """The case's reply with its content and reasoning runs forty times as long (where they appear
    as such in it), or None where neither does."""
    text, longer = case["input"], False
    for key in ("reasoning_content", "content"):
        value = case["expect"][key].strip()
        if len(value) >= 5 and text.count(value) == 1:
            text, longer = text.replace(value, " ".join([value] * 40)), True
    return text if longer else None


LONG_CASES = [c for c in PARSE_CASES if not c["is_partial"] and _long(c) is not None]


def _stream(reader: ReplyReader, text: str, size: int) -> list[Any]:
    deltas = [d for at in range(0, len(text), size) for d in reader.feed(text[at:at + size])]
    return deltas + reader.finish()


@pytest.mark.parametrize("case", LONG_CASES, ids=[f"{i}-{c['template']}" for i, c in enumerate(LONG_CASES)])
def test_long_replies_read_spliced_as_whole(case: dict[str, Any]) -> None:
    """A long reply read with its runs cut out of what the parser reads gives the same deltas and
    message as read whole at every chunk (llama-server's way)."""
    templates = _templates(case["template"])
    rendered = templates.apply(_inputs(case))
    params = {"format": rendered["format"], "parser": rendered["parser"],
              "generation_prompt": rendered["generation_prompt"], "reasoning_format": case["reasoning_format"],
              "is_continuation": bool(case["continue_final_message"])}
    text = _long(case)
    assert text is not None
    spliced, whole = ReplyReader(templates.parser(params)), ReplyReader(templates.parser(params), splice=False)
    ours, theirs = _stream(spliced, text, 3), _stream(whole, text, 3)
    for key in ("reasoning", "content"):
        assert "".join(getattr(d, key) for d in ours) == "".join(getattr(d, key) for d in theirs)
    assert spliced.message.content == whole.message.content
    assert spliced.message.reasoning == whole.message.reasoning
    assert [(c.name, c.arguments) for c in spliced.message.tool_calls] == \
        [(c.name, c.arguments) for c in whole.message.tool_calls]


def test_splicing_cuts_long_runs() -> None:
    """The test above compares something: most long cases were read with their runs cut."""
    cut = 0
    for case in LONG_CASES:
        templates = _templates(case["template"])
        rendered = templates.apply(_inputs(case))
        params = {"format": rendered["format"], "parser": rendered["parser"],
                  "generation_prompt": rendered["generation_prompt"], "reasoning_format": case["reasoning_format"],
                  "is_continuation": bool(case["continue_final_message"])}
        reader = ReplyReader(templates.parser(params))
        _stream(reader, _long(case) or "", 3)
        assert reader._spliced is not None
        cut += reader._spliced.cut_chars > 0
    assert len(LONG_CASES) >= 20 and cut >= 0.8 * len(LONG_CASES), (cut, len(LONG_CASES))
