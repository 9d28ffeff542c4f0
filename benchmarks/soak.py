"""Soak: a long mixed load on one engine, watching memory, errors and throughput over time.

    python benchmarks/soak.py [--minutes 30] [--clients 16] [--model PATH]

Sixteen clients loop over a mix of work: short conversations, forks of a shared system prompt,
streams dropped part-way, multi-turn conversations, and long prompts joining running streams.
Every ``--interval`` seconds it records process RSS, tokens generated, errors and the engine's
statistics; at the end it writes JSON and Markdown to ``benchmarks/results/`` and exits non-zero
on any error. Not part of the test suite: it runs for half an hour.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import anyio

import aiollama
from aiollama import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

SYSTEM = ("You are a careful assistant. Answer briefly and cite the step you used. " * 6).strip()
WORDS = "river stone lamp orbit cedar violin harbor meadow signal copper lantern quartz".split()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


class Load:
    def __init__(self, engine: Engine, seed: int) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.tokens = 0
        self.done: Counter[str] = Counter()
        self.errors: list[str] = []

    def text(self, n_words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n_words))

    async def short(self) -> None:
        async with self.engine.conversation(f"Tell me about {self.text(6)}.") as conv:
            out = await conv.stream(max_tokens=self.rng.randint(16, 96), temperature=0.7,
                                    seed=self.rng.randrange(2**31))
            self.tokens += len(out.tokens)

    async def forks(self) -> None:
        async with self.engine.conversation(SYSTEM) as root:
            root.prompt(f" Question: {self.text(8)}?")
            children = [root.fork() for _ in range(self.rng.randint(2, 4))]
            try:
                async with anyio.create_task_group() as tg:
                    for i, child in enumerate(children):
                        tg.start_soon(self._collect, child, 48, i)
            finally:
                for child in children:
                    await child.aclose()

    async def _collect(self, conv: aiollama.Conversation, max_tokens: int, seed: int) -> None:
        out = await conv.stream(max_tokens=max_tokens, temperature=0.9, seed=seed)
        self.tokens += len(out.tokens)

    async def dropped(self) -> None:
        async with self.engine.conversation(f"Write a story about {self.text(5)}.") as conv:
            keep = self.rng.randint(0, 40)
            async for chunk in conv.stream(max_tokens=200, temperature=0.8):
                self.tokens += len(chunk.tokens)
                keep -= len(chunk.tokens)
                if keep <= 0:
                    break

    async def turns(self) -> None:
        async with self.engine.conversation(f"Let us talk about {self.text(4)}.") as conv:
            for _ in range(self.rng.randint(2, 4)):
                out = await conv.stream(max_tokens=32, temperature=0.7, stop=["\n\n"])
                self.tokens += len(out.tokens)
                conv.prompt(f" And what about {self.text(3)}?")

    async def long_prompt(self) -> None:
        async with self.engine.conversation(f"Summarize: {self.text(self.rng.randint(600, 1400))}") as conv:
            with anyio.move_on_after(self.rng.choice([0.5, 60.0])):  # some are cancelled mid-prefill
                out = await conv.stream(max_tokens=32, temperature=0.7)
                self.tokens += len(out.tokens)

    async def client(self, deadline: float) -> None:
        kinds = [self.short] * 4 + [self.forks] * 2 + [self.dropped] * 2 + [self.turns] * 2 + [self.long_prompt]
        while time.monotonic() < deadline:
            work = self.rng.choice(kinds)
            try:
                await work()
                self.done[work.__name__] += 1
            except Exception:  # noqa: BLE001 - counted and reported; the soak goes on
                self.errors.append(traceback.format_exc(limit=3))


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    async with Engine(args.model, n_ctx=args.n_ctx, n_seq_max=args.clients) as engine:
        load = Load(engine, seed=args.seed)
        start = time.monotonic()
        deadline = start + 60 * args.minutes

        async def sampler() -> None:
            last_tokens, last_t = 0, start
            while time.monotonic() < deadline:
                await anyio.sleep(args.interval)
                now, s = time.monotonic(), engine.statistics()
                samples.append({
                    "t_s": round(now - start, 1), "rss_mib": round(rss_mib(), 1),
                    "tokens_per_s": round((load.tokens - last_tokens) / (now - last_t), 1),
                    "errors": len(load.errors), "live": s.live, "active": s.active, "queued": s.queued,
                    "kv_cells_used": s.kv_cells_used, "seq_ids_used": s.seq_ids_used,
                })
                last_tokens, last_t = load.tokens, now
                print(json.dumps(samples[-1]), flush=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler)
            for _ in range(args.clients):
                tg.start_soon(load.client, deadline)
        final = engine.statistics()
    return {
        "machine": machine(), "model": Path(args.model).name, "minutes": args.minutes, "clients": args.clients,
        "completed": dict(load.done), "errors": load.errors, "tokens": load.tokens, "samples": samples,
        "final": {k: getattr(final, k) for k in ("live", "active", "queued", "kv_cells_used", "seq_ids_used",
                                                 "tokens_generated", "decode_steps", "aborted_steps")},
        "summary": summarize(samples),
    }


def summarize(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Memory growth and throughput drift, comparing the first and last quarter (after warm-up)."""
    if len(samples) < 8:
        return {}
    q = len(samples) // 4
    first, last = samples[1:q + 1], samples[-q:]

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    return {
        "rss_first_mib": samples[1]["rss_mib"], "rss_max_mib": max(s["rss_mib"] for s in samples),
        "rss_last_mib": samples[-1]["rss_mib"],
        "rss_growth_second_half_mib": round(samples[-1]["rss_mib"] - samples[len(samples) // 2]["rss_mib"], 1),
        "tps_first_quarter": round(mean(first, "tokens_per_s"), 1),
        "tps_last_quarter": round(mean(last, "tokens_per_s"), 1),
        "tps_drift": round(mean(last, "tokens_per_s") / mean(first, "tokens_per_s") - 1, 3),
    }


def markdown(r: dict[str, Any]) -> str:
    s = r["summary"]
    lines = [
        f"# Soak: {r['minutes']} minutes, {r['clients']} clients, {Path(r['model']).name}", "",
        f"Machine: {r['machine']['cpu']}, {r['machine']['cpus']} CPUs, Python {r['machine']['python']}", "",
        f"- work items completed: {sum(r['completed'].values())} ({r['completed']})",
        f"- tokens generated: {r['tokens']}",
        f"- errors: {len(r['errors'])}",
        f"- RSS: {s.get('rss_first_mib')} MiB after warm-up, max {s.get('rss_max_mib')}, "
        f"last {s.get('rss_last_mib')}; growth over the second half {s.get('rss_growth_second_half_mib')} MiB",
        f"- throughput: {s.get('tps_first_quarter')} tokens/s in the first quarter, "
        f"{s.get('tps_last_quarter')} in the last (drift {100 * s.get('tps_drift', 0):+.1f}%)",
        f"- at the end: {r['final']}", "",
        "| t (s) | RSS (MiB) | tokens/s | errors | live | active | queued | KV cells |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {x['t_s']} | {x['rss_mib']} | {x['tokens_per_s']} | {x['errors']} | {x['live']} | "
              f"{x['active']} | {x['queued']} | {x['kv_cells_used']} |" for x in r["samples"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--interval", type=float, default=30.0)
    parser.add_argument("--n-ctx", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.model is None:
        args.model = aiollama.default_model()
    result = anyio.run(soak, args)
    args.out.mkdir(parents=True, exist_ok=True)
    m = result["machine"]
    stem = args.out / f"soak-{time.strftime('%Y-%m-%d')}-{m['machine']}-{m['cpus']}cpu"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result).split("| t (s)")[0])
    for error in result["errors"][:5]:
        print(error)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
