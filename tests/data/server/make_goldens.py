"""Write llama_server.json: the shape of llama-server's answers to its own clients' requests (the
native ``/completion``, ``/infill``, ``/embedding``, ``/props``, ``/tokenize``, ``/health``, and the
llama.cpp fields of its OpenAI routes), which ``tests/server/test_llama_server_api.py`` holds aiollama's
answers to: the same fields, of the same JSON types, and the values both engines must agree on
(``VALUES``: the same model, greedy sampling).

Run once, beside a llama-server built from the same llama.cpp tag, and commit the file:

    python tests/data/server/make_goldens.py --server build/bin/llama-server --smollm2 SMOLLM2.gguf \
        --readme llama.cpp/tools/server/README.md

It also writes llama_server_flags.txt: every flag llama-server's README lists (one row of aliases a
line), which the tests hold ``aiollama serve`` to: each taken, or refused with a reason.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from llama_server_api import REQUESTS, VALUES, call, events_shape, shape, value_at  # noqa: E402
from tiny_model import fim_model, rerank_model, tiny_model  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(server: str, model: Path, *options: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen([server, "-m", str(model), "--port", str(port), "-c", "2048", "-np", "2", "--no-webui",
                             *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama-server did not start")


def flag_rows(readme: Path) -> list[str]:
    """The flags of each row of the README's tables of options, as "-a, --alias"."""
    rows = []
    for line in readme.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^\| `(-[^`]*)` \|", line)
        if match:
            names = [part.strip().split(" ")[0] for part in match.group(1).split(",")]
            rows.append(", ".join(n for n in names if n.startswith("-")))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--smollm2", required=True, type=Path)
    parser.add_argument("--readme", required=True, type=Path)
    args = parser.parse_args()
    (HERE / "llama_server_flags.txt").write_text("\n".join(flag_rows(args.readme)) + "\n", encoding="utf-8")
    cache = Path.home() / ".cache" / "aiollama" / "test-models"
    models = {"tiny": tiny_model(cache, args.smollm2), "fim": fim_model(cache, args.smollm2),
              "rerank": rerank_model(cache, args.smollm2)}
    out: dict[str, Any] = {}
    for name, (model, options, method, path, body, headers) in REQUESTS.items():
        proc, port = serve(args.server, models[model], *options)
        try:
            status, answer = call(f"http://127.0.0.1:{port}", method, path, body, headers)
        finally:
            proc.kill()
            proc.wait()
        streamed = isinstance(body, dict) and body.get("stream")
        out[name] = {"status": status, "shape": events_shape(answer) if streamed else shape(answer),
                     "values": {path: value_at(answer, path) for path in VALUES.get(name, ())}}
        print(name, status, flush=True)
    (HERE / "llama_server.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
