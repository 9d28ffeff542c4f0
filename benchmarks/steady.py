"""Steady state: the same load round after round on one warm engine, and a server under continuous
arrivals, each side by side with llama-server in the same run.

    pip install ".[bench,server]" && python benchmarks/steady.py       # about 20 minutes on 2 cores

1. Rounds. N streams of distinct prompts (64 tokens), T new tokens each at temperature 0.7, EOG
   ignored, then the same load again with new prompts, ``--rounds`` times, on one engine whose
   prefix cache keeps what it served (each aiollama contender in a process of its own, as
   llama-server is), and on one llama-server process (its default split cache, a
   slot per stream). The contenders take turns round by round. Reported: tokens/s per round and
   last/first. SmolLM2 and the fast model, at 8 and 32 streams.
2. Continuous arrivals. ``aiollama serve`` and llama-server, one process each, all kept up: 8 HTTP
   clients send one ``/v1/completions`` request after another (distinct prompts, 64 tokens, the
   end-of-generation tokens banned by ``logit_bias`` on both sides) for a window of ``--window``
   seconds, to each contender in turn, ``--windows`` times (the order rotates each time, and the
   contenders of one window get the same prompts); tokens/s per window (a request's tokens shared
   among the windows it spanned), and per window the ratio of ``aiollama serve`` to llama-server,
   measured minutes apart rather than a whole run apart. Among the contenders, the same requests
   straight into an engine configured as the server's (in a process of its own, no HTTP), with the
   share of its time spent inside ``llama_decode``: the ceiling the server can reach with these
   kernels.

Results go to benchmarks/results/<date>-<machine>-<cpus>cpu-steady.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fast_model  # noqa: E402
import tools  # noqa: E402
from common import machine, prompts, save_results  # noqa: E402
from scenarios import aiollama_streams, engine  # noqa: E402
from server import AiollamaServer, LlamaServer, run_clients  # noqa: E402

import aiollama  # noqa: E402
from aiollama.native import Model, math_cpus  # noqa: E402

PROMPT = 64
ARRIVAL_TOKENS = 64
CLIENTS = 8
ENGINE = "aiollama engine, no HTTP"


def _tps(timings: list[Any], wall: float) -> float:
    return sum(len(t.arrivals) for t in timings) / wall


class Worker:
    """One aiollama contender in a process of its own (as llama-server is in its own): an engine that
    lives for all the rounds and runs one on each request. Two engines in one process slow each other
    down on a small machine (both keep OpenMP teams), so they never share one here."""

    def __init__(self, model: Path, threads: int, n: int, n_ctx: int, unified: bool,
                 package: Path | None = None) -> None:
        # package: the folder that holds another build of the aiollama package (a baseline to
        # compare against), put first on the worker's import path
        env = {**os.environ, "PYTHONPATH": str(package)} if package is not None else None
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(
            {"model": str(model), "threads": threads, "n": n, "n_ctx": n_ctx, "unified": unified})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a benchmark worker ended ({self.proc.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


async def serve_worker(options: dict[str, Any]) -> None:
    """The worker's side: one engine, a round per request line, an answer line each."""
    async with engine(Path(options["model"]), options["threads"], n_seq_max=options["n"], n_ctx=options["n_ctx"],
                      unified=options["unified"]) as e:
        for line in sys.stdin:
            request = json.loads(line)
            start = time.perf_counter()
            if "arrivals" in request:
                a, before = request["arrivals"], e.statistics()
                tps = await engine_arrivals(e, a["n_vocab"], a["window"], a["banned"], a["first"])
                st, wall = e.statistics(), time.perf_counter() - start
                print(json.dumps({"tps": tps, "decode_seconds": st.decode_seconds - before.decode_seconds,
                                  "wall": wall}), flush=True)
                continue
            timings = await aiollama_streams(e, request["batch"], request["new"])
            st = e.statistics()
            print(json.dumps({"tps": _tps(timings, time.perf_counter() - start),
                              "cells": [st.kv_cells_used, st.kv_cells_total]}), flush=True)


async def rounds(model: Path, threads: int, n: int, new: int, n_rounds: int, n_vocab: int,
                 server_bin: Path | None, baseline: Path | None = None) -> dict[str, list[float]]:
    """tokens/s per round for each contender, one long-lived engine or process each, taking turns."""
    n_ctx = max(8192, 4 * n * (PROMPT + new))  # room for several rounds of cache
    out: dict[str, list[float]] = {"aiollama": [], "aiollama_split": []}
    workers = {"aiollama": Worker(model, threads, n, n_ctx, True),
               "aiollama_split": Worker(model, threads, n, n_ctx, False)}
    if baseline is not None:
        out["baseline"] = []
        workers["baseline"] = Worker(model, threads, n, n_ctx, True, package=baseline)
    server = LlamaServer(server_bin, model, n_parallel=n, n_ctx=n_ctx, threads=threads, unified=False) \
        if server_bin is not None else None
    warm = prompts(1, PROMPT, n_vocab, seed=99)
    try:
        for w in workers.values():
            w.ask({"batch": warm, "new": 8})
        if server is not None:
            server.__enter__()
            out["llama_server"] = []
            await run_clients(server.url, warm, 8)
        for r in range(n_rounds):
            batch = prompts(n, PROMPT, n_vocab, seed=1000 * (r + 1) + n)  # distinct prompts every round
            for name, w in workers.items():
                answer = w.ask({"batch": batch, "new": new})
                out[name].append(answer["tps"])
                out[name + "_cells"] = answer["cells"]
            if server is not None:
                start = time.perf_counter()
                timings = await run_clients(server.url, batch, new)
                out["llama_server"].append(_tps(timings, time.perf_counter() - start))
            print(f"  {model.name} n={n} round {r + 1}: " +
                  ", ".join(f"{k} {v[-1]:.0f}" for k, v in out.items() if not k.endswith("_cells")), flush=True)
    finally:
        for w in workers.values():
            w.close()
        if server is not None:
            server.__exit__(None, None, None)
    return out


async def arrivals(send: Callable[[int, list[int]], Awaitable[int]], n_vocab: int, window: float,
                   first: int = 0) -> float:
    """CLIENTS clients sending one request after another for ``window`` seconds (``send(k, prompt)``
    runs request k and gives its completion tokens; requests are numbered from ``first``, which
    also seeds their prompts); tokens/s over the window."""
    counter = itertools.count(first)
    start = time.perf_counter()
    end = start + window
    counted = [0.0]  # the tokens that fell inside the window (see spread)

    async def client_loop() -> None:
        while time.perf_counter() < end:
            k = next(counter)
            prompt = prompts(1, PROMPT, n_vocab, seed=50_000 + k)[0]
            sent = time.perf_counter()
            tokens = await send(k, prompt)
            spread(counted, sent - start, time.perf_counter() - start, window, tokens)

    async with anyio.create_task_group() as tg:
        for _ in range(CLIENTS):
            tg.start_soon(client_loop)
    return counted[0] / window


async def http_arrivals(url: str, n_vocab: int, window: float, banned: list[int], first: int = 0) -> float:
    """Arrivals as completion requests to a server."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=CLIENTS + 2)) as client:
        async def send(k: int, prompt: list[int]) -> int:
            body = {"model": "m", "prompt": prompt, "max_tokens": ARRIVAL_TOKENS, "temperature": 0.7, "seed": k,
                    "logit_bias": {str(t): -100 for t in banned}}
            r = await client.post(url + "/v1/completions", json=body, timeout=None)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        return await arrivals(send, n_vocab, window, first)


async def engine_arrivals(e: aiollama.Engine, n_vocab: int, window: float, banned: list[int],
                          first: int = 0) -> float:
    """The same arrivals straight into an engine configured as ``aiollama serve`` is: what the
    server could reach without HTTP."""
    bias = {t: -100.0 for t in banned}

    async def send(k: int, prompt: list[int]) -> int:
        async with e.conversation(prompt) as conv:
            completion = await conv.stream(max_tokens=ARRIVAL_TOKENS, temperature=0.7, seed=k, logit_bias=bias)
            return len(completion.tokens)

    return await arrivals(send, n_vocab, window, first)


def spread(per_window: list[float], sent: float, done: float, window: float, tokens: int) -> None:
    """Share a request's tokens among the windows its time in flight overlaps, in proportion.

    Counting each request whole in the window where it ends would move results in steps of a
    whole wave of clients (about 9% of a window here), more than the differences measured.
    """
    span = max(done - sent, 1e-9)
    for slot in range(len(per_window)):
        overlap = min(done, (slot + 1) * window) - max(sent, slot * window)
        if overlap > 0:
            per_window[slot] += tokens * overlap / span


def eog_tokens(model: Path) -> list[int]:
    with Model(model) as m:
        return [t for t in range(m.vocab.n_tokens) if m.vocab.is_eog(t)]


def ratio(a: list[float]) -> float:
    return a[-1] / a[0] if a and a[0] else float("nan")


def report(r: dict[str, Any]) -> str:
    lines = [f"Measured {r['date']} on {r['machine']['cpu']} ({r['machine']['cpus']} CPUs), "
             f"{r['threads']} threads; every round {PROMPT}-token distinct prompts, temperature 0.7, EOG ignored."]
    if r["rounds"]:
        lines += ["", "**Rounds on one warm engine / one llama-server process** (tokens/s per round; last/first)", "",
                  "| model | streams x tokens | contender | rounds | last/first | last vs llama-server |",
                  "|---|---|---|---|---:|---:|"]
    for key, res in r["rounds"].items():
        model, n, new = key.split("|")
        server_last = res.get("llama_server", [0.0])[-1]
        for name in ("aiollama", "aiollama_split", "baseline", "llama_server"):
            if name not in res:
                continue
            v = res[name]
            vs = f"{v[-1] / server_last:.2f}" if server_last and name != "llama_server" else ""
            lines.append(f"| {model} | {n} x {new} | {name} | {' / '.join(f'{x:.0f}' for x in v)} | "
                         f"{ratio(v):.2f} | {vs} |")
    if r.get("arrivals"):
        lines += ["", f"**Continuous arrivals**: {CLIENTS} clients, one request after another, {ARRIVAL_TOKENS} tokens "
                  f"each (EOG banned), SmolLM2; tokens/s per {r['window']:.0f}-s window, the contenders all up "
                  "and taking turns window by window, the order rotating", "",
                  "| server | " + " | ".join(f"window {i + 1}" for i in range(r["windows"])) + " | last/first |",
                  "|---|" + "---:|" * (r["windows"] + 1)]
        for name, v in r["arrivals"].items():
            lines.append(f"| {name} | " + " | ".join(f"{x:.0f}" for x in v) + f" | {ratio(v):.2f} |")
        a, s = r["arrivals"].get("aiollama serve"), r["arrivals"].get("llama-server")
        if a and s:
            per = [x / y for x, y in zip(a, s) if x and y]
            mean = f"{statistics.geometric_mean(per):.2f} (geometric mean)" if per else ""
            lines.append("| aiollama / llama-server | " + " | ".join(f"{x / y:.2f}" if y else "" for x, y in zip(a, s))
                         + f" | {mean} |")
        if "engine_in_decode" in r:
            lines += ["", f"The engine without HTTP (the same requests as tasks of one process, configured as "
                      f"`aiollama serve` is) spent {r['engine_in_decode']:.1%} of its time inside `llama_decode`."]
    return "\n".join(lines) + "\n"


async def arrivals_in_turn(r: dict[str, Any], model: Path, threads: int, n_vocab: int, server_bin: Path,
                           windows: int, window: float) -> None:
    """The continuous arrivals: every contender up at once, a window each in turn, ``windows`` times
    (the order rotating), into ``r["arrivals"]``; the engine's share of its time in llama_decode
    into ``r["engine_in_decode"]``."""
    banned = eog_tokens(model)
    n_ctx = 8192
    servers = {"llama-server": LlamaServer(server_bin, model, n_parallel=CLIENTS, n_ctx=n_ctx, threads=threads,
                                           unified=False),
               "aiollama serve": AiollamaServer(model, n_seq_max=CLIENTS, n_ctx=n_ctx, threads=threads),
               "aiollama serve --unified-cache": AiollamaServer(model, n_seq_max=CLIENTS, n_ctx=n_ctx, threads=threads,
                                                                extra=("--unified-cache",))}
    names = [ENGINE, *servers]
    r["arrivals"] = {name: [] for name in names}
    in_decode = [0.0, 0.0]  # the engine's seconds in llama_decode, and in all
    worker = Worker(model, threads, CLIENTS, n_ctx, False)
    try:
        with contextlib.ExitStack() as stack:
            for server in servers.values():
                stack.enter_context(server)
            for w in range(windows):
                first = 10_000 * w  # the same prompts for every contender of a window
                for name in names[w % len(names):] + names[:w % len(names)]:
                    if name == ENGINE:
                        answer = worker.ask({"arrivals": {"n_vocab": n_vocab, "window": window, "banned": banned,
                                                          "first": first}})
                        tps = answer["tps"]
                        in_decode[0] += answer["decode_seconds"]
                        in_decode[1] += answer["wall"]
                    else:
                        tps = await http_arrivals(servers[name].url, n_vocab, window, banned, first)
                    r["arrivals"][name].append(tps)
                    print(f"arrivals, window {w + 1}: {name} {tps:.0f} tokens/s", flush=True)
    finally:
        worker.close()
    r["engine_in_decode"] = in_decode[0] / in_decode[1] if in_decode[1] else float("nan")


async def main(args: argparse.Namespace) -> int:
    threads = args.threads or math_cpus()
    smollm2 = aiollama.pull()
    models = {"smollm2": smollm2, "fast": fast_model.path()}
    with Model(smollm2) as m:
        n_vocab = m.vocab.n_tokens
    bins = None if args.no_server else tools.build(quiet=True)
    server_bin = bins["llama-server"] if bins else None
    r: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(), "threads": threads,
                         "rounds": {}, "arrivals": {}, "windows": args.windows, "window": args.window}
    for name in filter(None, args.models.split(",")):
        new = 96 if name == "smollm2" else 128
        for n in (int(x) for x in args.levels.split(",")):
            print(f"rounds: {name} {n} streams", flush=True)
            r["rounds"][f"{name}|{n}|{new}"] = await rounds(models[name], threads, n, new, args.rounds, n_vocab,
                                                           server_bin, args.baseline)
    stem = save_results(r, "steady" if not args.tag else f"steady-{args.tag}", report(r))  # kept if what follows fails
    if args.windows and server_bin is not None:
        await arrivals_in_turn(r, smollm2, threads, n_vocab, server_bin, args.windows, args.window)
    save_results(r, "steady", report(r), stem=stem)  # the same files, now whole
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(anyio.run(serve_worker, json.loads(sys.argv[2])))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, help="llama.cpp threads (default: one per physical core)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--levels", default="8,32")
    parser.add_argument("--models", default="smollm2,fast")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window", type=float, default=45.0)
    parser.add_argument("--no-server", action="store_true", help="aiollama only (no llama.cpp tools to build)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a folder holding another build of the aiollama package: its engine (unified cache) "
                             "runs the rounds beside the others, as 'baseline'")
    parser.add_argument("--tag", default="", help="a suffix for the results' file names")
    sys.exit(anyio.run(main, parser.parse_args()))
