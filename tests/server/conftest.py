"""What the server's tests share: the official clients' event loop, and an ``aiollama serve``
process per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_process import Server


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the official clients (openai, anthropic) run on asyncio; trio is the engine's


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """``aiollama serve`` with the module's ``SERVER_OPTIONS`` on the model of its ``SERVER_MODEL``
    fixture (the tiny model by default), started once for the module."""
    model = request.getfixturevalue(getattr(request.module, "SERVER_MODEL", "tiny_path"))
    s = Server(model, *getattr(request.module, "SERVER_OPTIONS", ()))
    yield s
    s.stop()
