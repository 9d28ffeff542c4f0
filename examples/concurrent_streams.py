"""Many conversations streaming at once from one model, their chunks interleaved as they arrive.

    python examples/concurrent_streams.py            # SmolLM2-135M-Instruct, fetched on first use
    python examples/concurrent_streams.py MODEL.gguf

Runs on asyncio; pass --trio to run the same code on trio.
"""

from __future__ import annotations

import sys
import time

import anyio

import aiollama

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):",
    "The three primary colours are",
    "A recipe for pancakes:\n1.",
    "Once upon a time, in a small village,",
]


async def main(model: str | None) -> None:
    async with aiollama.Engine(model, n_ctx=4096, n_seq_max=8) as engine:
        texts = [""] * len(PROMPTS)
        started = time.perf_counter()

        async def run(i: int) -> None:
            async with engine.conversation(PROMPTS[i]) as conv:
                async for chunk in conv.stream(max_tokens=48, temperature=0.7, seed=i, top_k=40):
                    texts[i] += chunk.text
                    print(f"\033[3{i % 6 + 1}m[{i}]\033[0m{chunk.text!r}", end=" ", flush=True)

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(run, i)
        elapsed = time.perf_counter() - started
        print("\n")
        for prompt, text in zip(PROMPTS, texts):
            print(f"--- {prompt!r}\n{prompt}{text}\n")
        stats = engine.statistics()
        print(f"{stats.tokens_generated} tokens in {elapsed:.2f}s "
              f"({stats.tokens_generated / elapsed:.1f} tokens/s) over {stats.decode_steps} decode steps; "
              f"time outside llama_decode: {stats.python_overhead:.1%} of step time")
        print(stats)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--trio"]
    anyio.run(main, args[0] if args else None, backend="trio" if "--trio" in sys.argv else "asyncio")
