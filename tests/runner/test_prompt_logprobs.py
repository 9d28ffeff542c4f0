"""Prompt log-probabilities: every prompt token after the first scored in the same decode steps as
everything else, equal to what its row of logits says, however the prompt is split over steps and
whatever the prefix cache holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from server_process import Server

from aiollama import Engine
from aiollama.errors import InvalidRequestError


async def _row_after(engine: Engine, tokens: list[int]) -> np.ndarray:
    """The log-softmax of the logits after ``tokens``, read by a logits processor."""
    rows: list[np.ndarray] = []

    def capture(history: Any, logits: np.ndarray) -> None:
        rows.append(logits.astype(np.float64).copy())

    conv = engine.conversation(tokens)
    await conv.stream(max_tokens=1, temperature=0, logits_processors=[capture])
    await conv.aclose()
    row = rows[0]
    return row - (row.max() + np.log(np.exp(row - row.max()).sum()))


@pytest.mark.anyio
async def test_each_prompt_token_is_scored_as_its_row_says(tiny_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=1024, step_tokens=64) as engine:
        prompt = engine.tokenize("The sea is wide and the wind is cold. " * 16, add_special=True)
        assert len(prompt) > 128  # over several steps
        warm = engine.conversation(prompt)  # the prefix cache holds the prompt: scoring evaluates it anyway
        await warm.stream(max_tokens=1, temperature=0)
        await warm.aclose()
        stream = engine.conversation(prompt).stream(max_tokens=3, temperature=0, prompt_logprobs=3)
        result = await stream
        assert result.stats is not None and result.stats.cached_tokens == 0
        scored = result.prompt_logprobs
        assert [s.token for s in scored] == prompt[1:] and scored == stream.prompt_logprobs
        assert all(s.logprob <= 0 and len(s.top) == 3 and s.rank is not None and s.rank >= 1 for s in scored)
        assert all(s.rank == 1 for s in scored if s.top[0][0] == s.token)
        for i in (0, 70, len(prompt) - 2):  # first step, a later step, the last scored token
            row = await _row_after(engine, prompt[:i + 1])
            # the rows were computed in batches of other sizes (other kernels, sums in another order)
            assert scored[i].logprob == pytest.approx(row[prompt[i + 1]], abs=0.1)
            for token, logprob in scored[i].top:  # the most likely tokens (near-ties may swap places)
                assert logprob == pytest.approx(row[token], abs=0.1)
            assert scored[i].top[0][1] == pytest.approx(row.max(), abs=0.1)
        plain = await engine.conversation(prompt).stream(max_tokens=3, temperature=0)
        assert plain.prompt_logprobs == [] and plain.tokens == result.tokens  # the same generation


@pytest.mark.anyio
async def test_a_bad_prompt_logprobs_is_refused(tiny_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=256) as engine:
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            engine.conversation("Hi").stream(prompt_logprobs=21)


def test_the_server_echoes_and_scores_the_prompt(tiny_path: Path) -> None:
    server = Server(tiny_path, "--n-ctx", "2048", "--n-seq-max", "2", "--log-level", "warning")
    try:
        def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
            status, _, answer = server.post(path, json.dumps(body).encode())
            return status, answer

        prompt = "The sea is wide and the wind is cold."
        status, plain = post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2})
        assert status == 200
        status, echoed = post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2,
                                                  "echo": True, "prompt_logprobs": 1})
        assert status == 200, echoed
        choice, generated = echoed["choices"][0], plain["choices"][0]
        assert choice["text"] == prompt + generated["text"]
        lp = choice["logprobs"]
        n_prompt = echoed["usage"]["prompt_tokens"]
        assert len(lp["tokens"]) == n_prompt + 4 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:])
        assert lp["token_logprobs"][n_prompt:] == pytest.approx(generated["logprobs"]["token_logprobs"], abs=1e-4)
        assert "".join(lp["tokens"][n_prompt:]) == generated["text"]
        assert lp["text_offset"][n_prompt] == len(prompt)
        # vLLM's shape: one entry a prompt token, None first, the token itself among each entry's
        rows = choice["prompt_logprobs"]
        assert len(rows) == n_prompt and rows[0] is None
        assert all(1 <= len(row) <= 2 and all(v["rank"] >= 1 for v in row.values()) for row in rows[1:])
        for i, row in enumerate(rows[1:], start=1):
            assert any(v["logprob"] == pytest.approx(lp["token_logprobs"][i], abs=1e-4) for v in row.values())
        status, answer = post("/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 2, "temperature": 0})
        assert status == 200 and answer["choices"][0]["text"].startswith(prompt)
        assert answer["choices"][0]["logprobs"] is None
        status, chat = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                     "prompt_logprobs": 0})
        assert status == 200 and chat["prompt_logprobs"][0] is None
        assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
        import openai

        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            events = list(client.completions.create(model="x", prompt=prompt, echo=True, logprobs=1, stream=True,
                                                    max_tokens=4, temperature=0))
        assert "".join(e.choices[0].text for e in events) == choice["text"]  # the prompt first, then the rest
        assert events[0].choices[0].logprobs.token_logprobs[0] is None
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            events = list(client.completions.create(model="x", prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                                    extra_body={"prompt_logprobs": 1}))
            chunks = list(client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                                         max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0}))
        first = events[0].choices[0].model_extra["prompt_logprobs"]  # streamed: with the first event
        assert events[0].choices[0].text == "" and len(first) == len(rows) and first[0] is None
        for got, row in zip(first[1:], rows[1:]):
            assert got.keys() == row.keys()
            assert all(got[k]["logprob"] == pytest.approx(row[k]["logprob"], abs=1e-3) for k in row)
        [streamed_chat] = [c.model_extra["prompt_logprobs"] for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
        assert len(streamed_chat) == len(chat["prompt_logprobs"]) and streamed_chat[0] is None
        status, answer = post("/v1/completions", {"prompt": prompt, "prompt_logprobs": 21})
        assert status == 400 and answer["error"]["param"] == "prompt_logprobs"
    finally:
        server.stop()
