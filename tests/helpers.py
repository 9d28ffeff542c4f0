"""Helpers shared by the tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from aiollama import Completion, Engine, Statistics, Stream
from aiollama.native import Batch, Context, DecodeStatus, Model, SamplerChain

GREEDY: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)


def decode_threads() -> list[str]:
    """The names of the decode threads alive now."""
    return [t.name for t in threading.enumerate() if t.name == "aiollama-decode"]


async def wait_for(engine: Engine, pred: Callable[[Statistics], bool], timeout: float = 20.0) -> Statistics:
    """Wait until the engine's published statistics satisfy ``pred``."""
    with anyio.fail_after(timeout):
        while True:
            stats = engine.statistics()
            if pred(stats):
                return stats
            await anyio.sleep(0.005)


async def solo(model_path: Path, prompt: str, **params: Any) -> Completion:
    """One generation on an engine of its own: the reference a batched one must match."""
    async with Engine(model_path, n_ctx=1024, n_seq_max=2, n_batch=256) as e, e.conversation(prompt) as conv:
        return await conv.stream(**params)


async def gather(*streams: Stream) -> list[Completion]:
    """Await every stream concurrently; completions in order."""
    results: list[Completion | None] = [None] * len(streams)

    async def one(i: int) -> None:
        results[i] = await streams[i]

    async with anyio.create_task_group() as tg:
        for i in range(len(streams)):
            tg.start_soon(one, i)
    return [r for r in results if r is not None]


def first_greedy_tokens(model: Model, prompts: list[list[int]], *, together: bool) -> list[int]:
    """Each prompt's first greedy token: all in one llama_decode, or one decode per prompt."""
    with Context(model, n_ctx=512, n_batch=128, n_seq_max=len(prompts)) as ctx, Batch(128) as b, \
            SamplerChain(model.vocab) as greedy:
        greedy.add_greedy()
        if together:
            rows = [b.add_tokens(p, 0, s, output_last=True) for s, p in enumerate(prompts)]
            assert ctx.decode(b) is DecodeStatus.OK
            return [greedy.sample(ctx, r) for r in rows]
        out = []
        for s, p in enumerate(prompts):
            b.clear()
            row = b.add_tokens(p, 0, s, output_last=True)
            assert ctx.decode(b) is DecodeStatus.OK
            out.append(greedy.sample(ctx, row))
        return out


def scripted(engine: Engine, text: str, start: int) -> Callable[[tuple[int, ...], Any], None]:
    """A logits processor that makes a random model write ``text`` (special tokens parsed) from
    history length ``start`` on, then end its turn: each step lifts the next token far above the
    others. A constraint still has the last word: it runs after the processors."""
    tokens = engine.tokenize(text, special=True) + engine.tokenize("<|im_end|>", special=True)

    def lift(history: tuple[int, ...], logits: Any) -> None:
        at = len(history) - start
        if 0 <= at < len(tokens):
            logits[tokens[at]] += 100.0
    return lift
