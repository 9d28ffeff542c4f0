"""What the deterministic mode costs: throughput at 1, 8 and 32 streams and prompt evaluation, with
and without it, alternated in one run.

    pip install ".[bench]" && python benchmarks/deterministic.py     # about 5 minutes on 2 cores

SmolLM2-135M-Instruct Q4_1, 64-token prompts and 128 new tokens per stream (EOG ignored), as in
run.py's throughput scenario; prompt evaluation is one 1,000-token prompt. A tight cache adds what
freeing cells costs the mode (re-laying the cache): 3 waves of 16 streams, 200-token prompts and
64 new tokens each, in 2,048 cells, so streams are preempted and closed ones evicted. Each setting
runs alternately, best of ``--rounds``. Results go to benchmarks/results/<date>-<machine>-deterministic.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tools  # noqa: E402
from common import machine, prompts, save_results, throughput  # noqa: E402
from scenarios import aiollama_streams  # noqa: E402

import aiollama  # noqa: E402
from aiollama.native import Model, math_cpus  # noqa: E402

LEVELS = (1, 8, 32)
PROMPT, NEW, LONG = 64, 128, 1000
TIGHT_CELLS, WAVES, WAVE, TIGHT_PROMPT, TIGHT_NEW = 2048, 3, 16, 200, 64


async def one_round(model: Path, threads: int, deterministic: bool, n_vocab: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with aiollama.Engine(model, n_ctx=8192, n_seq_max=32, n_threads=threads,
                               deterministic=deterministic) as engine:
        for n in LEVELS:
            timings = await aiollama_streams(engine, prompts(n, PROMPT, n_vocab, seed=n), NEW)
            out[f"decode_tps_{n}"] = throughput(timings)["decode_tps"]
        await engine.clear_cache()
        conv = engine.conversation(prompts(1, LONG, n_vocab, seed=99)[0])
        start = time.perf_counter()
        await conv.stream(max_tokens=1)
        out["prompt_tps"] = LONG / (time.perf_counter() - start)
    async with aiollama.Engine(model, n_ctx=TIGHT_CELLS, n_seq_max=WAVE, n_threads=threads,
                               deterministic=deterministic) as engine:
        start = time.perf_counter()
        for wave in range(WAVES):
            await aiollama_streams(engine, prompts(WAVE, TIGHT_PROMPT, n_vocab, seed=100 + wave), TIGHT_NEW)
        out["tight_tps"] = WAVES * WAVE * TIGHT_NEW / (time.perf_counter() - start)
        stats = engine.statistics()
        out["tight_preemptions"], out["tight_compactions"] = stats.preemptions, stats.compactions
    return out


def markdown(r: dict[str, Any]) -> str:
    d, f = r["default"], r["deterministic"]
    rows = [f"| {n} streams, decode tokens/s | {d[f'decode_tps_{n}']:.1f} | {f[f'decode_tps_{n}']:.1f} | "
            f"{f[f'decode_tps_{n}'] / d[f'decode_tps_{n}']:.2f} |" for n in LEVELS]
    rows.append(f"| 1,000-token prompt, tokens/s | {d['prompt_tps']:.0f} | {f['prompt_tps']:.0f} | "
                f"{f['prompt_tps'] / d['prompt_tps']:.2f} |")
    rows.append(f"| tight cache, generated tokens/s | {d['tight_tps']:.1f} | {f['tight_tps']:.1f} | "
                f"{f['tight_tps'] / d['tight_tps']:.2f} |")
    rows.append(f"| tight cache, preemptions / re-layings | {d['tight_preemptions']:.0f} / "
                f"{d['tight_compactions']:.0f} | {f['tight_preemptions']:.0f} / {f['tight_compactions']:.0f} | |")
    return (f"Measured {r['date']} on {r['machine']['cpu']} ({r['machine']['cpus']} CPUs), llama.cpp {r['llama_cpp']}, "
            f"model {r['model']}, {r['threads']} threads, best of {r['rounds']} alternated rounds.\n\n"
            "**The deterministic mode's cost** (reference kernels, flash attention, no repacked weights; "
            f"freed cells re-laid). Tight cache: {WAVES} waves of {WAVE} streams, {TIGHT_PROMPT}-token prompts, "
            f"{TIGHT_NEW} new tokens, {TIGHT_CELLS:,} cells.\n\n"
            "| | default | deterministic | ratio |\n|---|---:|---:|---:|\n" + "\n".join(rows) + "\n")


async def main(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else aiollama.default_model()
    threads = args.threads or math_cpus()
    with Model(model, vocab_only=True) as m:
        n_vocab = m.vocab.n_tokens
    runs: dict[str, list[dict[str, float]]] = {"default": [], "deterministic": []}
    for i in range(args.rounds):
        for name in runs:
            print(f"round {i + 1}: {name}", flush=True)
            runs[name].append(await one_round(model, threads, name == "deterministic", n_vocab))
    best = {name: {k: max(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    r: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(), "model": model.name,
                         "threads": threads, "llama_cpp": tools.TAG, "rounds": args.rounds, **best, "runs": runs}
    save_results(r, "deterministic", markdown(r))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    sys.exit(anyio.run(main, parser.parse_args()))
