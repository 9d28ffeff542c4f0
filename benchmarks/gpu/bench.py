"""One model on one GPU, side by side in one run: llama-batched-bench (llama.cpp's own ceiling),
llama-server and aiollama (in process), N streams of T new tokens each, EOG ignored; then the same
load round after round on one warm engine and one llama-server process (the steady state).

    python benchmarks/gpu/bench.py MODEL [--bin DIR] [--levels 1,8,32,128] [--tokens 128]

Every contender gets the same prompts (random token ids, 64 each, distinct per stream and round),
temperature 0.7. batched-bench and llama-server run with their defaults (a split KV cache: each
slot its share) and every layer offloaded; aiollama with n_gpu_layers "auto" (all of them, when
they fit), in its default unified cache, with a split one, and with backend sampling, the split
ones with overlapped steps (the default on a GPU) and without ("plain"). For each
aiollama level the engine's own timers say how much of a step is spent in llama_decode.

Without ``--bin`` (or with ``--cpu``) it runs aiollama only: the CPU mode the test suite runs on a
tiny model, so that this script cannot rot. Results: a markdown table on stdout, JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio

import aiollama
from aiollama.native import Model

PROMPT = 64


def prompts(n: int, n_vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, min(n_vocab, 40000)) for _ in range(PROMPT)] for _ in range(n)]


# llama.cpp's tools

def batched_bench(binary: Path, model: str, levels: list[int], tokens: int, threads: int) -> dict[int, float]:
    """S_TG (tokens/s while every stream generates) per level."""
    n_ctx = max(levels) * (PROMPT + tokens) + 256
    cmd = [str(binary), "-m", model, "-ngl", "99", "-c", str(n_ctx), "-b", "2048", "-ub", "512",
           "-npp", str(PROMPT), "-ntg", str(tokens), "-npl", ",".join(map(str, levels)), "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout
    found = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and cells[2].isdigit() and cells[0] == str(PROMPT):
            found[int(cells[2])] = float(cells[7])
    return found


class Server:
    """llama-server with -np N and its default (split) cache, every layer offloaded, on 127.0.0.1."""

    def __init__(self, binary: Path, model: str, n: int, n_ctx: int, threads: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [str(binary), "-m", model, "-ngl", "99", "-c", str(n_ctx), "-np", str(n), "-t", str(threads),
             "-tb", str(threads), "--host", "127.0.0.1", "--port", str(self.port), "--no-webui"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(480):
            try:
                if b"ok" in urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1).read():
                    return
            except OSError:
                time.sleep(0.25)
        self.close()
        raise RuntimeError("llama-server did not come up")

    def one(self, prompt: list[int], tokens: int, seed: int) -> int:
        body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.7, "seed": seed, "cache_prompt": True,
                "ignore_eos": True}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        return int(json.loads(urllib.request.urlopen(request, timeout=600).read())["tokens_predicted"])

    def run(self, batch: list[list[int]], tokens: int) -> float:
        start = time.perf_counter()
        with ThreadPoolExecutor(len(batch)) as pool:
            done = sum(pool.map(lambda i: self.one(batch[i], tokens, i), range(len(batch))))
        return done / (time.perf_counter() - start)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


# aiollama

async def streams(engine: aiollama.Engine, batch: list[list[int]], tokens: int) -> float:
    generated = 0

    async def one(i: int) -> None:
        nonlocal generated
        conv = engine.conversation(batch[i])
        done = await conv.stream(max_tokens=tokens, temperature=0.7, seed=i, ignore_eos=True)
        generated += len(done.tokens)
        await conv.aclose()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(batch)):
            tg.start_soon(one, i)
    return generated / (time.perf_counter() - start)


async def aiollama_run(model: str, levels: list[int], tokens: int, rounds: int, n_vocab: int,
                       options: dict[str, Any]) -> dict[str, Any]:
    """Each level once on one engine (with its step timers), then ``rounds`` rounds of the largest."""
    n = max(levels)
    n_ctx = 4 * n * (PROMPT + tokens + 64) + 512  # room for rounds of cache in a unified cache
    out: dict[str, Any] = {"levels": {}, "rounds": []}
    async with aiollama.Engine(model, n_ctx=n_ctx, n_seq_max=n, max_queued=4 * n, **options) as engine:
        await streams(engine, prompts(1, n_vocab, 1), 8)  # warm-up
        out["device"] = engine.statistics().weights_device
        for level in levels:
            before = engine.statistics()
            tps = await streams(engine, prompts(level, n_vocab, 100 + level), tokens)
            after = engine.statistics()
            steps = max(1, after.decode_steps - before.decode_steps)
            out["levels"][level] = {
                "tps": tps,
                "step_ms": 1000 * (after.step_seconds - before.step_seconds) / steps,
                "decode_ms": 1000 * (after.decode_seconds - before.decode_seconds) / steps,
            }
        for r in range(rounds):
            out["rounds"].append(await streams(engine, prompts(n, n_vocab, 1000 * (r + 1)), tokens))
        final = engine.statistics()
        out["cells"] = [final.kv_cells_used, final.kv_cells_total]
    return out


VARIANTS: dict[str, dict[str, Any]] = {
    "aiollama": {},
    "split": {"kv_unified": False},
    "split+backend": {"kv_unified": False, "backend_sampling": True},
    # overlapped steps are the default on a GPU: the same two without them
    "split+plain": {"kv_unified": False, "overlap": False},
    "split+backend+plain": {"kv_unified": False, "backend_sampling": True, "overlap": False},
}


def table(r: dict[str, Any]) -> str:
    levels = r["levels"]
    bb, server = r.get("batched_bench", {}), r.get("server", {})
    names = [v for v in VARIANTS if v in r["aiollama"]]
    lines = ["| streams | batched-bench S_TG | llama-server | " + " | ".join(names) +
             " | best / server | best / S_TG | step ms (decode ms) |",
             "|---|---|---|" + "---|" * len(names) + "---|---|---|"]
    for n in levels:
        got = {v: r["aiollama"][v]["levels"][n]["tps"] for v in names}
        best = max(got.values())
        s, c = server.get(n, 0.0), bb.get(n, 0.0)
        level = {v: r["aiollama"][v]["levels"][n] for v in names}
        steps = " / ".join(f"{level[v]['step_ms']:.1f} ({level[v]['decode_ms']:.1f})" for v in names)
        lines.append(f"| {n} | {c:.0f} | {s:.0f} | " + " | ".join(f"{got[v]:.0f}" for v in names) +
                     f" | {best / s if s else 0:.2f} | {best / c if c else 0:.2f} | {steps} |")
    lines += ["", f"Steady state, {max(levels)} streams, tokens/s per round (last/first):", ""]
    for name, rounds in [(v, r["aiollama"][v]["rounds"]) for v in names] + [("llama-server", r.get("server_rounds", []))]:
        if rounds:
            lines.append(f"- {name}: {' / '.join(f'{x:.0f}' for x in rounds)} ({rounds[-1] / rounds[0]:.2f})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--bin", type=Path, default=None, help="folder with llama-batched-bench and llama-server")
    ap.add_argument("--levels", default="1,8,32,128")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4, help="steady-state rounds at the largest level")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cpu", action="store_true", help="aiollama only, on the CPU (n_gpu_layers 0)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    with Model(a.model, vocab_only=True) as m:
        n_vocab = m.vocab.n_tokens
    r: dict[str, Any] = {"levels": levels, "tokens": a.tokens, "devices": [d.__dict__ for d in aiollama.devices()],
                         "aiollama": {}}
    t0 = time.time()
    tools = a.bin is not None and not a.cpu
    if tools:
        r["batched_bench"] = batched_bench(a.bin / "llama-batched-bench", a.model, levels, a.tokens, a.threads)
        print(f"[{time.time() - t0:.0f}s] batched-bench S_TG {r['batched_bench']}", flush=True)
        n = max(levels)
        server = Server(a.bin / "llama-server", a.model, n, n * (PROMPT + a.tokens + 64) + 512, a.threads)
        try:
            server.run(prompts(1, n_vocab, 1), 8)
            r["server"] = {level: server.run(prompts(level, n_vocab, 100 + level), a.tokens) for level in levels}
            r["server_rounds"] = [server.run(prompts(n, n_vocab, 1000 * (i + 1)), a.tokens) for i in range(a.rounds)]
        finally:
            server.close()
        print(f"[{time.time() - t0:.0f}s] llama-server {r['server']} rounds {r['server_rounds']}", flush=True)
    for name in a.variants.split(","):
        options = dict(VARIANTS[name], n_threads=a.threads)
        if a.cpu:
            options["n_gpu_layers"] = 0
        try:
            r["aiollama"][name] = anyio.run(aiollama_run, a.model, levels, a.tokens, a.rounds, n_vocab, options)
        except Exception as exc:  # one failing variant must not lose the others
            print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        print(f"[{time.time() - t0:.0f}s] {name}: {json.dumps(r['aiollama'][name])}", flush=True)
    print(table(r), flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    sys.exit(main())
