"""Where a many-stream step's time goes, below the engine: N sequences decoded one token a step on
the native layer, and the tokens chosen four ways: not at all (the decode alone, as
llama-batched-bench times it), on the host from the logits (``sample_rows``: what the engine does
by default), and inside the decode graph (backend sampling) with a greedy and with a top-k,
temperature, seeded-draw chain. Milliseconds per step, and how often llama.cpp reused its graph.

    python benchmarks/gpu/sampling.py MODEL [--streams 128] [--steps 48] [--n-gpu-layers -1]
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from aiollama.native import (
    Batch,
    Context,
    DecodeStatus,
    Model,
    SamplerChain,
    sample_rows,
)
from aiollama.native.sampler_chain import attach


def chain(model: Model, greedy: bool, seed: int) -> SamplerChain:
    c = SamplerChain(model.vocab)
    if greedy:
        return c.add_greedy()
    return c.add_top_k(40).add_temp(0.7).add_dist(seed)


def run(model: Model, n: int, steps: int, how: str, threads: int) -> dict[str, Any]:
    rng = random.Random(0)
    n_vocab = model.vocab.n_tokens
    with Context(model, n_ctx=n * (64 + steps + 8) + 256, n_batch=max(512, n * 64), n_seq_max=n, kv_unified=False,
                 n_threads=threads) as ctx, Batch(max(512, n * 64)) as batch:
        chains = [chain(model, how.endswith("greedy"), i) for i in range(n)]
        try:
            if how.startswith("backend"):
                for i, c in enumerate(chains):
                    attach(ctx, i, c)
            batch.clear()
            rows = [batch.add_tokens([rng.randrange(300, n_vocab) for _ in range(64)], 0, i, output_last=True)
                    for i in range(n)]
            assert ctx.decode(batch) is DecodeStatus.OK
            reused0 = ctx.perf().n_graph_reused
            start = time.perf_counter()
            for step in range(steps):
                if how == "none":
                    tokens = [rng.randrange(300, n_vocab) for _ in range(n)]
                else:
                    tokens = sample_rows(ctx, chains, rows, threads, [c.fast_k for c in chains])
                batch.clear()
                rows = [batch.add_tokens([t], 64 + step, i, output_last=True) for i, t in enumerate(tokens)]
                assert ctx.decode(batch) is DecodeStatus.OK
            ctx.perf()  # synchronizes: the last decode is counted
            elapsed = time.perf_counter() - start
            return {"ms_per_step": 1000 * elapsed / steps, "graph_reused": ctx.perf().n_graph_reused - reused0}
        finally:
            for i in range(n):
                attach(ctx, i, None)
            for c in chains:
                c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--streams", default="8,128")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--n-gpu-layers", type=int, default=-1)
    ap.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    with Model(a.model, n_gpu_layers=a.n_gpu_layers) as model:
        for n in (int(x) for x in a.streams.split(",")):
            for how in ("none", "host", "backend greedy", "backend top-k"):
                r = run(model, n, a.steps, how, a.threads)
                print(f"{n} streams, {how}: {r['ms_per_step']:.2f} ms/step, graph reused {r['graph_reused']} of "
                      f"{a.steps}", flush=True)


if __name__ == "__main__":
    main()
