"""Every route fuzzed over HTTP with bodies drawn from its API's own shapes and then mutated
(``tests/fuzz_bodies.py``): each answer is a 2xx or a 4xx in that API's error shape, never a 5xx
or a dropped connection; and real streams running beside the fuzzing finish with the tokens they
would have had alone (a deterministic server: a conversation's output does not depend on its
neighbours). ``benchmarks/fuzz.py`` runs the same for thousands of requests."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fuzz_bodies import ROUTES, check, mutated, send
from hypothesis import HealthCheck, given, settings
from server_process import Server

EXAMPLES = int(os.environ.get("AIOLLAMA_FUZZ_EXAMPLES", "20"))  # per route


SERVER_OPTIONS = ("-c", "2048", "-np", "4", "--deterministic", "--unified-cache", "--max-body-mib", "1",
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


@pytest.fixture(scope="module")
def watch(server: Server) -> Iterator[Watch]:
    w = Watch(server.url)
    yield w
    w.stop()


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_answer_is_a_success_or_a_client_error(server: Server, watch: Watch, route: str) -> None:
    method, path, shape, bodies = ROUTES[route]

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutated(bodies))
    def one(body: Any) -> None:
        problem = check(*send(server.url, method, path, body), shape)
        assert problem is None, (body, problem)

    one()


def test_the_streams_beside_the_fuzzing_were_not_harmed(watch: Watch) -> None:
    watch.stop()
    assert watch.runs > 0 and not watch.harmed, watch.harmed[:5]
