"""llama-server as a contender: start it on loopback, stream completions from it, stop it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import httpx
from common import StreamTiming


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A server in a process of its own on 127.0.0.1: started on entry, ready once ``/health``
    answers 200, stopped on exit."""

    name = "server"

    def __init__(self, cmd: list[str], port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = cmd
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        # from outside the source tree, so that `python -m aiollama` imports the installed package
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     cwd=tempfile.gettempdir())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"{self.name} exited: {err[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not become healthy in 120 s")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class LlamaServer(ServerProcess):
    """``llama-server -np N -kvu`` with explicit threads, on 127.0.0.1, for one scenario; without
    ``-kvu`` (the server's default: each slot its share of the cache) when not ``unified``.

    Batch sizes stay at the server's defaults (n_batch 2048, n_ubatch 512): the reference as its
    users run it.
    """

    name = "llama-server"

    def __init__(self, binary: Path, model: Path, *, n_parallel: int, n_ctx: int, threads: int,
                 unified: bool = True) -> None:
        port = _free_port()
        super().__init__([
            str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(n_parallel), *(["-kvu"] if unified else []), "-c", str(n_ctx), "-t", str(threads),
            "-tb", str(threads), "--no-webui", "--log-disable",
        ], port)


class AiollamaServer(ServerProcess):
    """``aiollama serve`` in a process of its own, as a user starts it; ``extra``: more options."""

    name = "aiollama serve"

    def __init__(self, model: Path, *, n_seq_max: int, n_ctx: int, threads: int, extra: tuple[str, ...] = ()) -> None:
        port = _free_port()
        super().__init__([sys.executable, "-m", "aiollama", "serve", str(model), "--port", str(port),
                          "--n-seq-max", str(n_seq_max), "--n-ctx", str(n_ctx), "--threads", str(threads),
                          "--log-level", "warning", *extra], port)


SAMPLING: dict[str, Any] = {"ignore_eos": True, "temperature": 0.7}  # the throughput scenarios'


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: list[int], n_predict: int,
                            seed: int, timing: StreamTiming, sampling: dict[str, Any] | None = None) -> list[int]:
    """One streaming /completion; records the arrival time of every token, returns the tokens."""
    body = {"prompt": prompt, "n_predict": n_predict, "stream": True, **(SAMPLING if sampling is None else sampling),
            "seed": seed, "cache_prompt": False, "return_tokens": True}
    got: list[int] = []
    async with client.stream("POST", url + "/completion", json=body, timeout=None) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            tokens = event.get("tokens") or []
            if tokens:
                timing.arrivals.extend([now] * len(tokens))
                got += tokens
            elif event.get("content") and not event.get("stop"):
                timing.arrivals.append(now)
            if event.get("stop"):
                break
    return got


async def run_clients(url: str, prompts: list[list[int]], n_predict: int) -> list[StreamTiming]:
    """N concurrent streaming clients, one per prompt."""
    timings = [StreamTiming(0.0) for _ in prompts]
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(prompts):
                timings[i].start = time.perf_counter()
                tg.start_soon(stream_completion, client, url, prompt, n_predict, i, timings[i])
    return timings
