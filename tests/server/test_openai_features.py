"""What OpenAI-client applications use every day, driven by the official client against a real server
process on SmolLM2: structured output, tool calls, log-probabilities and embeddings."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import anyio
import numpy as np
import pytest
from pydantic import BaseModel
from server_process import Server

from aiollama.native import Batch, Context, DecodeStatus, Model

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.anyio, pytest.mark.smollm2]



SERVER_MODEL = "smollm2_path"
SERVER_OPTIONS = ("--n-ctx", "4096", "--n-seq-max", "8", "--model-name", "smollm2", "--log-level", "warning")


class City(BaseModel):
    name: str
    country: str
    population: int


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


async def test_parse_returns_a_pydantic_object(server: Server) -> None:
    async with server.client() as client:
        reply = await client.chat.completions.parse(
            model="smollm2", messages=[{"role": "user", "content": "Name a big city, its country and population."}],
            response_format=City, temperature=0)
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and city.name and city.country
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
async def test_required_tool_calls_have_arguments_that_validate(server: Server, stream: bool) -> None:
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    async with server.client() as client:
        if stream:
            calls: dict[int, dict[str, str]] = {}
            finish = None
            async for chunk in await client.chat.completions.create(
                    model="smollm2", messages=messages, tools=[WEATHER, TIME], tool_choice="required",
                    temperature=0, stream=True):
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
                    for delta in choice.delta.tool_calls or ():
                        call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                        call["name"] += delta.function.name or ""
                        call["arguments"] += delta.function.arguments or ""
            assert finish == "tool_calls" and list(calls) == [0]
            name, arguments = calls[0]["name"], calls[0]["arguments"]
        else:
            reply = await client.chat.completions.create(
                model="smollm2", messages=messages, tools=[WEATHER, TIME], tool_choice="required", temperature=0)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
            call = choice.message.tool_calls[0]
            assert call.id and call.type == "function"
            name, arguments = call.function.name, call.function.arguments
    assert name in ("get_weather", "get_time")
    args = json.loads(arguments)
    schema = (WEATHER if name == "get_weather" else TIME)["function"]["parameters"]
    assert set(args) == set(schema["properties"])  # exactly the fields, and all the required ones
    if name == "get_weather":
        assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["city"], str)


async def test_a_named_tool_is_called_and_its_result_answered(server: Server) -> None:
    messages: list[dict[str, object]] = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    async with server.client() as client:
        reply = await client.chat.completions.create(
            model="smollm2", messages=messages, tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
        call = reply.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
        answer = await client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER],
                                                      tool_choice="none", temperature=0, max_tokens=40)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def solo_logprobs(model_path: Path, tokens: list[int]) -> np.ndarray:
    """log-softmax of the next-token logits after ``tokens``, decoded alone."""
    with Model(model_path) as model, Context(model, n_ctx=512, n_batch=512, n_seq_max=1) as ctx, \
            Batch(512) as batch:
        row = batch.add_tokens(tokens, 0, 0, output_last=True)
        assert ctx.decode(batch) is DecodeStatus.OK
        logits = np.array(ctx.logits(row), dtype=np.float64)
    return logits - (logits.max() + math.log(np.exp(logits - logits.max()).sum()))


async def test_logprobs_are_coherent_and_match_a_solo_computation(server: Server, smollm2_path: Path) -> None:
    prompt = "The capital of France is"
    async with server.client() as client:
        reply = await client.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0,
                                                logprobs=3)
        chat = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0,
            logprobs=True, top_logprobs=3)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == 1 and len(lp.top_logprobs[0]) == 3
    expected = solo_logprobs(smollm2_path, _tokens(smollm2_path, prompt))
    assert lp.token_logprobs[0] == pytest.approx(float(expected.max()), abs=1e-3)  # greedy: the best token
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        assert entry.logprob <= 0 and entry.logprob == pytest.approx(tops[0], abs=1e-6)  # greedy
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def _tokens(path: Path, text: str) -> list[int]:
    with Model(path, vocab_only=True) as model:
        return model.vocab.tokenize(text)


async def test_embeddings_do_not_depend_on_the_batch(server: Server) -> None:
    texts = ["The cat sat on the mat.", "Stocks fell sharply today.", "A feline rested on a rug."]
    async with server.client() as client:
        together = await client.embeddings.create(model="smollm2", input=texts)
        alone = [await client.embeddings.create(model="smollm2", input=t) for t in texts]
        packed = await client.embeddings.create(model="smollm2", input=texts[0], encoding_format="base64")
    vectors = np.array([d.embedding for d in together.data])
    assert vectors.shape[0] == 3 and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    for i, one in enumerate(alone):
        assert np.allclose(vectors[i], one.data[0].embedding, atol=1e-4)
    similarity = vectors @ vectors.T
    assert similarity[0, 2] > similarity[0, 1]  # the cat and the feline are closer than the stocks
    assert together.usage.prompt_tokens > 0
    # the client asks for base64 by itself and decodes it; asked for explicitly, it hands the text over
    decoded = np.frombuffer(base64.b64decode(packed.data[0].embedding), dtype="<f4")
    assert np.allclose(decoded, vectors[0], atol=1e-4)


async def test_an_invalid_schema_is_a_400_not_an_unconstrained_answer(server: Server) -> None:
    async with server.client() as client:
        with pytest.raises(openai.BadRequestError, match="does not compile"):
            await client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "x"}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "bad", "schema": {"type": "object", "properties": 7}}})
    with anyio.fail_after(30):
        status = await anyio.to_thread.run_sync(server.get, "/health")
    assert status[0] == 200
