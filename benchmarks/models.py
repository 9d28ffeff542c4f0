"""What a server of several models costs: a model's load time, the first request to an unloaded
model against the same request to a loaded one, and the server process's resident memory before
loading, loaded, and after unloading.

    pip install ".[bench]" && python benchmarks/models.py            # about a minute

``aiollama serve --models-dir`` runs over a folder of the default model (SmolLM2-135M, "chat") and
the tiny embedding and reranking models the tests write. Each round: unload everything, read the
memory, send a chat request (the model loads), send it again (loaded), read the memory, unload it,
read the memory again. Resident memory is the process's VmRSS; the allocator may keep some freed
pages, so "after" is an upper bound of what stays.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from common import machine, save_results  # noqa: E402
from server_process import Server  # noqa: E402
from tiny_model import bert_model, rerank_model  # noqa: E402

import aiollama  # noqa: E402

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}


def rss_mib(pid: int) -> float:
    """The process's resident memory (VmRSS), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def post(server: Server, path: str, body: dict[str, Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        answer = json.loads(r.read())
    return time.perf_counter() - started, answer


def models(server: Server) -> dict[str, Any]:
    return {card["id"]: card for card in json.loads(server.get("/v1/models")[1])["data"]}


def one_round(server: Server) -> dict[str, float]:
    for name in models(server):
        post(server, "/models/unload", {"model": name})
    time.sleep(0.5)
    before = rss_mib(server.proc.pid)
    cold, _ = post(server, "/v1/chat/completions", CHAT)
    warm, _ = post(server, "/v1/chat/completions", CHAT)
    loaded = rss_mib(server.proc.pid)
    load = models(server)["chat"]["load_seconds"]
    post(server, "/models/unload", {"model": "chat"})
    time.sleep(0.5)
    return {"load_s": load, "first_request_unloaded_s": cold, "request_loaded_s": warm, "rss_before_mib": before,
            "rss_loaded_mib": loaded, "rss_after_unload_mib": rss_mib(server.proc.pid)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    smollm2 = aiollama.pull()
    cache = aiollama.cache_dir() / "test-models"
    with tempfile.TemporaryDirectory() as folder:
        for name, target in (("chat", smollm2), ("embed", bert_model(cache, smollm2)),
                             ("rerank", rerank_model(cache, smollm2))):
            (Path(folder) / f"{name}.gguf").symlink_to(target)
        server = Server(None, "--models-dir", folder, "-c", "4096", "-np", "4", "--log-level", "warning")
        try:
            rounds = [one_round(server) for _ in range(args.rounds)]
        finally:
            server.stop()
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    r = {"date": datetime.date.today().isoformat(), "machine": machine(), "rounds": rounds, "median": median}
    text = "\n".join([
        f"# A server of several models ({r['date']}, {r['machine']['cpu']}, {r['machine']['cpus']} CPUs)", "",
        "SmolLM2-135M Q4_1 (`-c 4096 -np 4`) behind `aiollama serve --models-dir`, beside a tiny embedding "
        f"and a tiny reranking model; the median of {args.rounds} rounds.", "",
        "| | median |", "|---|---|",
        f"| the model's load | {median['load_s'] * 1000:.0f} ms |",
        f"| a chat request (8 tokens) to the unloaded model | {median['first_request_unloaded_s'] * 1000:.0f} ms |",
        f"| the same request, the model loaded | {median['request_loaded_s'] * 1000:.0f} ms |",
        f"| resident memory, nothing loaded | {median['rss_before_mib']:.0f} MiB |",
        f"| resident memory, the model loaded | {median['rss_loaded_mib']:.0f} MiB |",
        f"| resident memory after unloading it | {median['rss_after_unload_mib']:.0f} MiB |", ""])
    save_results(r, "models", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
