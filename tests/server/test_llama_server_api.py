"""``aiollama serve`` as llama-server's own clients use it: its native endpoints, its routes
without ``/v1``, its fields on the OpenAI routes, CORS, its flags. The answers are held side by
side to llama-server's, from the same llama.cpp tag on the same models and requests
(``tests/data/server/llama_server.json``, written by ``tests/data/server/make_goldens.py``): the
same fields of the same types, and the same values where the two engines must agree."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llama_server_api import (
    DIFFERENT,
    NATIVE,
    OPEN,
    REQUESTS,
    call,
    events_shape,
    shape,
    value_at,
)
from server_process import TIMEOUT, Server
from tiny_model import fim_model, rerank_model, spm_model

import aiollama

openai = pytest.importorskip("openai")

DATA = Path(__file__).resolve().parents[1] / "data" / "server"
GOLDEN = json.loads((DATA / "llama_server.json").read_text(encoding="utf-8"))
BASE = ("-c", "2048", "-np", "2", "--no-webui", "--log-level", "warning")  # as the goldens' llama-server ran



@pytest.fixture(scope="module")
def fim_path(smollm2_path: Path) -> Path:
    return fim_model(aiollama.cache_dir() / "test-models", smollm2_path)


class Servers:
    """``aiollama serve`` processes by model and options, each started once."""

    def __init__(self, models: dict[str, Path]) -> None:
        self.models = models
        self.running: dict[tuple[str, tuple[str, ...]], Server] = {}

    def get(self, model: str, *options: str) -> Server:
        key = (model, options)
        if key not in self.running:
            self.running[key] = Server(self.models[model], *BASE, *options)
        return self.running[key]

    def stop(self) -> None:
        for server in self.running.values():
            server.stop()


@pytest.fixture(scope="module")
def servers(tiny_path: Path, fim_path: Path, smollm2_path: Path) -> Iterator[Servers]:
    s = Servers({"tiny": tiny_path, "fim": fim_path,
                 "rerank": rerank_model(aiollama.cache_dir() / "test-models", smollm2_path),
                 "spm": spm_model(aiollama.cache_dir() / "test-models")})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tiny(servers: Servers) -> Server:
    return servers.get("tiny")


def mismatches(ours: Any, theirs: Any, *, exact: bool, skip: set[str], open_: set[str], path: str = "") -> list[str]:
    """Where the shape of our answer (from ``shape``) differs from llama-server's: a field it has
    that we lack, or of another type; with ``exact``, also a field only we have. An empty list
    stands for a list of any items."""
    where = path or "(top)"
    if path in skip:
        return []
    if path in open_:
        return [] if isinstance(ours, dict) else [f"{where}: {ours!r}, not an object"]
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{where}: {ours!r}, not an object"]
        out = [f"{where}: no {k!r}" for k in theirs if k not in ours]
        if exact:
            out += [f"{where}: {k!r} is not in llama-server's answer" for k in ours if k not in theirs]
        for k in theirs:
            if k in ours:
                out += mismatches(ours[k], theirs[k], exact=exact, skip=skip, open_=open_,
                                  path=f"{path}/{k}" if path else k)
        return out
    if isinstance(theirs, list):
        if not isinstance(ours, list):
            return [f"{where}: {ours!r}, not a list"]
        if theirs and ours:
            return mismatches(ours[0], theirs[0], exact=exact, skip=skip, open_=open_, path=path)
        return []
    return [] if ours == theirs else [f"{where}: {ours}, llama-server's is {theirs}"]


def worst(ours: Any, theirs: Any) -> float:
    """The largest difference between two numbers or nested lists of them (for messages)."""
    if isinstance(theirs, list) and isinstance(ours, list):
        return max((worst(o, t) for o, t in zip(ours, theirs)), default=0.0)
    return abs(ours - theirs) if isinstance(ours, int | float) and isinstance(theirs, int | float) else 0.0


def same_value(ours: Any, theirs: Any) -> bool:
    if isinstance(theirs, float) or isinstance(ours, float):
        # the same computation summed in another order (other kernels, threads or batch shapes
        # give per-token embeddings of unit scale differences up to about 3e-4); a wrong token or
        # pooling differs by far more
        return math.isclose(ours, theirs, rel_tol=2e-3, abs_tol=1e-3)
    if isinstance(theirs, list):
        return isinstance(ours, list) and len(ours) == len(theirs) and all(map(same_value, ours, theirs))
    return bool(ours == theirs)


@pytest.mark.parametrize("name", list(REQUESTS))
def test_answers_match_llama_server(servers: Servers, name: str) -> None:
    model, options, method, path, body, headers = REQUESTS[name]
    server = servers.get(model, *options)
    status, answer = call(server.url, method, path, body, headers)
    golden = GOLDEN[name]
    assert status == golden["status"], answer
    streamed = isinstance(body, dict) and body.get("stream")
    ours = events_shape(answer) if streamed else shape(answer)
    rules = {"exact": name in NATIVE, "skip": DIFFERENT.get(name, set()), "open_": OPEN.get(name, set())}
    if streamed:
        assert len(ours) == len(golden["shape"]), (ours, golden["shape"])
        problems = [p for o, t in zip(ours, golden["shape"]) for p in mismatches(o, t, **rules)]
    else:
        problems = mismatches(ours, golden["shape"], **rules)
    assert not problems, problems
    for value_path, theirs in golden["values"].items():
        value = value_at(answer, value_path)
        assert same_value(value, theirs), (value_path, f"worst difference {worst(value, theirs)}", value, theirs)


@pytest.mark.anyio
async def test_the_openai_client_works_without_v1(tiny: Server) -> None:
    async with openai.AsyncOpenAI(base_url=tiny.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
        models = await client.models.list()
        chat = await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=3, temperature=0)
        stream = await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=3, temperature=0, stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        embedded = await client.embeddings.create(model="x", input=["Hi", "there"])
        response = await client.responses.create(model="x", input="Hi", max_output_tokens=3, temperature=0)
    assert [m.id for m in models.data] == ["tiny-llama-v1-default"]
    assert chat.choices[0].message.content == streamed and chat.usage.completion_tokens == 3
    assert chat.system_fingerprint == f"aiollama-{aiollama.__version__}"
    assert len(embedded.data) == 2 and math.isclose(sum(x * x for x in embedded.data[0].embedding), 1.0, rel_tol=1e-4)
    assert response.status == "incomplete" and response.output_text == chat.choices[0].message.content


def test_a_browser_preflight_and_its_request_are_answered(tiny: Server) -> None:
    asked = {"Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers = _options(tiny, "/v1/chat/completions", asked)
    assert status == 200
    assert headers["access-control-allow-origin"] == "http://localhost:5173"
    assert "POST" in headers["access-control-allow-methods"]
    assert headers["access-control-allow-headers"] == "authorization, content-type"  # named: credentials go along
    assert headers["access-control-allow-credentials"] == "true"
    status, headers = _options(tiny, "/completion", {**asked, "Origin": "https://evil.example"})
    assert status == 200 and "access-control-allow-origin" not in headers  # not a local page: the browser stops
    status, answer_headers, _ = tiny.post("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}).encode(),
                                          {"Origin": "http://127.0.0.1:8080"})
    assert status == 200 and answer_headers["access-control-allow-origin"] == "http://127.0.0.1:8080"
    status, answer_headers, _ = tiny.post("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}).encode(),
                                          {"Origin": "https://evil.example"})
    assert status == 200 and answer_headers["access-control-allow-origin"] is None


def test_cors_origins_are_chosen_by_flag(servers: Servers) -> None:
    anyone = servers.get("tiny", "--cors-origins", "*", "--no-cors-credentials")
    _, headers = _options(anyone, "/props", {"Origin": "https://app.example", "Access-Control-Request-Method": "GET"})
    assert headers["access-control-allow-origin"] == "*" and headers["access-control-allow-credentials"] == "false"
    listed = servers.get("tiny", "--allowed-origins", "https://app.example,https://b.example")
    assert _options(listed, "/props", {"Origin": "https://b.example"})[1]["access-control-allow-origin"] == \
        "https://b.example"
    assert "access-control-allow-origin" not in _options(listed, "/props", {"Origin": "http://localhost:3000"})[1]


def _options(server: Server, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    import urllib.request

    request = urllib.request.Request(server.url + path, method="OPTIONS", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, {k.lower(): v for k, v in response.headers.items()}


def test_the_prompt_shown_is_what_llama_detokenize_makes_of_its_tokens(servers: Servers) -> None:
    """llama-server shows a request's prompt as ``llama_detokenize`` makes it of the prompt's tokens,
    special tokens as their text (server-common.cpp, ``server_tokens::detokenize``): on a
    SentencePiece model the first piece loses its leading space, which joining the pieces keeps."""
    from aiollama.native import Model

    with Model(servers.models["spm"], vocab_only=True) as model:
        words = model.vocab.tokenize("Hello world", add_special=False)
        plain = model.vocab.detokenize(words, unparse_special=True)
        joined = b"".join(model.vocab.token_to_piece(t, special=True) for t in words).decode()
        with_bos = model.vocab.detokenize([model.vocab.bos, *words], unparse_special=True)
    assert plain == "Hello world" and joined == " Hello world" and with_bos == "<s> Hello world"
    spm = servers.get("spm")
    status, answer = call(spm.url, "POST", "/completion", {"prompt": words, "n_predict": 1})
    assert status == 200 and answer["prompt"] == plain
    status, answer = call(spm.url, "POST", "/completion", {"prompt": "Hello world", "n_predict": 1})
    assert status == 200 and answer["prompt"] == with_bos
    status, answer = call(spm.url, "POST", "/v1/completions", {"prompt": words, "max_tokens": 1, "verbose": True})
    assert status == 200 and answer["__verbose"]["prompt"] == plain


def test_infill_fills_the_middle_in_the_models_fim_tokens(servers: Servers) -> None:
    fim = servers.get("fim", "-c", "8192")
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 4, "temperature": 0,
            "input_extra": [{"filename": "util.py", "text": "import os\n"}], "prompt": "return"}
    status, answer = call(fim.url, "POST", "/infill", body)
    assert status == 200, answer
    assert answer["prompt"] == ("<reponame>myproject\n\n\n--- snippet ---\n\nimport os\n"
                                "<fim_prefix>def add(a, b):\n    return<fim_suffix>\n<fim_middle>")
    assert answer["tokens_predicted"] == 4 and answer["stop_type"] == "limit"
    # OpenAI's suffix on the legacy completions: the same middle
    status, legacy = call(fim.url, "POST", "/v1/completions", {"prompt": "def add(a, b):\n    return", "suffix": "\n",
                                                             "max_tokens": 4, "temperature": 0, "verbose": True})
    assert status == 200 and legacy["__verbose"]["prompt"] == \
        "<reponame>myproject\n<fim_prefix>def add(a, b):\n    return<fim_suffix>\n<fim_middle>"
    # a model without FIM tokens cannot
    status, answer = call(servers.get("tiny").url, "POST", "/infill", body)
    assert status == 501 and answer["error"]["type"] == "not_supported_error"
    for missing in ("input_prefix", "input_suffix"):
        status, answer = call(fim.url, "POST", "/infill", {k: v for k, v in body.items() if k != missing})
        assert status == 400 and missing in answer["error"]["message"]


def test_a_long_prompt_streams_its_progress(tiny: Server) -> None:
    prompt = "one two three four " * 200  # 800 tokens: four steps of the engine's 256-token prefill
    status, events = call(tiny.url, "POST", "/completion", {"prompt": prompt, "n_predict": 2, "stream": True,
                                                            "return_progress": True, "cache_prompt": False})
    assert status == 200
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert len(progress) >= 2, progress
    processed = [p["processed"] for p in progress]
    assert processed == sorted(set(processed)) and processed[0] < progress[0]["total"]
    assert processed[-1] >= progress[-1]["total"] - 1 and all(p["cache"] == 0 for p in progress)
    texts = [e for e in events if e.get("content")]
    assert events[-1]["stop"] is True and len(texts) >= 1
    # on the OpenAI routes too, as chunks with no text
    status, chunks = call(tiny.url, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "stream": True, "return_progress": True,
        "timings_per_token": True})
    assert status == 200
    reports = [c for c in chunks if "prompt_progress" in c]
    assert len(reports) >= 2 and all("timings" in c for c in reports)
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": None} for c in reports)


def test_llama_fields_on_the_openai_routes(tiny: Server) -> None:
    chat = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
    status, answer = call(tiny.url, "POST", "/v1/chat/completions", {**chat, "n_predict": 3, "max_tokens": 9})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3  # n_predict goes over max_tokens
    status, answer = call(tiny.url, "POST", "/v1/chat/completions", {**chat, "max_tokens": 2, "n_probs": 2})
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and len(content[0]["top_logprobs"]) == 2 and isinstance(content[0]["id"], int)
    status, answer = call(tiny.url, "POST", "/v1/chat/completions", {**chat, "max_tokens": 2, "id_slot": 1})
    assert status == 200
    status, answer = call(tiny.url, "POST", "/v1/chat/completions", {**chat, "max_tokens": 2, "id_slot": 7})
    assert status == 400 and answer["error"]["param"] == "id_slot"  # two slots here
    status, answer = call(tiny.url, "POST", "/v1/chat/completions", {**chat, "max_tokens": 2, "verbose": True})
    verbose = answer["__verbose"]
    assert verbose["prompt"].endswith("<|im_start|>assistant\n") and verbose["tokens_predicted"] == 2
    assert verbose["generation_settings"]["temperature"] == 0
    status, events = call(tiny.url, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True,
                                                                "n_probs": 1, "timings_per_token": True})
    texts = [e for e in events if e["choices"] and e["choices"][0]["text"]]
    assert texts and all("timings" in e and e["choices"][0]["logprobs"]["content"] for e in texts)
    assert events[-1]["timings"]["predicted_n"] == 3 and all(e["system_fingerprint"] for e in events)
    for field, value in (("n_probs", -1), ("timings_per_token", "yes"), ("verbose", 1), ("n_predict", -2)):
        status, answer = call(tiny.url, "POST", "/v1/chat/completions", {**chat, field: value})
        assert status == 400 and answer["error"]["param"] == field


def test_native_completion_fields(tiny: Server) -> None:
    status, answer = call(tiny.url, "POST", "/completion", {"prompt": ["Hello", "Once upon"], "n_predict": 2,
                                                            "temperature": 0})
    assert status == 200 and [a["index"] for a in answer] == [0, 1]  # a list of prompts: a result each
    assert [a["prompt"] for a in answer] == ["Hello", "Once upon"]
    status, answer = call(tiny.url, "POST", "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0,
                                                            "response_fields": ["content", "generation_settings/n_predict"]})
    assert set(answer) == {"content", "generation_settings/n_predict"} and answer["generation_settings/n_predict"] == 4
    status, answer = call(tiny.url, "POST", "/completion", {"prompt": "Hello", "n_predict": 0})
    assert status == 200 and answer["tokens_predicted"] == 1  # llama-server samples one
    status, answer = call(tiny.url, "POST", "/completion", {"prompt": "Hello", "n_predict": 6, "temperature": 0,
                                                            "samplers": ["top_k", "temperature"], "top_k": 1})
    assert answer["generation_settings"]["samplers"] == ["top_k", "temperature"]
    status, answer = call(tiny.url, "POST", "/completion", {"prompt": "Hello", "samplers": ["temperature", "top_k"]})
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    status, answer = call(tiny.url, "POST", "/completion", {"prompt": "Hello", "mirostat": 2})
    assert status == 400 and "mirostat" in answer["error"]["message"]
    status, answer = call(tiny.url, "POST", "/completion", {"prompt": "Hello", "n_predict": 3, "temperature": 0,
                                                            "logit_bias": [["Hello", False]], "stop": ["\n"]})
    assert status == 200 and answer["generation_settings"]["logit_bias"][0]["bias"] < -1e29
    status, answer = call(tiny.url, "POST", "/completion", {"prompt": [10**9]})
    assert status == 400 and answer["error"]["code"] == 400
    status, answer = call(tiny.url, "POST", "/completion", {"prompt": "word " * 3000})
    assert status == 400 and answer["error"]["type"] == "exceed_context_size_error"
    assert answer["error"]["n_ctx"] == 1024 and answer["error"]["n_prompt_tokens"] > 3000


def test_json_object_with_a_schema_is_honoured(tiny: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    status, answer = call(tiny.url, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_object", "schema": schema}})
    assert status == 200
    value = json.loads(answer["choices"][0]["message"]["content"])
    assert set(value) == {"n"} and isinstance(value["n"], int)


def test_prefill_continues_the_assistants_message(tiny: Server) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, I"}]
    status, rendered = call(tiny.url, "POST", "/apply-template", {"messages": messages})
    assert status == 200 and rendered["prompt"].endswith("<|im_start|>assistant\nWell, I")
    status, answer = call(tiny.url, "POST", "/apply-template", {"messages": messages, "add_generation_prompt": True,
                                                                "continue_final_message": False})
    assert status == 200 and answer["prompt"].endswith("<|im_start|>assistant\n")
    status, answer = call(tiny.url, "POST", "/chat/completions", {"messages": messages, "max_tokens": 2,
                                                                  "temperature": 0, "verbose": True})
    assert status == 200 and answer["__verbose"]["prompt"] == rendered["prompt"]


def test_embedding_forms_and_pooling(servers: Servers) -> None:
    per_token = servers.get("tiny", "--embeddings", "--pooling", "none")
    status, answer = call(per_token.url, "POST", "/embedding", {"content": [[19556, 1834], "Hi"]})
    assert status == 200 and [len(a["embedding"]) for a in answer] == [2, 1]
    status, answer = call(per_token.url, "POST", "/v1/embeddings", {"input": "Hi"})
    assert status == 400 and "not OAI compatible" in answer["error"]["message"]
    pooled = servers.get("tiny", "--pooling", "mean")
    status, answer = call(pooled.url, "POST", "/embedding", {"content": "Hello", "embd_normalize": -1})
    raw = answer[0]["embedding"][0]
    status, answer = call(pooled.url, "POST", "/embedding", {"content": "Hello", "embd_normalize": 1})
    assert math.isclose(sum(abs(x) for x in answer[0]["embedding"][0]), 1.0, rel_tol=1e-6)
    assert math.isclose(answer[0]["embedding"][0][0] * sum(abs(x) for x in raw), raw[0], rel_tol=1e-5)
    status, answer = call(pooled.url, "POST", "/embeddings", {"content": "Hello"})
    assert isinstance(answer, list) and answer[0]["index"] == 0  # llama-server's form for its own field


def test_props_and_the_flags_named_as_llama_servers(servers: Servers) -> None:
    server = servers.get("tiny", "--alias", "my-model", "--temp", "0.25", "--top-k", "5", "-n", "7", "-t", "1",
                         "--props", "--jinja", "--embeddings", "--metrics")
    _, props = call(server.url, "GET", "/props")
    params = props["default_generation_settings"]["params"]
    assert params["temperature"] == 0.25 and params["top_k"] == 5 and params["n_predict"] == 7
    assert props["model_alias"] == "my-model" and props["total_slots"] == 2
    assert call(server.url, "POST", "/props", {})[1] == {"success": True}
    _, answer = call(server.url, "POST", "/completion", {"prompt": "Hello"})
    settings = answer["generation_settings"]
    assert settings["temperature"] == 0.25 and answer["tokens_predicted"] == 7 and answer["model"] == "my-model"
    _, answer = call(server.url, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                       "verbose": True})
    assert answer["__verbose"]["generation_settings"]["temperature"] == 0.25
    assert answer["usage"]["completion_tokens"] == 7
    help_text = subprocess.run([sys.executable, "-m", "aiollama", "serve", "--help"], capture_output=True, text=True,
                               check=True).stdout
    for flag in ("--pooling", "--cors-origins", "--alias", "-np", "-ngl", "-t", "-m", "--temp", "--chat-template-file",
                 "--reasoning", "-c", "--props", "-n"):
        assert f" {flag}" in help_text, flag


def test_health_answers_503_while_the_model_loads(tiny_path: Path) -> None:
    from fake_executor import FakeExecutor
    from starlette.testclient import TestClient

    from aiollama.server import create_app

    loaded = threading.Event()

    def slow(config: Any) -> FakeExecutor:
        loaded.wait(TIMEOUT)
        return FakeExecutor(config)

    app = create_app(tiny_path, executor=slow, load_in_background=True)
    with TestClient(app) as client:
        for path in ("/health", "/v1/health"):
            answer = client.get(path)
            assert answer.status_code == 503
            assert answer.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        assert client.post("/completion", json={"prompt": "Hi"}).status_code == 503
        loaded.set()
        for _ in range(int(TIMEOUT / 0.05)):
            if client.get("/health").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert client.get("/health").json() == {"status": "ok"}


DOC = Path(__file__).resolve().parents[2] / "docs" / "llama-server.md"
FLAG_ROWS = [row.split(", ") for row in (DATA / "llama_server_flags.txt")
             .read_text(encoding="utf-8").splitlines() if row]


def doc_tables() -> dict[str, list[tuple[list[str], str, str]]]:
    """The compatibility tables of docs/llama-server.md by section: each row's names, its status
    (same, mapped, refused) and what it says."""
    sections: dict[str, list[tuple[list[str], str, str]]] = {}
    for part in re.split(r"^## ", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]:
        title, _, body = part.partition("\n")
        rows = []
        for line in body.splitlines():
            if line.startswith("| `"):
                cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
                rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[1] if len(cells) > 2 else "refused", cells[-1]))
        sections[title.strip()] = rows
    return sections


def counts() -> dict[str, Counter[str]]:
    tables = doc_tables()
    out = {"endpoints": Counter(status for _, status, _ in tables["Endpoints"]),
           "fields": Counter(status for names, status, _ in tables["Request fields of `/completion` and `/infill`"]
                             for _ in names),
           "openai": Counter(status for names, status, _ in tables["llama.cpp's fields on the OpenAI routes"]
                             for _ in names)}
    status = {name: s for names, s, _ in tables["Flags"] for name in names}
    flags: Counter[str] = Counter()
    for row in FLAG_ROWS:
        statuses = {status[name] for name in row}
        flags["refused" if statuses == {"refused"} else "same" if statuses == {"same"} else "mapped"] += 1
    out["flags"] = flags
    return out


def test_the_compatibility_table_covers_every_flag_and_its_counts_are_right() -> None:
    tables = doc_tables()
    listed = {name for names, _, _ in tables["Flags"] for name in names}
    assert not [name for row in FLAG_ROWS for name in row if name not in listed]
    summary = re.findall(r"^\| ([a-z].*?) \| (\d+) \| (\d+) \| (\d+) \|$", DOC.read_text(encoding="utf-8"),
                         flags=re.MULTILINE)
    stated = {label.split(" ")[0]: (int(a), int(b), int(c)) for label, a, b, c in summary}
    found = counts()
    for key, label in (("endpoints", "endpoints"), ("flags", "flags"), ("fields", "request"), ("openai", "llama.cpp's")):
        assert stated[label] == (found[key]["same"], found[key]["mapped"], found[key]["refused"]), key


def test_every_flag_is_taken_or_refused_as_the_table_says() -> None:
    from aiollama.cli import parser
    from aiollama.serve_flags import REFUSED, _Refused

    serve = parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    actions = serve._option_string_actions
    reasons = {name: reason for reason, names in REFUSED for name in names}
    for names, status, what in doc_tables()["Flags"]:
        for name in names:
            assert name in actions, name
            assert isinstance(actions[name], _Refused) == (status == "refused"), name
            if status == "refused":
                assert reasons[name] == what.strip(), name  # the docs give the reason the command prints
    done = subprocess.run([sys.executable, "-m", "aiollama", "serve", "--dry-multiplier", "0.5"], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 2 and "--dry-multiplier is llama-server's and not taken here: that sampler" in done.stderr


def test_every_endpoint_is_served_or_refused_as_the_table_says(tiny: Server) -> None:
    import urllib.error
    import urllib.request

    def status(method: str, path: str) -> int:
        request = urllib.request.Request(tiny.url + path, b"{}" if method == "POST" else None, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    for names, state, _ in doc_tables()["Endpoints"]:
        paths = [name.rpartition(" ")[2].replace("{id}", "0") for name in names]
        for path in paths:
            if path == "/infill":
                continue  # the tiny model has no FIM tokens (501); test_infill... serves it on one that has
            if path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking", "/models/load", "/models/unload"):
                continue  # a reranker's, and a server of several models' (test_models_router serves them)
            answers = {status("GET", path), status("POST", path)}
            if state == "refused":
                assert 501 in answers, (path, answers)
            else:
                assert answers - {404, 405, 501}, (path, answers)


def test_stream_options_and_cache_prompt_are_honoured_or_refused(tiny: Server) -> None:
    chat = {"messages": [{"role": "user", "content": "Tell me about the sea " * 20}], "max_tokens": 3,
            "temperature": 0}
    status, answer = call(tiny.url, "POST", "/v1/chat/completions", {**chat, "stream": True,
                                                                      "stream_options": {"made_up": True}})
    assert status == 400 and answer["error"]["param"] == "stream_options.made_up"
    status, answer = call(tiny.url, "POST", "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    assert status == 400 and answer["error"]["param"] == "stream_options"  # only with stream
    status, events = call(tiny.url, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True,
                                                                "stream_options": {"include_usage": True,
                                                                                   "include_obfuscation": True}})
    assert status == 200 and events[-1]["usage"]["completion_tokens"] == 3
    assert all(e["usage"] is None for e in events[:-1]) and all(isinstance(e["obfuscation"], str) for e in events)
    call(tiny.url, "POST", "/v1/chat/completions", chat)  # now cached
    _, again = call(tiny.url, "POST", "/v1/chat/completions", chat)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    _, fresh = call(tiny.url, "POST", "/v1/chat/completions", {**chat, "cache_prompt": False})
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert fresh["choices"][0]["message"] == again["choices"][0]["message"]  # the same reply, evaluated anew
    _, native = call(tiny.url, "POST", "/completion", {"prompt": "Tell me about the sea " * 20, "n_predict": 1,
                                                       "cache_prompt": False})
    assert native["timings"]["cache_n"] == 0


def test_cache_types_and_flash_attention_reach_the_engine_and_metrics_say_where_it_runs(servers: Servers) -> None:
    server = servers.get("tiny", "-ctk", "bf16", "-ctv", "f32", "-fa", "on", "--public-metrics")
    status, answer = call(server.url, "POST", "/completion", {"prompt": "Hello", "n_predict": 3, "temperature": 0})
    assert status == 200 and answer["tokens_predicted"] == 3
    _, stored = call(server.url, "POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 2})
    metrics = server.get("/metrics")[1]
    info = re.search(r"^aiollama_engine_info\{(.*)\} 1\.0$", metrics, flags=re.MULTILINE)
    assert info is not None, metrics[:2000]
    assert 'cache_type_k="bf16"' in info.group(1) and 'cache_type_v="f32"' in info.group(1)
    assert 'flash_attn="on"' in info.group(1) and 'n_seq_max="2"' in info.group(1)
    assert re.search(r'^aiollama_device_info\{kv_cache="CPU",weights="CPU"\} 1\.0$', metrics, flags=re.MULTILINE)
    assert re.search(r"^aiollama_responses_stored 1\.0$", metrics, flags=re.MULTILINE), stored
    assert float(re.search(r"^aiollama_responses_stored_bytes (\S+)$", metrics, flags=re.MULTILINE).group(1)) > 0  # type: ignore[union-attr]
