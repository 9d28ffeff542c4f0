"""Model families over HTTP, as llama-server serves them: a tiny model of each family (its vendor
template in the GGUF, its markers as tokens of its vocabulary) scripted to answer with a reasoning
block and a tool call in the family's own syntax, served by ``aiollama serve``; the chat
completions, Messages and Responses APIs, whole and streamed, must give the reasoning and the tool
calls that llama-server gave for the same model and request (``tests/data/chat/families.json``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from chat_cases import FAMILIES, api_bodies, family_case, family_model, load, outcome
from server_process import TIMEOUT, Server

LLAMA_SERVER = load("families.json")

pytestmark = pytest.mark.anyio



@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, smollm2_path: Path) -> Iterator[tuple[str, Server]]:
    server = Server(family_model(request.param, smollm2_path), "--n-ctx", "8192", "--n-seq-max", "2")
    try:
        yield request.param, server
    finally:
        server.stop()


def test_the_scripted_models_write_llama_cpp_test_outputs_and_llama_server_read_them_so() -> None:
    for name in FAMILIES:
        expected = family_case(name)["expect"]
        calls = [[c["name"], json.loads(c["arguments"])] for c in expected["tool_calls"]]
        for answer in LLAMA_SERVER[name].values():
            assert answer["tool_calls"] == calls and answer["reasoning"] == expected["reasoning_content"].strip()


async def test_every_api_answers_as_llama_server(family: tuple[str, Server]) -> None:
    name, server = family
    for api, (path, body) in api_bodies(name).items():
        status, _, answer = server.post(path, json.dumps(body).encode())
        assert status == 200, (api, answer)
        got = outcome(api, answer)
        assert {**got, "tool_calls": [list(c) for c in got["tool_calls"]]} == LLAMA_SERVER[name][api], api


async def test_streams_give_the_same_message(family: tuple[str, Server]) -> None:
    name, server = family
    expected = LLAMA_SERVER[name]["chat"]
    bodies = api_bodies(name)
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as client:
        chat = {k: v for k, v in bodies["chat"][1].items() if k != "model"}
        stream = await client.chat.completions.create(model="m", stream=True, **chat)
        reasoning = content = ""
        calls: dict[int, dict[str, str]] = {}
        async for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
        assert reasoning.strip() == expected["reasoning"] and content.strip() == expected["content"]
        assert [[c["name"], json.loads(c["arguments"])] for _, c in sorted(calls.items())] == expected["tool_calls"]
        responses = {k: v for k, v in bodies["responses"][1].items() if k != "model"}
        async with client.responses.stream(model="m", **responses) as events:
            final = await events.get_final_response()
        assert _listed(outcome("responses", final.model_dump())) == LLAMA_SERVER[name]["responses"]
    async with anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0, timeout=TIMEOUT) as client:
        messages = {k: v for k, v in bodies["messages"][1].items() if k not in ("model", "temperature")}
        async with client.messages.stream(model="m", **messages, extra_body={"temperature": 0}) as events:
            message = await events.get_final_message()
        assert _listed(outcome("messages", message.model_dump())) == LLAMA_SERVER[name]["messages"]


def _listed(got: dict[str, Any]) -> dict[str, Any]:
    return {**got, "tool_calls": [list(c) for c in got["tool_calls"]]}


@pytest.mark.parametrize("name", ["mistral", "gemma4", "glm"])
async def test_a_reasoning_budget_closes_each_familys_own_block(name: str, smollm2_path: Path) -> None:
    from chat_cases import FAMILIES, family_request

    from aiollama import Engine

    request = family_request(name)
    closing = FAMILIES[name][1][1] if name != "gemma4" else "<channel|>"
    async with Engine(family_model(name, smollm2_path), n_ctx=4096, n_seq_max=1) as engine:
        free = await engine.conversation().chat(request["messages"], tools=request["tools"], temperature=0,
                                                max_tokens=200)
        cut = await engine.conversation().chat(request["messages"], tools=request["tools"], temperature=0,
                                               max_tokens=8, reasoning_budget=2, reasoning_budget_message=" Enough.")
        forced = engine.tokenize(" Enough." + closing, special=True)
        at = next(i for i in range(len(cut.tokens)) if cut.tokens[i:i + len(forced)] == forced)
        assert at >= 2 and cut.tokens[:at] == free.tokens[:at]  # the same thinking, up to the budget
        assert cut.reasoning.rstrip().endswith("Enough.") and free.reasoning not in cut.reasoning


async def test_the_servers_template_and_reasoning_flags(tiny_path: Path, smollm2_path: Path) -> None:
    from chat_cases import llama_cpp_dir

    source = llama_cpp_dir() / "models" / "templates" / "Qwen3.5-4B.jinja"
    server = Server(tiny_path, "--chat-template-file", str(source), "--reasoning", "off")
    try:
        status, _, answer = server.post("/apply-template", b'{"messages": [{"role": "user", "content": "Hi"}]}')
        assert status == 200 and answer["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    finally:
        server.stop()
    server = Server(family_model("qwen3.5", smollm2_path), "--reasoning-format", "none")
    try:
        path, body = api_bodies("qwen3.5")["chat"]
        message = server.post(path, json.dumps(body).encode())[2]["choices"][0]["message"]
        assert "</think>" in message["content"] and not message.get("reasoning_content")  # left in the content
        asked = server.post(path, json.dumps({**body, "reasoning_format": "auto"}).encode())[2]["choices"][0]["message"]
        assert asked["reasoning_content"].strip() == "I'm\nthinking" and "</think>" not in (asked["content"] or "")
    finally:
        server.stop()
