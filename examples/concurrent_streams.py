"""Six conversations streaming at once from one model, each in its own live panel.

    python examples/concurrent_streams.py            # SmolLM2-135M-Instruct, fetched on first use
    python examples/concurrent_streams.py MODEL.gguf

All six share one llama.cpp context and are decoded in the same batches; the status line shows the
batch filling up and emptying as they finish. Runs on asyncio; pass --trio to run it on trio.
"""

from __future__ import annotations

import sys
import time

import anyio

import aiollama
from aiollama.live import Board

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Name the three primary colours and say one thing about each.",
    "Give me a recipe for pancakes.",
    "Tell me a story that begins in a small village.",
]


async def main(model: str | None) -> None:
    async with aiollama.Engine(model, n_ctx=4096, n_seq_max=8) as engine:
        board = Board(engine, PROMPTS)
        started = time.perf_counter()

        async def run(i: int) -> None:
            async with engine.conversation() as conv:
                stream = conv.chat(PROMPTS[i], max_tokens=96, temperature=0.7, seed=i)
                async for chunk in stream:
                    board.add(i, chunk.text)
                board.end(i, stream.finish_reason)

        with board.live():
            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(run, i)
        elapsed = time.perf_counter() - started
        stats = engine.statistics()
        print(f"{stats.tokens_generated} tokens in {elapsed:.2f}s "
              f"({stats.tokens_generated / elapsed:.1f} tokens/s) over {stats.decode_steps} decode steps; "
              f"time outside llama_decode: {stats.python_overhead:.1%} of step time")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--trio"]
    anyio.run(main, args[0] if args else None, backend="trio" if "--trio" in sys.argv else "asyncio")
