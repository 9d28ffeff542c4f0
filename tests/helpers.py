"""Helpers shared by the tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from aiollama import Completion, Engine, Statistics, Stream
from aiollama.config import EngineConfig
from aiollama.native import Batch, Context, DecodeStatus, Model, SamplerChain
from aiollama.runner.executor import NativeExecutor

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


class Gate:
    """An executor factory for llama.cpp whose steps can be held: commands sent while the decode
    thread waits inside a step all reach it before the next one, so that two runs batch alike. (A
    row's logits depend on the batch around it: llama.cpp's CPU attention takes another path for 64
    rows and more. Streams admitted across a few steps, as timing decides, do not sample alike.)"""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._waiting = threading.Event()

    def __call__(self, config: EngineConfig) -> Any:
        assert config.model_path is not None
        return _Held(NativeExecutor(config, config.model_path), self)

    def _pass(self) -> None:
        if not self._open.is_set():
            self._waiting.set()
            self._open.wait()

    async def together(self, engine: Engine, start: Callable[[], list[Stream]]) -> list[Completion]:
        """The completions of the streams ``start`` opens, all admitted in the same step: a
        one-token stream is held in its step while they are sent."""
        self._open.clear()
        self._waiting.clear()
        try:
            held = engine.conversation("hold").stream(max_tokens=1, temperature=0.0, ignore_eos=True)
            with anyio.fail_after(20):
                while not self._waiting.is_set():
                    await anyio.sleep(0.002)
            streams = start()
        finally:
            self._open.set()
        return (await gather(held, *streams))[1:]


class _Held:
    def __init__(self, inner: NativeExecutor, gate: Gate) -> None:
        self._inner, self._gate = inner, gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def execute(self, plan: Any, on_decode: Any = None) -> Any:
        self._gate._pass()
        return self._inner.execute(plan, on_decode)


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
