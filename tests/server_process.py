"""A server in a process of its own, as users start it, for the tests that drive it over HTTP."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path
from typing import Any

import openai

TIMEOUT = 60


class Server:
    """``aiollama serve MODEL`` (or another command serving on ``--port``; None: no MODEL, as a
    server of several models) in a process of its own."""

    def __init__(self, model: Path | None, *options: str, command: tuple[str, ...] = ("-m", "aiollama", "serve"),
                 health: str = "/health", startup: float = TIMEOUT) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # its output goes to a file, not a pipe: a pipe nobody reads fills up, and a server that
        # logs then blocks writing to it, event loop and all
        self._log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, *command, *([] if model is None else [str(model)]), "--port", str(self.port), *options],
            stdout=self._log, stderr=subprocess.STDOUT, text=True, cwd=tempfile.gettempdir())
        deadline = time.monotonic() + startup
        while True:
            try:
                if self.get(health)[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                said = self.output()
                self.stop()
                raise RuntimeError(f"the server did not start: {said}")
            time.sleep(0.1)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Message, Any]:
        request = urllib.request.Request(self.url + path, data=body,
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, r.headers, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.headers, json.loads(e.read())

    def metric(self, name: str) -> float:
        match = re.search(rf"^{name} (\S+)$", self.get("/metrics")[1], re.M)
        assert match, name
        return float(match.group(1))

    def client(self) -> Any:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)

    def output(self) -> str:
        """What the server printed so far (all it printed, once stopped)."""
        if self._log.closed:
            return self._said
        self._log.seek(0)
        return self._log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._said = self.output()
            self._log.close()
