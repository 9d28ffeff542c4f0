"""A lone streamed request, against llama-server: the latency a user sees when nothing else runs.

    pip install ".[bench,server]" && python benchmarks/lone.py          # about 5 minutes on 2 cores

``aiollama serve`` and llama-server run side by side (one process each, 4 parallel slots, the same
threads), idle but for one streaming ``/completion`` at a time: a 64-token prompt (random ids, new
each request), 128 new tokens at temperature 0.7, the end of generation ignored. A third contender
is the library without HTTP: an ``Engine`` in this process (the same slots, context and threads),
its ``conv.stream()`` read by this process's event loop, as a service that embeds aiollama reads it.
The three take turns request by request. Reported per contender: the median inter-token latency
(ITL) and its 90th percentile over every gap of every request, the median time to the first token,
and the tokens/s after it; then the ITL and tokens/s of ``aiollama serve`` and of the engine in
process as ratios of llama-server's. SmolLM2 and the fast model.
Where the host time goes: each contender's threads' CPU time over its own requests (from /proc, on
Linux), per token: the two busiest (the decode's compute threads) and all the others together
(llama-server's HTTP threads; aiollama's event loop, which parses, formats and writes each event;
in process, this process's event loop, which reads the stream).

Results go to benchmarks/results/<date>-<machine>-<cpus>cpu-lone.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
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
from common import StreamTiming, machine, percentile, prompts, save_results, thread_cpu  # noqa: E402
from server import SAMPLING, AiollamaServer, LlamaServer, ServerProcess, stream_completion  # noqa: E402

import aiollama  # noqa: E402
from aiollama.native import Model, math_cpus  # noqa: E402

PROMPT, NEW, N_CTX, SLOTS = 64, 128, 4096, 4
CONTENDERS = ("aiollama", "llama-server", "in process")  # aiollama serve, llama-server, an Engine here


Contender = Callable[[list[int], int, StreamTiming], Awaitable[None]]  # (prompt, seed, timing)


def over_http(client: httpx.AsyncClient, server: ServerProcess) -> tuple[Contender, int]:
    """A server's streamed ``/completion``, and its process."""
    async def run(prompt: list[int], seed: int, timing: StreamTiming) -> None:
        await stream_completion(client, server.url, prompt, NEW, seed, timing)
    return run, server.proc.pid if server.proc is not None else 0


def in_process(engine: aiollama.Engine) -> tuple[Contender, int]:
    """A conversation of an engine in this process, streamed as ``/completion`` samples (the
    sampling defaults are llama-server's)."""
    async def run(prompt: list[int], seed: int, timing: StreamTiming) -> None:
        async with engine.conversation() as conv:
            conv.prompt(prompt)
            async for chunk in conv.stream(max_tokens=NEW, seed=seed, **SAMPLING):
                timing.arrivals.extend([time.perf_counter()] * len(chunk.tokens))
    return run, os.getpid()


async def one(contender: tuple[Contender, int], prompt: list[int], seed: int,
              cpu: dict[int, float] | None = None) -> StreamTiming:
    """A streamed request; with ``cpu``, each thread's CPU seconds over it are added there."""
    run, pid = contender
    before = thread_cpu(pid) if cpu is not None else {}
    timing = StreamTiming(time.perf_counter())
    await run(prompt, seed, timing)
    if cpu is not None:
        for tid, seconds in thread_cpu(pid).items():
            cpu[tid] = cpu.get(tid, 0.0) + seconds - before.get(tid, 0.0)
    return timing


def summary(timings: list[StreamTiming], cpu: dict[int, float]) -> dict[str, float]:
    gaps = [g for t in timings for g in t.gaps()]
    tokens = sum(len(t.arrivals) for t in timings)
    busiest = sorted(cpu.values(), reverse=True)
    return {"requests": len(timings), "itl_median_ms": 1e3 * statistics.median(gaps),
            "itl_p90_ms": 1e3 * percentile(gaps, 0.9),
            "ttft_median_ms": 1e3 * statistics.median(t.first - t.start for t in timings),
            "decode_tps": statistics.median((len(t.arrivals) - 1) / (t.arrivals[-1] - t.first) for t in timings),
            "cpu_us_per_token_busiest_two": 1e6 * sum(busiest[:2]) / tokens if busiest else float("nan"),
            "cpu_us_per_token_others": 1e6 * sum(busiest[2:]) / tokens if busiest else float("nan")}


async def compare(model: Path, binary: Path, threads: int, requests: int) -> dict[str, Any]:
    with Model(model, vocab_only=True) as m:
        n_vocab = m.vocab.n_tokens
    asked = prompts(len(CONTENDERS) * (requests + 1), PROMPT, n_vocab, seed=5)
    timings: dict[str, list[StreamTiming]] = {name: [] for name in CONTENDERS}
    cpu: dict[str, dict[int, float]] = {name: {} for name in CONTENDERS}
    with AiollamaServer(model, n_seq_max=SLOTS, n_ctx=N_CTX, threads=threads) as ours, \
            LlamaServer(binary, model, n_parallel=SLOTS, n_ctx=N_CTX, threads=threads, unified=True) as theirs:
        async with httpx.AsyncClient() as client, \
                aiollama.Engine(str(model), n_seq_max=SLOTS, n_ctx=N_CTX, n_threads=threads) as engine:
            contenders = dict(zip(CONTENDERS, (over_http(client, ours), over_http(client, theirs), in_process(engine))))
            for k, contender in enumerate(contenders.values()):  # warm-up, not counted
                await one(contender, asked[-1 - k], 0)
            n = len(CONTENDERS)
            for i in range(requests):
                for j, name in enumerate(CONTENDERS[i % n:] + CONTENDERS[:i % n]):  # each goes first in turn
                    timings[name].append(await one(contenders[name], asked[n * i + j], i, cpu[name]))
    r: dict[str, Any] = {"model": model.name, **{name: summary(t, cpu[name]) for name, t in timings.items()}}
    theirs_s = r["llama-server"]
    for prefix, name in (("", "aiollama"), ("inproc_", "in process")):
        r[prefix + "itl_ratio"] = r[name]["itl_median_ms"] / theirs_s["itl_median_ms"]
        r[prefix + "tps_ratio"] = r[name]["decode_tps"] / theirs_s["decode_tps"]
    return r


def markdown(r: dict[str, Any]) -> str:
    out = [f"# A lone streamed request ({r['date']}, {r['machine']['cpu']}, {r['machine']['cpus']} CPUs)", "",
           f"One streaming `/completion` at a time, {PROMPT}-token prompts, {NEW} new tokens at temperature 0.7, "
           f"{r['requests']} requests each, taking turns: `aiollama serve`, llama-server, and an `Engine` in the "
           f"benchmark's process read by its event loop (no HTTP); {r['threads']} threads, {SLOTS} slots.", "",
           "| model | contender | ITL median (ms) | ITL p90 (ms) | TTFT median (ms) | tok/s after the first "
           "| CPU µs/token, two busiest threads | CPU µs/token, the other threads |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for m in r["models"]:
        for name in CONTENDERS:
            if name not in m:  # results from before the engine in process was measured
                continue
            s = m[name]
            out.append(f"| {m['model']} | {name} | {s['itl_median_ms']:.2f} | {s['itl_p90_ms']:.2f} | "
                       f"{s['ttft_median_ms']:.1f} | {s['decode_tps']:.1f} | "
                       f"{s['cpu_us_per_token_busiest_two']:.0f} | {s['cpu_us_per_token_others']:.0f} |")
    out += ["", "| model | aiollama serve ITL / llama-server's | tok/s | in process ITL / llama-server's | tok/s |",
            "|---|---:|---:|---:|---:|"]
    out += [f"| {m['model']} | {m['itl_ratio']:.3f} | {m['tps_ratio']:.3f} | {m.get('inproc_itl_ratio', float('nan')):.3f} "
            f"| {m.get('inproc_tps_ratio', float('nan')):.3f} |" for m in r["models"]]
    return "\n".join(out) + "\n"


async def main(args: argparse.Namespace) -> int:
    threads = args.threads or math_cpus()
    binary = tools.build()["llama-server"]
    r: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(), "threads": threads,
                         "requests": args.requests, "models": []}
    for model in (aiollama.default_model(), fast_model.path()):
        r["models"].append(await compare(model, binary, threads, args.requests))
        print(r["models"][-1], flush=True)
    save_results(r, "lone" if not args.tag else f"lone-{args.tag}", markdown(r))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, help="llama.cpp threads (default: one per physical core)")
    parser.add_argument("--requests", type=int, default=12, help="requests per server and model")
    parser.add_argument("--tag", default="", help="a suffix for the results' file names")
    sys.exit(anyio.run(main, parser.parse_args()))
