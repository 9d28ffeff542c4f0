"""A shared system prompt, evaluated once and forked into several continuations.

    python examples/shared_prefix_fork.py [MODEL.gguf]

Every fork shares the KV cells of the common prefix (a unified cache shares cells, it copies
nothing); the statistics show the prefix evaluated once and the cells it takes counted once.
"""

from __future__ import annotations

import sys

import anyio

import aiollama

SYSTEM = (
    "<|im_start|>system\nYou are a concise assistant. You answer in one or two sentences, "
    "plainly, without lists or markdown. You never repeat the question.<|im_end|>\n"
)
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "What is a prime number?",
    "How many legs does a spider have?",
]


async def main(model: str | None) -> None:
    async with aiollama.Engine(model, n_ctx=4096, n_seq_max=8) as engine:
        base = engine.conversation()
        base.prompt(SYSTEM, special=True)
        branches = [base.fork() for _ in QUESTIONS]
        for branch, question in zip(branches, QUESTIONS):
            branch.prompt(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", special=True)
        answers: list[str] = [""] * len(QUESTIONS)

        async def answer(i: int) -> None:
            result = await branches[i].stream(max_tokens=64, temperature=0.0)
            answers[i] = result.text

        async with anyio.create_task_group() as tg:
            for i in range(len(branches)):
                tg.start_soon(answer, i)
        for question, text in zip(QUESTIONS, answers):
            print(f"Q: {question}\nA: {text.strip()}\n")
        stats = engine.statistics()
        n_system = len(engine.tokenize(SYSTEM, special=True))
        print(f"system prompt: {n_system} tokens, {len(QUESTIONS)} forks")
        print(f"tokens evaluated: {stats.tokens_evaluated} "
              f"(each fork alone would evaluate the system prompt again: {len(QUESTIONS) * n_system} more)")
        print(f"KV cells in use: {stats.kv_cells_used} of {stats.kv_cells_total}")
        print(stats)
        for conv in [base, *branches]:
            await conv.aclose()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else None)
