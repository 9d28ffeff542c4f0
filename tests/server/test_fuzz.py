"""Every route fuzzed over HTTP with bodies drawn from its API's own shapes and then mutated
(``tests/fuzz_bodies.py``): each answer is a 2xx or a 4xx in that API's error shape, never a 5xx
or a dropped connection; and real streams running beside the fuzzing finish with the tokens they
would have had alone (a deterministic server: a conversation's output does not depend on its
neighbours). ``benchmarks/fuzz.py`` runs the same for thousands of requests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import fuzz_bodies
import pytest
from fuzz_bodies import ROUTES, Watch, check, mutated, send
from hypothesis import HealthCheck, given, seed, settings
from server_process import Server

EXAMPLES = int(os.environ.get("AIOLLAMA_FUZZ_EXAMPLES", "20"))  # per route
# the same bodies at every run unless a seed is asked for: the suite is not where new ones are
# drawn (benchmarks/fuzz.py draws thousands, from a seed of its own each run)
SEED = os.environ.get("AIOLLAMA_FUZZ_SEED")
SERVER_OPTIONS = fuzz_bodies.SERVER_OPTIONS  # the server fixture's (tests/server/conftest.py)


@pytest.fixture(scope="module")
def watch(server: Server) -> Iterator[Watch]:
    w = Watch(server.url)
    yield w
    w.stop()


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_answer_is_a_success_or_a_client_error(server: Server, watch: Watch, route: str) -> None:
    method, path, shape, bodies = ROUTES[route]

    @seed(int(SEED or 0))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=SEED is None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutated(bodies))
    def one(body: Any) -> None:
        problem = check(*send(server.url, method, path, body), shape)
        assert problem is None, (body, problem)

    one()


def test_the_streams_beside_the_fuzzing_were_not_harmed(watch: Watch) -> None:
    watch.stop()
    assert watch.runs > 0 and not watch.harmed, watch.harmed[:5]


def test_the_server_logged_no_unhandled_exception(server: Server, watch: Watch) -> None:
    """Every refusal above was answered by the server's own code: nothing reached the ASGI server."""
    assert "Traceback" not in server.output()
