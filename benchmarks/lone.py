"""A lone streamed request, against llama-server: the latency a user sees when nothing else runs.

    pip install ".[bench,server]" && python benchmarks/lone.py          # about 5 minutes on 2 cores

``aiollama serve`` and llama-server run side by side (one process each, 4 parallel slots, the same
threads), idle but for one streaming ``/completion`` at a time: a 64-token prompt (random ids, new
each request), 128 new tokens at temperature 0.7, the end of generation ignored. The two take turns
request by request. Reported per server: the median inter-token latency (ITL) and its 90th
percentile over every gap of every request, the median time to the first token, and the tokens/s
after it; then aiollama's ITL and tokens/s as ratios of llama-server's. SmolLM2 and the fast model.
Where the host time goes: each server's threads' CPU time over its own requests (from /proc, on
Linux), per token: the two busiest (the decode's compute threads) and all the others together
(llama-server's HTTP threads; aiollama's event loop, which parses, formats and writes each event).

Results go to benchmarks/results/<date>-<machine>-<cpus>cpu-lone.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fast_model  # noqa: E402
import tools  # noqa: E402
from common import StreamTiming, machine, percentile, prompts, save_results, thread_cpu  # noqa: E402
from server import AiollamaServer, LlamaServer, ServerProcess, stream_completion  # noqa: E402

import aiollama  # noqa: E402
from aiollama.native import Model, available_cpus  # noqa: E402

PROMPT, NEW, N_CTX, SLOTS = 64, 128, 4096, 4


async def one(client: httpx.AsyncClient, server: ServerProcess, prompt: list[int], seed: int,
              cpu: dict[int, float] | None = None) -> StreamTiming:
    """A streamed request; with ``cpu``, each thread's CPU seconds over it are added there."""
    pid = server.proc.pid if server.proc is not None else 0
    before = thread_cpu(pid) if cpu is not None else {}
    timing = StreamTiming(time.perf_counter())
    await stream_completion(client, server.url, prompt, NEW, seed, timing)
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
    asked = prompts(2 * requests + 2, PROMPT, n_vocab, seed=5)
    timings: dict[str, list[StreamTiming]] = {"aiollama": [], "llama-server": []}
    cpu: dict[str, dict[int, float]] = {"aiollama": {}, "llama-server": {}}
    with AiollamaServer(model, n_seq_max=SLOTS, n_ctx=N_CTX, threads=threads) as ours, \
            LlamaServer(binary, model, n_parallel=SLOTS, n_ctx=N_CTX, threads=threads, unified=True) as theirs:
        async with httpx.AsyncClient() as client:
            for name, server in (("aiollama", ours), ("llama-server", theirs)):  # warm-up, not counted
                await one(client, server, asked[-1 if name == "aiollama" else -2], 0)
            for i in range(requests):
                pair = [("aiollama", ours), ("llama-server", theirs)]
                for name, server in pair if i % 2 == 0 else pair[::-1]:
                    timings[name].append(await one(client, server, asked[2 * i + (name == "llama-server")], i,
                                                   cpu[name]))
    r: dict[str, Any] = {"model": model.name, **{name: summary(t, cpu[name]) for name, t in timings.items()}}
    ours_s, theirs_s = r["aiollama"], r["llama-server"]
    r["itl_ratio"] = ours_s["itl_median_ms"] / theirs_s["itl_median_ms"]
    r["tps_ratio"] = ours_s["decode_tps"] / theirs_s["decode_tps"]
    return r


def markdown(r: dict[str, Any]) -> str:
    out = [f"# A lone streamed request ({r['date']}, {r['machine']['cpu']}, {r['machine']['cpus']} CPUs)", "",
           f"One streaming `/completion` at a time, {PROMPT}-token prompts, {NEW} new tokens at temperature 0.7, "
           f"{r['requests']} requests each, the two servers taking turns; {r['threads']} threads, {SLOTS} slots.", "",
           "| model | server | ITL median (ms) | ITL p90 (ms) | TTFT median (ms) | tok/s after the first "
           "| CPU µs/token, two busiest threads | CPU µs/token, the other threads |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for m in r["models"]:
        for name in ("aiollama", "llama-server"):
            s = m[name]
            out.append(f"| {m['model']} | {name} | {s['itl_median_ms']:.2f} | {s['itl_p90_ms']:.2f} | "
                       f"{s['ttft_median_ms']:.1f} | {s['decode_tps']:.1f} | "
                       f"{s['cpu_us_per_token_busiest_two']:.0f} | {s['cpu_us_per_token_others']:.0f} |")
    out += ["", "| model | aiollama ITL / llama-server's | aiollama tok/s / llama-server's |", "|---|---:|---:|"]
    out += [f"| {m['model']} | {m['itl_ratio']:.3f} | {m['tps_ratio']:.3f} |" for m in r["models"]]
    return "\n".join(out) + "\n"


async def main(args: argparse.Namespace) -> int:
    threads = args.threads or available_cpus()
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
    parser.add_argument("--threads", type=int, help="llama.cpp threads (default: usable CPUs)")
    parser.add_argument("--requests", type=int, default=12, help="requests per server and model")
    parser.add_argument("--tag", default="", help="a suffix for the results' file names")
    sys.exit(anyio.run(main, parser.parse_args()))
