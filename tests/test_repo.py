"""The repository keeps its promises: CI runs the README's test command; llama.cpp stays out of git."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^```(?:bash|sh)\n(.+?)\n```", text, flags=re.M | re.S)


def test_ci_runs_the_readme_test_command() -> None:
    commands = readme_commands()
    assert len(commands) >= 2, "the README opens with the demo command and the test command"
    demo, test = commands[0], commands[1]
    assert "examples/" in demo and "pytest" in test
    assert test in (ROOT / ".ci" / "run").read_text()


def test_llama_cpp_source_is_not_tracked() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", "llama.cpp/include/llama.h"], cwd=ROOT)
    assert ignored.returncode == 0
    tracked = subprocess.run(["git", "ls-files", "llama.cpp", "*.gguf"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    assert tracked == ""
