"""``aiollama serve --replicas 2`` as users type it, with every kind of engine flag (cache types,
flash attention, checkpoints, adapters, the image projector, llama-server's sampling defaults):
it starts, serves, and keeps a Responses conversation with the replica that holds it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from tiny_model import write_lora
from tiny_projector import projector

import aiollama

pytest.importorskip("ray")

STARTUP = 240  # Ray's processes, then two engines, on two cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _call(url: str, method: str, body: Any = None) -> tuple[int, Any, dict[str, str]]:
    """The status, the body (JSON, or the text of an answer that is not: Ray's proxy answers a
    route it has not deployed yet in plain text), and the headers."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, _body(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, _body(exc.read()), dict(exc.headers)


def _body(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return raw.decode("utf-8", "replace")


def test_serve_replicas_starts_with_every_engine_flag_and_keeps_responses_with_their_replica(
        tiny_path: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "adapter.gguf"
    write_lora(adapter, tiny_path)
    mmproj = projector(aiollama.cache_dir() / "test-models", 64)
    port = _free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiollama", "serve", str(tiny_path), "--replicas", "2", "--port", str(port),
         "-c", "2048", "-np", "2", "-t", "1", "-ctk", "bf16", "-ctv", "f32", "-fa", "on", "--checkpoint-mib", "16",
         "--host-cache-mib", "64", "--lora", f"style={adapter}", "--mmproj", str(mmproj), "--temp", "0",
         "--responses-max", "16", "--responses-ttl", "600", "--reasoning-budget", "8", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(), env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP
        while True:
            try:
                if _call(url + "/health", "GET")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-4000:]
            time.sleep(1)
        status, chat, _ = _call(url + "/v1/chat/completions", "POST", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "lora": [{"name": "style", "scale": 0.5}]})
        assert status == 200 and chat["usage"]["completion_tokens"] == 3, chat
        status, first, headers = _call(url + "/v1/responses", "POST", {"input": "Tell me a story.", "max_output_tokens": 4})
        assert status == 200, first
        holder = headers["x-aiollama-replica"]
        assert holder in first["id"]  # the id names the replica that holds it
        previous, total = first["id"], first["usage"]["total_tokens"]
        for turn in range(3):
            _call(url + "/v1/chat/completions", "POST", {"messages": [{"role": "user", "content": f"load {turn}"}],
                                                         "max_tokens": 2})
            status, reply, headers = _call(url + "/v1/responses", "POST", {
                "input": f"And then {turn}?", "previous_response_id": previous, "max_output_tokens": 4})
            assert status == 200 and headers["x-aiollama-replica"] == holder, reply
            cached = reply["usage"]["input_tokens_details"]["cached_tokens"]
            assert cached >= total - 1, (turn, reply["usage"], total)  # only the new input was evaluated
            previous, total = reply["id"], reply["usage"]["total_tokens"]
        assert _call(url + f"/v1/responses/{previous}", "GET")[0] == 200
        assert _call(url + f"/v1/responses/{previous}", "DELETE")[1]["deleted"] is True
        assert _call(url + f"/v1/responses/{previous}", "GET")[0] == 404
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
