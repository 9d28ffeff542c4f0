"""The pieces behind llama-server's clients, without a server: CORS origins, llama.cpp's request
fields, fill-in-the-middle prompts, and the engine's prompt progress."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from fake_executor import ByteTokenizer, FakeExecutor

from aiollama import Engine
from aiollama.errors import InvalidRequestError
from aiollama.formats.infill import infill_tokens
from aiollama.server.bad_request import BadRequest
from aiollama.server.cors import Cors, is_local
from aiollama.server.native_request import (
    llama_fields,
    logit_bias,
    native_prompts,
    native_request,
)


def test_local_origins_and_the_cors_choices() -> None:
    assert is_local("http://localhost:3000") and is_local("https://127.0.0.1") and is_local("http://[::1]:8080")
    assert not is_local("http://localhost.evil.example") and not is_local("file://localhost") and not is_local("")
    assert Cors().allowed("http://localhost:5173") == "http://localhost:5173"
    assert Cors().allowed("https://app.example") is None and Cors().allowed("") is None
    assert Cors("*", credentials=True).allowed("https://app.example") == "https://app.example"  # named
    assert Cors("*", credentials=False).allowed("https://app.example") == "*"
    listed = Cors("https://a.example, https://b.example/")
    assert listed.allowed("https://b.example") == "https://b.example" and listed.allowed("https://c.example") is None


def test_native_fields_are_honoured_mapped_or_refused() -> None:
    native = native_request({"prompt": "x", "n_predict": 0, "temperature": -1, "top_k": -5, "n_probs": 3,
                             "samplers": ["top_k", "temperature"], "cache_prompt": False, "seed": -1,
                             "xtc_threshold": 0.3, "mirostat": 0},
                            n_slots=2, tokenize=lambda text: [1])
    params = native.params
    assert params["max_tokens"] == 1 and params["temperature"] == 0.0 and params["top_k"] == 0
    assert params["logprobs"] and params["top_logprobs"] == 3 and "seed" not in params
    assert params["top_p"] == 1.0 and params["min_p"] == 0.0 and params["repeat_penalty"] == 1.0  # not named: off
    assert native.fresh and native.samplers == ["top_k", "temperature"] and native.settings == {"xtc_threshold": 0.3}
    for body, param in (({"mirostat": 2}, "mirostat"), ({"dry_multiplier": 0.8}, "dry_multiplier"),
                        ({"samplers": ["temperature", "top_k"]}, "samplers"), ({"samplers": ["mirostat"]}, None),
                        ({"id_slot": 2}, "id_slot"), ({"n_probs": 99}, "n_probs"), ({"cache_prompt": 1}, "cache_prompt"),
                        ({"stop": [""]}, "stop"), ({"lora": [{"id": "x", "scale": "big"}]}, "lora")):
        with pytest.raises(BadRequest) as info:
            native_request(body, n_slots=2, tokenize=lambda text: [1])
        assert param is None or info.value.param == param, body
    assert native_request({"top_n_sigma": -1.0}, n_slots=1, tokenize=None).params == {}


def test_llama_fields_of_the_openai_routes() -> None:
    fields = llama_fields({"n_predict": -1, "timings_per_token": True, "n_probs": 2, "id_slot": -1}, n_slots=4)
    assert fields.params == {"max_tokens": None, "prompt_progress": True, "logprobs": True, "top_logprobs": 2}
    assert fields.timings_per_token and not fields.return_progress
    with pytest.raises(BadRequest):
        llama_fields({"verbose": "yes"}, n_slots=4)


def test_logit_bias_forms() -> None:
    tokens = {"Hi": [7, 8]}
    assert logit_bias([[5, 1.5], ["Hi", False]], tokens.__getitem__) == {5: 1.5, 7: -1e30, 8: -1e30}
    assert logit_bias({"12": -2, "Hi": 1}, tokens.__getitem__) == {12: -2.0, 7: 1.0, 8: 1.0}
    for bad in ([[1]], [[1, "x"]], [[-3, 1.0]], [[1.5, 1.0]], "x"):
        with pytest.raises(BadRequest):
            logit_bias(bad, tokens.__getitem__)


def test_prompts_as_llama_server_reads_them() -> None:
    def tokenize(text: str, first: bool) -> list[int]:
        return ([0] if first else []) + [ord(c) for c in text]

    check = int
    assert native_prompts("ab", tokenize, check) == [[0, 97, 98]]
    assert native_prompts([5, "ab", 6], tokenize, check) == [[5, 97, 98, 6]]  # mixed: one prompt, BOS only first
    assert native_prompts(["ab", [5, 6], {"prompt_string": "c"}], tokenize, check) == [[0, 97, 98], [5, 6], [0, 99]]
    for bad in ([], [{"prompt_string": "x", "multimodal_data": ["AAAA"]}], [True], {"x": 1}, 3):
        with pytest.raises(BadRequest):
            native_prompts(bad, tokenize, check)


class FimTokenizer(ByteTokenizer):
    fim: ClassVar[dict[str, int]] = {"pre": 300, "suf": 301, "mid": 302, "rep": -1, "sep": 303}


def test_infill_prompts_follow_the_repository_pattern_and_fit_a_batch() -> None:
    tok = FimTokenizer()
    prefix, suffix = "p" * 100, "s" * 100
    tokens = infill_tokens(tok, prefix, suffix, [{"filename": "a.py", "text": "xy"}], n_batch=40, n_predict=4,
                           n_ctx=200)
    sep_a = [303, *b"a.py\n"]
    sep_file = [303, *b"filename\n"]
    head = sep_a + list(b"xy") + sep_file
    assert tokens[:len(head)] == head
    body = tokens[len(head):]
    assert body[0] == 300 and body.count(ord("p")) == 30 and body.count(ord("s")) == 8  # 3:1 of the batch
    assert body[31] == 301 and body[-1] == 302
    # the extra chunks take what the context leaves past a batch and the reply; here nothing
    tight = infill_tokens(tok, prefix, suffix, [{"filename": "a.py", "text": "xy"}], n_batch=40, n_predict=4, n_ctx=44)
    assert tight[0] == 300
    with pytest.raises(InvalidRequestError):
        infill_tokens(ByteTokenizer(), "a", "b", n_batch=40, n_predict=4, n_ctx=200)  # no FIM tokens
    with pytest.raises(InvalidRequestError):
        infill_tokens(tok, "a", "b", [{"filename": 3}], n_batch=40, n_predict=4, n_ctx=200)


@pytest.mark.anyio
async def test_a_stream_reports_its_prompts_evaluation() -> None:
    def fake(config: Any) -> FakeExecutor:
        return FakeExecutor(config)

    async with Engine(executor=fake, n_ctx=512, n_seq_max=2, n_batch=64, step_tokens=32) as engine:
        conv = engine.conversation()
        conv.prompt(list(range(10, 110)))  # 100 tokens: four steps of 32
        progress, text = [], []
        async for chunk in conv.stream(max_tokens=3, temperature=0, prompt_progress=True):
            if chunk.progress is not None:
                assert not chunk.tokens and not text  # all before the reply
                progress.append(chunk.progress)
            else:
                text.append(chunk)
        assert len(progress) >= 3 and all(total == 100 and cached == 0 for total, cached, _ in progress)
        evaluated = [done for _, _, done in progress]
        assert evaluated == sorted(set(evaluated)) and evaluated[-1] >= 99 and len(text) >= 1
        again = engine.conversation()
        again.prompt(list(range(10, 110)))
        chunks = [c async for c in again.stream(max_tokens=1, temperature=0, prompt_progress=True)]
        reports = [c.progress for c in chunks if c.progress is not None]
        assert reports and reports[0][1] > 0  # the prefix came from the cache
        quiet = engine.conversation()
        quiet.prompt(list(range(10, 110)))
        assert all(c.progress is None for c in [c async for c in quiet.stream(max_tokens=2)])
        await conv.aclose()
        await again.aclose()
        await quiet.aclose()
