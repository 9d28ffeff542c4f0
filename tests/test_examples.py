"""The examples run as a user runs them, each in a process of its own, on the tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=300, cwd=tempfile.gettempdir(), env={**os.environ, "COLUMNS": "130"})


@pytest.mark.parametrize("backend", [[], ["--trio"]], ids=["asyncio", "trio"])
def test_the_demo_shows_every_stream_in_a_panel_and_the_statistics(tiny_path: Path, backend: list[str]) -> None:
    out = run_example("concurrent_streams.py", str(tiny_path), *backend)
    assert out.returncode == 0, out.stderr
    screen = out.stdout
    for title in ("What is the capital of France?", "Write a short poem about the sea.", "Give me a recipe"):
        assert title in screen
    assert screen.count("─ length ─") + screen.count("─ eog ─") == 6  # every panel ended
    assert "KV cells 0/4096" in screen  # the last frame: everything freed
    assert "tokens/s" in screen and "time outside llama_decode" in screen.splitlines()[-1]


def test_shared_prefix_fork(tiny_path: Path) -> None:
    out = run_example("shared_prefix_fork.py", str(tiny_path))
    assert out.returncode == 0, out.stderr
    assert "tokens evaluated" in out.stdout


def test_native_greedy(tiny_path: Path) -> None:
    out = run_example("native_greedy.py", str(tiny_path))
    assert out.returncode == 0, out.stderr


def test_guidance(tiny_path: Path) -> None:
    out = run_example("guidance.py", str(tiny_path))
    assert out.returncode == 0, out.stderr
    assert "guided: My favourite colour is" in out.stdout
    assert "the guidance conversation holds the guided tokens too: True" in out.stdout


@pytest.mark.parametrize("backend", [[], ["trio"]], ids=["asyncio", "trio"])
def test_quickstart_the_readme_example(tiny_path: Path, backend: list[str]) -> None:
    out = run_example("quickstart.py", str(tiny_path), *backend)
    assert out.returncode == 0, out.stderr
    last = out.stdout.splitlines()[-1].split()
    assert last[0] in ("length", "eog", "stop") and int(last[-1]) > 0  # finish reason ... tokens generated
