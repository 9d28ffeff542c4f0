"""The conversations every vendor chat template is rendered with, and the files that hold what
llama.cpp's own tools made of them (``tests/data/chat/``).

``goldens.json`` holds llama-server's ``/apply-template`` answer for each template of the pinned
llama.cpp tree (``llama.cpp/models/templates``) and each conversation here, made once by
``tests/data/chat/make_goldens.py``; ``parse_cases.json`` the cases of llama.cpp's chat-parser
tests (``tests/test-chat.cpp``: a template, its inputs, a model's output and the message it must
parse to), taken out once by ``tests/data/chat/dump_parse_cases.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "chat"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]

SYSTEM = {"role": "system", "content": "You are a concise assistant."}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}

# name -> the body of a chat request (what /apply-template and render_chat take)
CONVERSATIONS: dict[str, dict[str, Any]] = {
    "plain": {"messages": [SYSTEM, {"role": "user", "content": "Hello! Who are you?"}]},
    "multi_turn": {"messages": [SYSTEM, {"role": "user", "content": "Name a colour."},
                                {"role": "assistant", "content": "Blue."},
                                {"role": "user", "content": "Another one?"}]},
    "tool_call": {"messages": [ASK, CALL, RESULT, {"role": "user", "content": "And in Rome?"}], "tools": TOOLS},
    "parallel_calls": {"messages": [
        {"role": "user", "content": "Weather and time in Tokyo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "JST"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "09:00"}], "tools": TOOLS},
    "thinking_off": {"messages": [{"role": "user", "content": "What is 2 + 2?"}],
                     "chat_template_kwargs": {"enable_thinking": False}},
    "reasoning_history": {"messages": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four."},
        {"role": "user", "content": "And 3 + 3?"}]},
}

# the formats templates print dates in (strftime_now, and llama.cpp's date variables)
DATE_FORMATS = ("%Y-%m-%d", "%d %b %Y", "%b %d %Y", "%B %d, %Y")


def templates() -> list[Path]:
    """Every vendor template of the pinned llama.cpp tree."""
    return sorted((llama_cpp_dir() / "models" / "templates").glob("*.jinja"))


def llama_cpp_dir() -> Path:
    """The pinned llama.cpp source tree: the one the build fetched beside the package, else fetched
    into the cache from the pinned archive (the build's own script)."""
    env = os.environ.get("LLAMA_CPP_DIR")
    for root in ([Path(env)] if env else []) + [ROOT / "llama.cpp"]:
        if (root / "models" / "templates").is_dir():
            return root
    dest = Path(os.environ.get("AIOLLAMA_CACHE") or Path.home() / ".cache" / "aiollama") / "llama.cpp-src"
    if not (dest / "models" / "templates").is_dir():
        subprocess.run([sys.executable, str(ROOT / "cmake" / "fetch_llama_cpp.py"), str(dest)], check=True)
    return dest


def load(name: str) -> Any:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def same_day(text: str, made: datetime.date, today: datetime.date) -> str:
    """``text`` with the dates of the day it was made written as today's (templates print today)."""
    for fmt in DATE_FORMATS:
        text = text.replace(made.strftime(fmt), today.strftime(fmt))
    return text


# Model families served over HTTP by a scripted tiny model (tests/scripted_model.py): the vendor
# template, the markers its vocabulary holds as tokens, and the start of the llama.cpp parse case
# whose output the model writes (a reasoning block and a tool call in the family's own syntax).
FAMILIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "qwen3.5": ("Qwen3.5-4B.jinja", ("<think>", "</think>", "<tool_call>", "</tool_call>"),
                "I'm\nthinking\n</think>\n\n<tool_call>\n<function=special_function>"),
    "gpt-oss": ("openai-gpt-oss-120b.jinja",
                ("<|start|>", "<|end|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|return|>", "<|call|>"),
                "<|channel|>analysis<|message|>Thinking about edit..."),
    "glm": ("GLM-4.7-Flash.jinja", ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                                    "<arg_value>", "</arg_value>", "<|assistant|>", "<|user|>", "<|system|>"),
            "I'm\nthinking</think><tool_call>special_function<arg_key>"),
    "deepseek-v3.1": ("deepseek-ai-DeepSeek-V3.1.jinja",
                      ("<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                       "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<｜Assistant｜>", "<｜User｜>"),
                      "REASONING</think><｜tool▁calls▁begin｜>"),
    "gemma4": ("google-gemma-4-31B-it.jinja", ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>',
                                               "<|turn>", "<turn|>"),
               "<|channel>thought\nI'm\nthinking<channel|><|tool_call>call:get_time"),
    "mistral": ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", ("[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]"),
                "[THINK]I'm\nthinking[/THINK][TOOL_CALLS]special_function[ARGS]"),
    "kimi": ("Kimi-K2-Thinking.jinja", ("<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                                        "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>",
                                        "<|im_assistant|>", "<|im_middle|>", "<|im_user|>", "<|im_system|>"),
             "<think>I'm thinking about this</think><|tool_calls_section_begin|>"),
}


def family_case(family: str) -> dict[str, Any]:
    """The parse case a family's scripted model writes the output of."""
    template, _, start = FAMILIES[family]
    return next(c for c in load("parse_cases.json") if c["template"] == template and c["input"].startswith(start)
                and not c["is_partial"] and c["expect"]["tool_calls"])


def family_request(family: str) -> dict[str, Any]:
    """The chat request its model is served (the case's messages, tools and switches)."""
    case = family_case(family)
    return {"messages": case["messages"], "tools": case["tools"], "tool_choice": case["tool_choice"],
            "reasoning_format": case["reasoning_format"]}


def api_bodies(family: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """The same request in each API's shape: path and body, greedy."""
    req = family_request(family)
    messages, tools, choice = req["messages"], req["tools"], req["tool_choice"]
    fns = [t["function"] for t in tools]
    return {
        "chat": ("/v1/chat/completions", {"model": "m", "messages": messages, "tools": tools, "tool_choice": choice,
                                          "temperature": 0, "max_tokens": 300}),
        "messages": ("/v1/messages", {
            "model": "m", "max_tokens": 300, "temperature": 0, "messages": messages,
            "tools": [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]} for f in fns],
            "tool_choice": {"type": "any" if choice == "required" else "auto"}}),
        "responses": ("/v1/responses", {
            "model": "m", "input": messages[-1]["content"], "temperature": 0, "max_output_tokens": 300,
            "tools": [{"type": "function", **f} for f in fns], "tool_choice": choice}),
    }


def outcome(api: str, body: dict[str, Any]) -> dict[str, Any]:
    """What an answer says: its reasoning, its text and its tool calls (arguments as JSON values)."""
    if api == "chat":
        m = body["choices"][0]["message"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls") or []]
        return {"reasoning": (m.get("reasoning_content") or "").strip(), "content": (m.get("content") or "").strip(),
                "tool_calls": calls}
    if api == "messages":
        blocks = body["content"]
        return {"reasoning": "".join(b.get("thinking", "") for b in blocks if b["type"] == "thinking").strip(),
                "content": "".join(b["text"] for b in blocks if b["type"] == "text").strip(),
                "tool_calls": [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]}
    items = body["output"]
    return {"reasoning": "".join(c["text"] for i in items if i["type"] == "reasoning" for c in i.get("content") or [])
            .strip(),
            "content": "".join(c["text"] for i in items if i["type"] == "message" for c in i["content"]).strip(),
            "tool_calls": [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"]}


def family_model(family: str, smollm2: Path) -> Path:
    """The scripted tiny model of a family (written into the cache on first use)."""
    from scripted_model import scripted_model

    import aiollama

    template, markers, _ = FAMILIES[family]
    source = (llama_cpp_dir() / "models" / "templates" / template).read_text(encoding="utf-8")
    return scripted_model(aiollama.cache_dir() / "test-models" / f"scripted-{family}-v1.gguf", smollm2, template=source,
                          markers=markers, request=family_request(family), reply=family_case(family)["input"])


def conformance(tokenizer: Any) -> dict[str, dict[str, Any]]:
    """For each vendor template: how its conversations render against llama-server's (equal,
    refused by both, tools described by aiollama where llama-server leaves them out, differing),
    its parse cases, whether a required call has a grammar, and whether it has a thinking switch."""
    from aiollama.errors import AiollamaError
    from aiollama.formats.chat import ChatTemplate
    from aiollama.formats.messages import normalize

    goldens = load("goldens.json")
    made, today = datetime.date.fromisoformat(goldens["date"]), datetime.date.today()
    cases = load("parse_cases.json")
    out = {}
    for name in sorted(goldens["templates"]):
        template = ChatTemplate.of(tokenizer, (llama_cpp_dir() / "models" / "templates" / f"{name}.jinja").read_text())
        row = {"equal": 0, "refused": 0, "described": 0, "differs": 0}
        for case, body in CONVERSATIONS.items():
            golden = goldens["templates"][name][case]
            try:
                prompt: str | None = template.render(normalize(body["messages"]), tools=body.get("tools"),
                                                     chat_template_kwargs=body.get("chat_template_kwargs")).prompt
            except AiollamaError:
                prompt = None
            if "prompt" not in golden or prompt is None:
                row["refused" if "prompt" not in golden and prompt is None else "differs"] += 1
            elif prompt == same_day(golden["prompt"], made, today):
                row["equal"] += 1
            elif body.get("tools") and not template.supports_tools:
                row["described"] += 1
            else:
                row["differs"] += 1
        required = template.layer.apply({"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER],
                                         "tool_choice": "required"})
        row.update(parse=sum(c["template"] == f"{name}.jinja" for c in cases), constrain=bool(required["grammar"]),
                   format=required["format_name"], thinking=template.supports_thinking)
        out[name] = row
    return out


def conformance_table(rows: dict[str, dict[str, Any]]) -> str:
    """The table of docs/chat-formats.md."""
    def mark(flag: bool) -> str:
        return "yes" if flag else "no"

    lines = ["| template | renders as llama-server | refused by both | tools described | llama.cpp parse cases "
             "| constrains a call | thinking switch |",
             "|---|---:|---:|---:|---:|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['equal']} of {len(CONVERSATIONS)} | {r['refused']} | {r['described']} | "
                     f"{r['parse']} | {mark(r['constrain'])} | {mark(r['thinking'])} |")
    return "\n".join(lines)
