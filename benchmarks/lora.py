"""What LoRA adapters cost: the same load with no adapter, one adapter for everyone, and half the
streams on an adapter beside half on the base model (the two sets take turns, a step each, since
llama.cpp applies adapters to a whole context).

    pip install ".[bench]" && python benchmarks/lora.py               # about two minutes

The adapter is random (rank 16 on every attention and feed-forward weight of SmolLM2), written with
``gguf`` in llama.cpp's layout. Results go to
benchmarks/results/<date>-<machine>-<cpus>cpu-lora.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from common import machine, prompts, save_results
from gguf import GGUFReader, GGUFWriter

import aiollama
from aiollama.native import math_cpus

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_adapter(path: Path, base: Path, rank: int = 16) -> None:
    reader = GGUFReader(str(base))
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    for t in reader.tensors:
        if t.name.startswith("blk.") and t.name.split(".")[2] in TARGETS:
            n_in, n_out = (int(x) for x in t.shape[:2])
            writer.add_tensor(t.name + ".lora_a", (rng.standard_normal((rank, n_in)) * 0.01).astype(np.float32))
            writer.add_tensor(t.name + ".lora_b", (rng.standard_normal((n_out, rank)) * 0.01).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


async def run(engine: aiollama.Engine, loads: list[dict[str, float] | None], new: int, n_vocab: int,
              seed: int) -> float:
    texts = prompts(len(loads), 64, n_vocab, seed=seed)
    done = 0

    async def one(prompt: list[int], lora: dict[str, float] | None) -> None:
        nonlocal done
        conv = engine.conversation(prompt, lora=lora)
        result = await conv.stream(max_tokens=new, ignore_eos=True, temperature=0.7, seed=seed)
        done += len(result.tokens)
        await conv.aclose()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for prompt, lora in zip(texts, loads):
            tg.start_soon(one, prompt, lora)
    return done / (time.perf_counter() - start)


async def main(args: argparse.Namespace) -> int:
    model = aiollama.pull()
    threads = args.threads or math_cpus()
    with tempfile.TemporaryDirectory() as tmp:
        adapter = Path(tmp) / "adapter.gguf"
        write_adapter(adapter, model)
        async with aiollama.Engine(model, n_ctx=8192, n_seq_max=args.streams, n_threads=threads,
                                   lora={"a": adapter}) as engine:
            n_vocab = engine.n_vocab
            half = [None if i % 2 else {"a": 1.0} for i in range(args.streams)]
            cases: dict[str, list[dict[str, float] | None]] = {
                "no adapter": [None] * args.streams, "all on the adapter": [{"a": 1.0}] * args.streams,
                "half and half (two sets, taking turns)": half}
            r: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(), "threads": threads,
                                 "streams": args.streams, "tokens": args.tokens, "results": {}}
            await run(engine, [None] * 2, 8, n_vocab, 99)  # warm up
            for round_ in range(args.rounds):
                for name, loads in cases.items():
                    tps = await run(engine, loads, args.tokens, n_vocab, 1000 * round_ + len(name))
                    r["results"].setdefault(name, []).append(tps)
                    print(f"  {name}: {tps:.0f} tokens/s", flush=True)
    lines = [f"Measured {r['date']} on {r['machine']['cpu']} ({r['machine']['cpus']} CPUs), {threads} threads; "
             f"SmolLM2, {args.streams} streams x {args.tokens} tokens, a rank-16 adapter on every weight", "",
             "| load | tokens/s per round | vs no adapter |", "|---|---|---:|"]
    base = float(np.mean(r["results"]["no adapter"]))
    for name, values in r["results"].items():
        lines.append(f"| {name} | {' / '.join(f'{v:.0f}' for v in values)} | {np.mean(values) / base:.2f} |")
    save_results(r, "lora", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    sys.exit(anyio.run(main, parser.parse_args()))
