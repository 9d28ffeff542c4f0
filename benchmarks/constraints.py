"""The cost of a JSON-schema constraint at 8 streams, against llama-server's, in one run.

    pip install ".[bench,server]" && python benchmarks/constraints.py     # about 3 minutes on 2 cores

8 chat streams of 128 tokens each, once free and once constrained to a JSON schema (a list of at
least 40 city records, so no stream completes it early), alternated over a few rounds:

1. aiollama in-process: generated tokens per second, free and constrained, and the ratio;
2. llama-server (-np 8, the same schema through its json_schema field, which it turns into a
   GBNF grammar): the same, over HTTP;
3. the constraint's own work per decode step, replayed on the tokens the constrained streams
   chose: llguidance filling the 8 masks at once, applying them to the logits rows, and advancing
   the matchers, as the decode thread does, against the time of a free decode step.

Results go to benchmarks/results/<date>-<machine>-constraints.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tools  # noqa: E402
from common import machine, save_results  # noqa: E402
from server import LlamaServer  # noqa: E402

import aiollama  # noqa: E402
from aiollama.formats import constraints  # noqa: E402
from aiollama.native import Model, available_cpus, math_cpus  # noqa: E402
from aiollama.runner.tokenizer import VocabTokenizer  # noqa: E402
from aiollama.sampling import SamplingParams  # noqa: E402

STREAMS, TOKENS = 8, 128
QUESTION = "List the fifty largest cities of the world as JSON, with their country and population."
CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["name", "country", "population"]}
SCHEMA = {"type": "object", "properties": {"cities": {"type": "array", "items": CITY, "minItems": 40}},
          "required": ["cities"]}


def sampling(i: int, constrained: bool) -> dict[str, Any]:
    free: dict[str, Any] = {"max_tokens": TOKENS, "temperature": 0.8, "seed": 1000 + i}
    return {**free, "json_schema": SCHEMA} if constrained else {**free, "ignore_eos": True}


@dataclass
class Round:
    tps: float  # generated tokens per second over the 8 streams
    step_ms: float  # a decode step, all of it
    outside_ms: float  # a decode step outside llama_decode: planning, masks, sampling, delivery
    tokens: list[list[int]]  # each stream's


async def aiollama_round(engine: aiollama.Engine, constrained: bool) -> Round:
    chosen: list[list[int]] = [[] for _ in range(STREAMS)]
    before = engine.statistics()

    async def one(i: int) -> None:
        async with engine.conversation() as conv:
            result = await conv.chat(QUESTION, **sampling(i, constrained))
            chosen[i] = result.tokens

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(STREAMS):
            tg.start_soon(one, i)
    seconds = time.perf_counter() - start
    after = engine.statistics()
    steps = after.decode_steps - before.decode_steps
    step = (after.step_seconds - before.step_seconds) / steps
    outside = step - (after.decode_seconds - before.decode_seconds) / steps
    return Round(sum(map(len, chosen)) / seconds, 1000 * step, 1000 * outside, chosen)


async def server_round(url: str, prompt: str, constrained: bool) -> float:
    async def one(client: httpx.AsyncClient, i: int, out: list[int]) -> None:
        body: dict[str, Any] = {"prompt": prompt, "n_predict": TOKENS, "temperature": 0.8, "seed": 1000 + i,
                                "cache_prompt": True}
        body.update({"json_schema": SCHEMA} if constrained else {"ignore_eos": True})
        r = await client.post(url + "/completion", json=body, timeout=600)
        r.raise_for_status()
        out.append(int(r.json()["tokens_predicted"]))

    counts: list[int] = []
    start = time.perf_counter()
    async with httpx.AsyncClient() as client, anyio.create_task_group() as tg:
        for i in range(STREAMS):
            tg.start_soon(one, client, i, counts)
    return sum(counts) / (time.perf_counter() - start)


def replay(model: Path, streams: list[list[int]], threads: int) -> dict[str, float]:
    """The decode thread's constraint work per step for these streams' tokens, in milliseconds
    (with the CPUs for masks the engine would take beside ``threads`` decode threads)."""
    with Model(model, vocab_only=True) as m:
        tokenizer = VocabTokenizer(m.vocab)
        guidance = tokenizer.guidance()
        grammar = constraints.grammar_of(SamplingParams.from_kwargs(json_schema=SCHEMA))
        assert grammar is not None
        matchers = [constraints.matcher(guidance, grammar) for _ in streams]
        masks = constraints.Masks(tokenizer.n_vocab, available_cpus() - threads)
        rows = np.zeros((len(streams), tokenizer.n_vocab), dtype=np.float32)
        fill, apply, advance = [], [], []
        for step in range(min(map(len, streams))):
            t0 = time.perf_counter()
            bits = masks.fill(matchers)
            t1 = time.perf_counter()
            for row, b in zip(rows, bits):
                masks.apply(row, b)
            t2 = time.perf_counter()
            for matcher, tokens in zip(matchers, streams):
                matcher.consume_token(tokens[step])
                matcher.is_stopped()
            t3 = time.perf_counter()
            fill.append(t1 - t0)
            apply.append(t2 - t1)
            advance.append(t3 - t2)
            rows[:] = 0
    ms = 1000.0
    return {"steps": len(fill), "fill_ms": ms * statistics.median(fill), "apply_ms": ms * statistics.median(apply),
            "advance_ms": ms * statistics.median(advance),
            "total_ms": ms * statistics.median(a + b + c for a, b, c in zip(fill, apply, advance))}


def markdown(r: dict[str, Any]) -> str:
    a, s, w = r["aiollama"], r["llama_server"], r["replay"]
    added = a["constrained_outside_ms"] - a["free_outside_ms"]
    return "\n".join([
        f"Measured {r['date']} on {r['machine']['cpu']} ({r['machine']['cpus']} CPUs), llama.cpp {tools.TAG}, "
        f"{r['model']}, {r['threads']} threads for both; {STREAMS} chat streams of {TOKENS} tokens, free and "
        f"constrained to a JSON schema, medians of {r['rounds']} alternated rounds.", "",
        "**The constraint's cost per decode step, inside the engine** (the engine's own step timers: the "
        "part of a step outside llama_decode, where masks are filled and applied):", "",
        "| | step (ms) | outside llama_decode (ms) |", "|---|---:|---:|",
        f"| free | {a['free_step_ms']:.1f} | {a['free_outside_ms']:.2f} |",
        f"| JSON schema | {a['constrained_step_ms']:.1f} | {a['constrained_outside_ms']:.2f} |", "",
        f"The constraint adds **{added:.2f} ms to a step of {STREAMS} rows: {100 * added / a['free_step_ms']:.1f}% "
        "of a free step**.", "",
        f"Replayed on the tokens the constrained streams chose (median of {w['steps']} steps): filling the "
        f"{STREAMS} masks {w['fill_ms']:.2f} ms, applying them {w['apply_ms']:.2f} ms, advancing the matchers "
        f"{w['advance_ms']:.2f} ms; {w['total_ms']:.2f} ms in all.", "",
        "**End to end** (generated tokens per second; on a shared machine these drift by 20% between rounds, "
        "so the per-step figures above are the measure):", "",
        "| | free | JSON schema | constrained / free |", "|---|---:|---:|---:|",
        f"| aiollama | {a['free_tps']:.1f} | {a['constrained_tps']:.1f} | {a['constrained_tps'] / a['free_tps']:.3f} |",
        f"| llama-server (GBNF from the schema) | {s['free_tps']:.1f} | {s['constrained_tps']:.1f} | "
        f"{s['constrained_tps'] / s['free_tps']:.3f} |", ""])


async def main(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else aiollama.default_model()
    threads = args.threads or math_cpus()
    bins = tools.build(quiet=True)
    r: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(), "model": model.name,
                         "threads": threads, "llama_cpp": tools.TAG, "rounds": args.rounds, "schema": SCHEMA}
    async with aiollama.Engine(model, n_ctx=4096, n_seq_max=STREAMS, n_threads=threads) as engine:
        prompt = engine.render_chat(QUESTION)
        await aiollama_round(engine, False)  # warm up
        await aiollama_round(engine, True)
        free: list[Round] = []
        constrained: list[Round] = []
        for _ in range(args.rounds):
            free.append(await aiollama_round(engine, False))
            constrained.append(await aiollama_round(engine, True))
    chosen = constrained[-1].tokens

    def med(rounds: list[Round], key: str) -> float:
        return statistics.median(getattr(x, key) for x in rounds)
    r["aiollama"] = {"free_tps": med(free, "tps"), "constrained_tps": med(constrained, "tps"),
                     "free_all": [x.tps for x in free], "constrained_all": [x.tps for x in constrained],
                     "pair_ratios": [c.tps / f.tps for f, c in zip(free, constrained)],
                     "free_step_ms": med(free, "step_ms"), "constrained_step_ms": med(constrained, "step_ms"),
                     "free_outside_ms": med(free, "outside_ms"), "constrained_outside_ms": med(constrained, "outside_ms"),
                     "constrained_tokens": sum(map(len, chosen))}
    print("aiollama", r["aiollama"], flush=True)
    with LlamaServer(bins["llama-server"], model, n_parallel=STREAMS, n_ctx=4096, threads=threads) as server:
        await server_round(server.url, prompt, False)
        free, constrained = [], []
        for _ in range(args.rounds):
            free.append(await server_round(server.url, prompt, False))
            constrained.append(await server_round(server.url, prompt, True))
    r["llama_server"] = {"free_tps": statistics.median(free), "constrained_tps": statistics.median(constrained),
                         "free_all": free, "constrained_all": constrained}
    print("llama-server", r["llama_server"], flush=True)
    r["replay"] = replay(model, chosen, threads)
    save_results(r, "constraints", markdown(r))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF model (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--threads", type=int, help="threads for both (default: one per physical core)")
    parser.add_argument("--rounds", type=int, default=5)
    sys.exit(anyio.run(main, parser.parse_args()))
