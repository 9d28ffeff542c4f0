"""Request bodies for fuzzing every route: each API's own shapes (a valid body per route), then
mutated by hypothesis: values swapped for wrong types, huge and negative numbers, NaN, long and
odd unicode strings, deep nesting; fields dropped and unknown ones added; unknown item types.

``tests/server/test_fuzz.py`` runs a few dozen per route in CI; ``benchmarks/fuzz.py`` runs thousands
beside live streams. Both hold every answer to ``check``: a 2xx, or a 4xx in the API's own error
shape; never a 5xx or a dropped connection.
"""

from __future__ import annotations

import copy
import json
import math
import threading
import urllib.error
import urllib.request
from typing import Any

from hypothesis import strategies as st

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}

# name -> (method, path, shape of its errors, valid bodies)
ROUTES: dict[str, tuple[str, str, str, list[Any]]] = {
    "chat": ("POST", "/v1/chat/completions", "openai", [
        {"messages": CHAT, "max_tokens": 4},
        {"messages": CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
        {"messages": CHAT, "max_tokens": 6, "tools": [TOOL], "tool_choice": "auto", "logprobs": True, "top_logprobs": 2},
        {"messages": [*CHAT, {"role": "assistant", "content": "Well"}], "max_tokens": 3, "n": 2, "seed": 5,
         "response_format": {"type": "json_object"}, "stop": ["\n"], "n_probs": 1, "timings_per_token": True}]),
    "completions": ("POST", "/v1/completions", "openai", [
        {"prompt": "Once upon", "max_tokens": 4, "logprobs": 2, "echo": True},
        {"prompt": [1, 2, 3], "max_tokens": 3, "stream": True, "temperature": 0.5, "top_k": 3}]),
    "embeddings": ("POST", "/v1/embeddings", "openai", [
        {"input": ["a", "b"]}, {"input": "Hello", "encoding_format": "base64"}]),
    "responses": ("POST", "/v1/responses", "openai", [
        {"input": "Hi", "max_output_tokens": 4},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}], "max_output_tokens": 3,
         "stream": True, "instructions": "Be brief", "tools": [{"type": "function", "name": "f", "parameters": {}}]}]),
    "responses_get": ("GET", "/v1/responses/{id}", "openai", [{"id": "resp_" + "0" * 32}]),
    "responses_delete": ("DELETE", "/v1/responses/{id}", "openai", [{"id": "resp_x"}]),
    "messages": ("POST", "/v1/messages", "anthropic", [
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
        {"model": "m", "max_tokens": 4, "system": "Be brief", "stream": True, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
         "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"}}]),
    "count_tokens": ("POST", "/v1/messages/count_tokens", "anthropic", [
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}]),
    "tokenize": ("POST", "/tokenize", "openai", [{"content": "Hello", "with_pieces": True}]),
    "detokenize": ("POST", "/detokenize", "openai", [{"tokens": [1, 2, 3]}]),
    "apply_template": ("POST", "/apply-template", "openai", [{"messages": CHAT}]),
    "completion": ("POST", "/completion", "llama", [
        {"prompt": "Hello", "n_predict": 3, "n_probs": 1},
        {"prompt": [1, "two", 3], "n_predict": 2, "stream": True, "return_progress": True}]),
    "embedding": ("POST", "/embedding", "llama", [{"content": ["a", [1, 2]]}]),
}

ODD_STRINGS = ["", "\x00", "\ud800", "\U0001f600" * 50, "<|im_start|>", "{{ x }}", "%s%n", "\u202e", "a" * 5000,
               "\\", "\n" * 100, "NaN"]
NUMBERS = [0, -1, 1, 2**31, -(2**63), 2**64, 10**30, 1.5, -0.0, 1e308, math.nan, math.inf, -math.inf]


def leaves() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.booleans(), st.sampled_from(NUMBERS), st.integers(), st.floats(),
                     st.sampled_from(ODD_STRINGS), st.text(max_size=40))


def json_values() -> st.SearchStrategy[Any]:
    return st.recursive(leaves(), lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)


def _paths(value: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [here]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*here, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += _paths(item, (*here, i))
    return out


@st.composite
def mutated(draw: Any, bodies: list[Any]) -> Any:
    """One of ``bodies``, with one to three mutations."""
    body = copy.deepcopy(draw(st.sampled_from(bodies)))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(body)
        path = draw(st.sampled_from(paths))
        kind = draw(st.sampled_from(["replace", "replace", "drop", "add", "type", "nest", "duplicate"]))
        if not path:
            if kind in ("replace", "nest"):
                body = draw(json_values()) if kind == "replace" else [body]
            continue
        parent = body
        for step in path[:-1]:
            parent = parent[step]
        key = path[-1]
        if kind == "replace":
            parent[key] = draw(json_values())
        elif kind == "drop":
            parent.pop(key)
        elif kind == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=12))] = draw(json_values())
        elif kind == "type" and isinstance(parent[key], dict):
            parent[key]["type"] = draw(st.sampled_from(["", "image", "tool_use", "bogus", "input_file", None, 7]))
        elif kind == "nest":
            value = parent[key]
            for _ in range(draw(st.integers(1, 40))):
                value = [value]
            parent[key] = value
        elif kind == "duplicate" and isinstance(parent, list):
            parent.extend(copy.deepcopy(parent) * draw(st.integers(1, 20)))
    return body


def send(url: str, method: str, path: str, body: Any) -> tuple[int, bytes]:
    """The status and whole body of a request; raises OSError for a dropped connection."""
    if "{id}" in path:
        ident = body.get("id") if isinstance(body, dict) else body
        path = path.replace("{id}", urllib.request.quote(str(ident)[:200].encode("utf-8", "surrogatepass"), safe=""))
        data = None
    else:
        data = json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def check(status: int, raw: bytes, shape: str) -> str | None:
    """What is wrong with an answer, or None: a 2xx (its body whole JSON or server-sent events), or
    a 4xx in the API's own error shape."""
    if 200 <= status < 300:
        text = raw.decode("utf-8")
        if text.startswith(("data: ", "event: ")):
            for line in text.splitlines():
                if line.startswith("data: ") and line[6:] != "[DONE]":
                    json.loads(line[6:])
            return None
        json.loads(text)
        return None
    if not 400 <= status < 500:
        return f"status {status}: {raw[:300]!r}"
    try:
        answer = json.loads(raw)
    except ValueError:
        return f"a {status} that is not JSON: {raw[:300]!r}"
    error = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not isinstance(error.get("type"), str):
        return f"a {status} without an error object: {answer!r:.300}"
    if shape == "anthropic" and answer.get("type") != "error":
        return f"a {status} not in Anthropic's shape: {answer!r:.300}"
    if shape == "llama" and error.get("code") != status:
        return f"a {status} not in llama-server's shape: {answer!r:.300}"
    return None


# the server the fuzzing runs against: deterministic, so that a watched stream's tokens cannot depend
# on what runs beside it; a small context and a default length, so that a body asking for no limit
# (or for billions of tokens) ends within a few hundred steps, loaded machine or not
SERVER_OPTIONS = ("-c", "512", "-n", "32", "-np", "4", "--deterministic", "--unified-cache", "--max-body-mib", "1",
                  "--log-level", "warning")

WATCHED = [[{"role": "user", "content": "Tell me about the sea."}],
           [{"role": "system", "content": "Count."}, {"role": "user", "content": "One, two,"}]]


def stream_text(url: str, messages: list[dict[str, Any]]) -> str:
    status, raw = send(url, "POST", "/v1/chat/completions",
                       {"messages": messages, "max_tokens": 24, "temperature": 0, "stream": True,
                        "priority": -100})  # ahead of the fuzzing in the queue: lower goes first
    assert status == 200, raw[:300]
    parts = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line[6:] != "[DONE]":
            for choice in json.loads(line[6:])["choices"]:
                parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


class Watch:
    """Greedy streams run over and over beside the fuzzing, each held to what it gave alone."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.alone = [stream_text(url, m) for m in WATCHED]
        self.runs, self.harmed = 0, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for messages, alone in zip(self.alone and WATCHED, self.alone):
                try:
                    text = stream_text(self.url, messages)
                except Exception as exc:  # noqa: BLE001 - a failed stream is harm, told below
                    self.harmed.append(repr(exc))
                    continue
                self.runs += 1
                if text != alone:
                    self.harmed.append(f"{text!r} != {alone!r}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
