"""Write goldens.json: llama-server's own rendering of every vendor template in the pinned llama.cpp
tree, for each conversation of ``tests/chat_cases.py``.

Run once, beside a llama-server built from the same llama.cpp tag (a build with
``-DAIOLLAMA_TOOLS=ON``, or llama.cpp's own CMake), and commit the file:

    python tests/data/chat/make_goldens.py --server build/bin/llama-server --model TINY.gguf

``--model`` is the tiny test model (SmolLM2's vocabulary, so BOS and EOS are its own), which the
conformance test renders with too. Each template gets a server of its own
(``--jinja --chat-template-file``, llama-server's defaults otherwise); a conversation it refuses is
written with the status and error it answered.

With ``--families SMOLLM2.gguf`` it writes families.json instead: each family of
``chat_cases.FAMILIES`` served by its scripted model (``tests/scripted_model.py``, written from
SmolLM2's vocabulary into the cache), and what llama-server's chat completions, Messages and
Responses APIs answer to its request.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from chat_cases import CONVERSATIONS, DATA, FAMILIES, api_bodies, family_model, outcome, templates  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def serve(server: str, model: str, template: Path | None) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    options = ["--chat-template-file", str(template)] if template is not None else []
    proc = subprocess.Popen([server, "-m", model, "--jinja", *options, "--port", str(port), "-c", "2048", "-np", "1",
                             "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            return proc, -1  # it refused the template
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"llama-server did not start for {template.name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--model")
    parser.add_argument("--families", metavar="SMOLLM2_GGUF")
    args = parser.parse_args()
    if args.families:
        return families(args.server, Path(args.families))
    out: dict[str, Any] = {"date": datetime.date.today().isoformat(), "templates": {}}
    for template in templates():
        proc, port = serve(args.server, args.model, template)
        cases: dict[str, Any] = {}
        try:
            if port < 0:
                why = (proc.stderr.read() if proc.stderr else b"").decode("utf-8", "replace").strip().splitlines()
                cases = {name: {"status": 0, "error": (why or ["llama-server did not start"])[-1][-300:]}
                         for name in CONVERSATIONS}
            else:
                for name, body in CONVERSATIONS.items():
                    status, answer = post(port, "/apply-template", body)
                    if status == 200:
                        cases[name] = {"prompt": answer["prompt"]}
                    else:
                        cases[name] = {"status": status, "error": str(answer.get("error", answer))[:300]}
        finally:
            proc.kill()
            proc.wait()
        out["templates"][template.stem] = cases
        print(template.stem, sum("prompt" in c for c in cases.values()), "of", len(cases), flush=True)
    (DATA / "goldens.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


def families(server: str, smollm2: Path) -> int:
    out: dict[str, Any] = {}
    for family in FAMILIES:
        proc, port = serve(server, str(family_model(family, smollm2)), None)
        try:
            out[family] = {}
            for api, (path, body) in api_bodies(family).items():
                status, answer = post(port, path, body)
                if status != 200:
                    raise RuntimeError(f"{family} {api}: {status} {answer}")
                out[family][api] = outcome(api, answer)
        finally:
            proc.kill()
            proc.wait()
        print(family, json.dumps(out[family]["chat"], ensure_ascii=False), flush=True)
    (DATA / "families.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
