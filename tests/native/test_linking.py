"""How the package's native libraries meet at run time.

With a CUDA backend an engine crashed loading its model on the decode thread, inside std::regex,
at a libstdc++ template symbol resolved in libggml-cuda.so: each C++ library exports the template
instances it compiled, and the dynamic linker bound one library's calls to another's copies. The
libraries are now linked so that each binds calls to functions it defines to its own copy; these
tests check that on whatever build runs them, and start an engine the way the crash needed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import aiollama

PACKAGE = Path(aiollama.__file__).resolve().parent


def _defined_functions(library: Path) -> set[str]:
    """The functions (text symbols, weak or not) a library exports."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if len(line.split()) == 3 and line.split()[1] in "TWi"}


def test_our_libraries_bind_their_own_functions(tmp_path: Path, tiny_path: Path) -> None:
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    env = dict(os.environ, LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(tmp_path / "ld"))
    code = f"from aiollama.native import Model\nModel({str(tiny_path)!r}).close()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=120,
                   cwd=tmp_path)  # not the repository root, whose aiollama/ has no extension
    ours = {p.name for p in PACKAGE.glob("*.so")}
    crossings: dict[tuple[str, str], set[str]] = {}
    observed = 0  # bindings made from our libraries: none means the loader told nothing to check
    for log in tmp_path.glob("ld.*"):
        for line in log.read_text(errors="replace").splitlines():
            if "binding file" not in line or "normal symbol" not in line:
                continue
            words = line.split()
            src, dst = Path(words[words.index("file") + 1]).name, Path(words[words.index("to") + 1]).name
            symbol = line.split("`", 1)[1].split("'", 1)[0]
            observed += src in ours
            if src in ours and dst in ours and src != dst:
                crossings.setdefault((src, dst), set()).add(symbol)
    assert observed > 100, f"LD_DEBUG told {observed} bindings of our libraries ({sorted(ours)}): nothing to check"
    functions = {name: _defined_functions(PACKAGE / name) for name in ours}
    wrong = {f"{src} -> {dst}": sorted(s for s in symbols if s in functions[src])[:5]
             for (src, dst), symbols in crossings.items()}
    wrong = {k: v for k, v in wrong.items() if v}
    # a library's call to a function it defines itself went to another library's copy
    assert not wrong, wrong


def test_a_fresh_process_loads_its_model_first_on_the_decode_thread(tiny_path: Path, tmp_path: Path) -> None:
    # what crashed: the first llama.cpp work of the process done by an engine started from a worker
    # thread (as anyio starts it), the model loaded on the decode thread
    code = textwrap.dedent(f"""
        import threading, anyio, aiollama
        result = []
        def start():
            async def main():
                async with aiollama.Engine({str(tiny_path)!r}, n_ctx=256, n_seq_max=1) as engine:
                    result.append(len((await engine.conversation("Hi").stream(max_tokens=3, temperature=0)).tokens))
            anyio.run(main)
        worker = threading.Thread(target=start)
        worker.start()
        worker.join()
        print(result)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[3]"
