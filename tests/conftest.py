from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_model import tiny_model

import aiollama
from aiollama.native import Model


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, pulled into the cache on first use."""
    return aiollama.pull()


@pytest.fixture(scope="session")
def tiny_path(smollm2_path: Path) -> Path:
    """A tiny random-weight model that tokenizes like SmolLM2."""
    return tiny_model(aiollama.cache_dir() / "test-models", smollm2_path)


@pytest.fixture(scope="session")
def tiny(tiny_path: Path) -> Iterator[Model]:
    with Model(tiny_path) as model:
        yield model


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> Iterator[Model]:
    with Model(smollm2_path) as model:
        yield model


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
