"""The aiollama command, run as users run it: in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import aiollama


def aiollama_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aiollama", *args], capture_output=True, text=True, timeout=300,
                          cwd=tempfile.gettempdir(), env={**os.environ, "COLUMNS": "120"})


def test_help_lists_the_commands() -> None:
    out = aiollama_cli("--help")
    assert out.returncode == 0
    for command in ("run", "serve", "bench", "pull"):
        assert command in out.stdout


def test_run_streams_three_prompts_side_by_side(tiny_path: Path) -> None:
    out = aiollama_cli("run", str(tiny_path), "First prompt", "Second prompt", "Third prompt",
                       "--max-tokens", "6", "--temperature", "0")
    assert out.returncode == 0, out.stderr
    screen = out.stdout
    assert all(title in screen for title in ("First prompt", "Second prompt", "Third prompt"))
    assert "batch 0/3" in screen  # the last frame: three seq ids, none running (the peak depends on timing)
    assert screen.count("length") + screen.count("eog") == 3


def test_run_and_bench_refuse_what_they_cannot_do(tiny_path: Path) -> None:
    assert aiollama_cli("run", str(tiny_path)).returncode == 2  # a model and no prompt
    missing = aiollama_cli("bench", "--benchmarks", str(Path(tempfile.gettempdir()) / "no-such-dir"))
    assert missing.returncode == 2 and "source checkout" in missing.stderr
    bad_model = aiollama_cli("run", "--model", str(Path(tempfile.gettempdir()) / "missing.gguf"), "hi")
    assert bad_model.returncode == 1 and "not found" in bad_model.stderr


def test_pull_prints_the_cached_default_model(smollm2_path: Path) -> None:
    out = aiollama_cli("pull")
    assert out.returncode == 0 and Path(out.stdout.strip()) == smollm2_path == aiollama.default_model()
