"""A server safe to expose: API keys, body and nesting limits, requests in flight per key, fields
that are read or refused (never dropped), and llama-server's tokenizer tools. Real processes on
127.0.0.1, driven by the official openai client and by raw HTTP."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from server_process import TIMEOUT, Server

from aiollama.server.guard import Guard, Limits, depth, load_keys

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.anyio

KEYS = ("sk-first", "sk-second")



@pytest.fixture(scope="module")
def guarded(tiny_path: Path) -> Iterator[Server]:
    s = Server(tiny_path, "--n-ctx", "4096", "--n-seq-max", "4", "--api-key", KEYS[0], "--api-key", KEYS[1],
               "--max-body-mib", "1", "--max-streams-per-key", "1", "--log-level", "warning")
    yield s
    s.stop()


def client(server: Server, key: str) -> Any:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


def post(server: Server, path: str, body: Any, key: str | None = KEYS[0], **headers: str) -> tuple[int, Any]:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    status, _, answer = server.post(path, json.dumps(body).encode(), headers)
    return status, answer


def metrics(server: Server) -> str:
    request = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
        text: str = r.read().decode()
    return text


def metric(server: Server, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", metrics(server), re.M)
    return float(match.group(1)) if match else 0.0


def raw(server: Server, request: bytes, wait_for_close: bool = True) -> bytes:
    """Send ``request`` as it is; the answer up to the close (or up to the first blank line)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            if not wait_for_close and b"\r\n\r\n" in data:
                break
        return data


async def test_keys_are_needed_and_checked(guarded: Server) -> None:
    async with client(guarded, "sk-wrong") as wrong:
        with pytest.raises(openai.AuthenticationError) as info:
            await wrong.completions.create(model="x", prompt="Hi", max_tokens=2)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    for key in KEYS:
        async with client(guarded, key) as right:
            reply = await right.completions.create(model="x", prompt="Hi", max_tokens=2, temperature=0)
        assert reply.usage.completion_tokens == 2
    # Anthropic's clients send x-api-key
    assert post(guarded, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, key=None, **{"x-api-key": KEYS[1]})[0] == 200
    assert post(guarded, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, key=None)[0] == 401
    assert guarded.get("/health")[0] == 200  # open: load balancers probe it
    assert guarded.get("/metrics")[0] == 401  # open only when asked


def test_keys_come_from_options_a_file_and_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "keys").write_text("# ours\nsk-file\n\n  sk-two  \n")
    monkeypatch.setenv("AIOLLAMA_API_KEY", "sk-env, sk-more")
    assert load_keys(["sk-arg", "sk-file"], tmp_path / "keys") == ("sk-arg", "sk-file", "sk-two", "sk-env", "sk-more")
    monkeypatch.delenv("AIOLLAMA_API_KEY")
    assert load_keys() == () and not Guard().keys
    with pytest.raises(ValueError, match="max_body_bytes"):
        Limits(max_body_bytes=0)


async def test_a_declared_body_past_the_limit_is_refused_before_it_is_read(guarded: Server) -> None:
    # 10 MB announced, not a byte of it sent: the answer cannot come from reading it
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {10 << 20}\r\n\r\n").encode()
    answer = await anyio.to_thread.run_sync(lambda: raw(guarded, head, wait_for_close=False))
    assert answer.startswith(b"HTTP/1.1 413")


async def test_a_body_past_the_limit_without_a_length_is_cut_off(guarded: Server) -> None:
    body = json.dumps({"prompt": "word " * 500_000, "max_tokens": 1}).encode()  # 2.5 MB, chunked
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 65536]), body[i:i + 65536])
                       for i in range(0, len(body), 65536)) + b"0\r\n\r\n"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    refused = 'aiollama_requests_total{endpoint="completions",status="413"}'
    before = metric(guarded, refused)
    try:
        answer = await anyio.to_thread.run_sync(lambda: raw(guarded, head + chunked))
    except (BrokenPipeError, ConnectionResetError):  # closed while the rest was still being sent
        answer = b""
    assert answer.startswith(b"HTTP/1.1 413") or answer == b""
    assert metric(guarded, refused) == before + 1
    assert post(guarded, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})[0] == 200  # served as before


@pytest.mark.parametrize("levels", [65, 100_000])
async def test_json_nested_too_deep_gets_a_400_not_a_500(guarded: Server, levels: int) -> None:
    deep = '{"prompt": "Hi", "max_tokens": 1, "x": ' + "[" * levels + "]" * levels + "}"
    status, _, answer = await anyio.to_thread.run_sync(
        lambda: guarded.post("/v1/completions", deep.encode(), {"Authorization": f"Bearer {KEYS[0]}"}))
    assert status == 400 and answer["error"]["code"] == "json_too_deep"
    assert post(guarded, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})[0] == 200


def test_depth_counts_containers() -> None:
    assert depth(1, 64) == 0 and depth([], 64) == 1 and depth({"a": [1, {"b": []}]}, 64) == 4
    assert depth([[[[]]]], 2) == 3  # stops counting past the limit


async def test_a_key_holds_no_more_than_its_limit_and_a_slow_reader_only_its_own_stream(guarded: Server) -> None:
    # a client that sends a streaming request and then reads nothing
    slow = socket.create_connection(("127.0.0.1", guarded.port), timeout=TIMEOUT)
    try:
        body = json.dumps({"prompt": "Go on", "max_tokens": 3000, "stream": True}).encode()
        slow.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        with anyio.fail_after(TIMEOUT):
            while metric(guarded, "aiollama_active_conversations") < 1:
                await anyio.sleep(0.02)
        # the same key is at its limit: 429, at once
        status, answer = post(guarded, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert status == 429 and answer["error"]["code"] == "too_many_requests"
        # another key is served while the slow reader holds its stream
        async with client(guarded, KEYS[1]) as other:
            reply = await other.completions.create(model="x", prompt="Hi", max_tokens=5, temperature=0)
        assert reply.usage.completion_tokens == 5
    finally:
        slow.close()
    with anyio.fail_after(TIMEOUT):  # the slow reader's place is given back when it goes
        while (status := post(guarded, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})[0]) == 429:
            await anyio.sleep(0.05)
    assert status == 200


async def test_fields_are_read_or_refused_never_dropped(guarded: Server) -> None:
    status, answer = post(guarded, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "mirostat": 2})
    assert status == 400 and answer["error"]["param"] == "mirostat"
    status, answer = post(guarded, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                           "reasoning_effort": "low"})
    assert status == 400 and answer["error"]["param"] == "reasoning_effort"
    status, answer = post(guarded, "/v1/embeddings", {"input": "Hi", "truncate": True})
    assert status == 400 and answer["error"]["param"] == "truncate"
    # informational fields change nothing and are taken
    assert post(guarded, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "user": "u1", "metadata": {}})[0] == 200


async def test_each_field_is_checked_once_and_named_in_each_apis_shape(guarded: Server) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [tool], "tool_choice": "required",
            "response_format": {"type": "json_object"}}
    status, answer = post(guarded, "/v1/chat/completions", body)  # one reading of tool_choice, the library's
    assert status == 400 and answer["error"]["param"] == "tool_choice" and "constrains" in answer["error"]["message"]
    status, answer = post(guarded, "/v1/chat/completions", {**body, "tool_choice": {"function": {"name": "g"}}})
    assert status == 400 and answer["error"]["param"] == "tool_choice" and "'g'" in answer["error"]["message"]
    for path, body in (("/tokenize", {"content": "\ud800"}), ("/v1/embeddings", {"input": "a\udfffb"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}]})):
        status, answer = post(guarded, path, body)  # a lone surrogate: valid JSON, not Unicode
        assert status == 400 and "surrogate" in answer["error"]["message"], (path, answer)
    messages = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    for bad in (None, 0, "8", True):
        status, answer = post(guarded, "/v1/messages", {**messages, "max_tokens": bad} if bad is not None else messages)
        assert status == 400 and answer["type"] == "error" and "max_tokens" in answer["error"]["message"], (bad, answer)


async def test_ignore_eos_goes_on_past_the_end_token(guarded: Server) -> None:
    _, tokenized = post(guarded, "/tokenize", {"content": "<|im_end|>", "parse_special": True})
    [end] = tokenized["tokens"]
    body = {"prompt": "Hi", "max_tokens": 6, "temperature": 0, "logit_bias": {str(end): 100}}
    _, stops = post(guarded, "/v1/completions", body)
    assert stops["choices"][0]["finish_reason"] == "stop" and stops["usage"]["completion_tokens"] <= 1
    _, goes_on = post(guarded, "/v1/completions", {**body, "ignore_eos": True})
    assert goes_on["choices"][0]["finish_reason"] == "length" and goes_on["usage"]["completion_tokens"] == 6
    assert post(guarded, "/v1/completions", {**body, "ignore_eos": "yes"})[0] == 400


async def test_tokenize_detokenize_and_apply_template(guarded: Server) -> None:
    status, answer = post(guarded, "/tokenize", {"content": "Hello wörld", "with_pieces": True})
    assert status == 200
    pieces = answer["tokens"]
    assert all(isinstance(p["id"], int) for p in pieces)
    text = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert text.decode() == "Hello wörld"
    ids = [p["id"] for p in pieces]
    assert post(guarded, "/tokenize", {"content": "Hello wörld"})[1] == {"tokens": ids}
    assert post(guarded, "/detokenize", {"tokens": ids})[1] == {"content": "Hello wörld"}
    assert post(guarded, "/detokenize", {"tokens": [10**9]})[0] == 400
    assert post(guarded, "/tokenize", {"content": 5})[0] == 400
    status, answer = post(guarded, "/apply-template", {"messages": [{"role": "user", "content": "Hi there"}]})
    assert status == 200 and "Hi there" in answer["prompt"] and answer["prompt"].rstrip().endswith("assistant")
    assert post(guarded, "/tokenize", {"content": "Hi"}, key=None)[0] == 401


async def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(guarded: Server) -> None:
    # 900 kB of text cannot fit 1,024 tokens of a request's share whatever the tokenizer makes of it
    huge = "word " * 180_000
    for path, body in (("/v1/completions", {"prompt": huge, "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
                       ("/v1/responses", {"input": huge})):
        status, answer = post(guarded, path, body)
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", path
        assert "900000 bytes" in answer["error"]["message"]  # the size check, not the tokenizer's count
    status, answer = post(guarded, "/tokenize", {"content": huge})  # no context here: tokenized, off the loop
    assert status == 200 and len(answer["tokens"]) == 180_001
    assert post(guarded, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})[0] == 200
