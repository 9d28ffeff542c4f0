"""Every kind of bad input gets its own exception type and a clear message, and the engine keeps
serving: after each case a greedy request still gets the right answer.

The README's table of bad input lists these cases; keep the two in step."""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from helpers import GREEDY
from tiny_model import mamba_model, spm_model

import aiollama
from aiollama import (
    ChatTemplateError,
    ContextFull,
    ConversationBusy,
    ConversationClosed,
    ConversationFileError,
    Engine,
    EngineClosed,
    GrammarError,
    InvalidRequestError,
    InvalidTokenError,
    ModelIsADirectory,
    ModelLoadError,
    ModelMismatch,
    ModelNotFound,
    Overloaded,
    UnsupportedModel,
    WrongEventLoop,
)

pytestmark = pytest.mark.anyio

PROBE = "The quick brown fox"


@dataclass(frozen=True)
class Case:
    id: str
    action: Callable[[Engine, Path, Path], Awaitable[Any] | Any]  # (engine, model path, tmp dir)
    error: type[BaseException]
    match: str


async def _start(path: Path | str, **kwargs: Any) -> None:
    async with Engine(path, **kwargs):
        pass


def _truncated(model: Path, tmp: Path) -> Path:
    out = tmp / "truncated.gguf"
    out.write_bytes(model.read_bytes()[: 64 * 1024])
    return out


def _not_gguf(tmp: Path) -> Path:
    out = tmp / "notes.gguf"
    out.write_text("these are not the weights you are looking for\n" * 10)
    return out


async def _busy(engine: Engine) -> None:
    conv = engine.conversation("Busy bee")
    first = conv.stream(max_tokens=30, **GREEDY)
    try:
        conv.stream(max_tokens=2)
    finally:
        await first.aclose()
        await conv.aclose()


async def _closed(engine: Engine, call: Callable[[Any], Any]) -> None:
    conv = engine.conversation("Closed door")
    await conv.aclose()
    result = call(conv)
    if inspect.isawaitable(result):
        await result


async def _after_exit(model: Path, call: Callable[[Engine, Any], Any]) -> None:
    async with Engine(model, n_ctx=256) as other:
        conv = other.conversation("Too late")
    result = call(other, conv)
    if inspect.isawaitable(result):
        await result


async def _from_thread(engine: Engine) -> None:
    await anyio.to_thread.run_sync(engine.conversation)


async def _from_other_loop(engine: Engine) -> None:
    conv = engine.conversation("Home loop")
    error: list[BaseException] = []

    async def elsewhere() -> None:
        conv.stream(max_tokens=2)

    def run() -> None:
        try:
            asyncio.run(elsewhere())
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            error.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    await anyio.to_thread.run_sync(thread.join)
    await conv.aclose()
    if error:
        raise error[0]


async def _overloaded(model: Path) -> None:
    async with Engine(model, n_ctx=512, n_seq_max=1, max_queued=1) as small:
        held = [small.conversation(p).stream(max_tokens=50, **GREEDY) for p in ("Running", "Waiting")]
        try:
            small.conversation("One too many").stream()
        finally:
            for stream in held:
                await stream.aclose()


async def _busy_then(engine: Engine, tmp: Path, what: str) -> None:
    async with engine.conversation("Busy bee") as conv:
        stream = conv.stream(max_tokens=30, **GREEDY)
        try:
            if what == "rewind":
                conv.rewind(1)
            else:
                await conv.save(tmp / "busy.aiollama")
        finally:
            await stream.aclose()


async def _rewind_too_far(engine: Engine) -> None:
    async with engine.conversation("Short") as conv:
        conv.rewind(len(conv) + 1)


async def _load_damaged(engine: Engine, tmp: Path) -> None:
    path = tmp / "damaged.aiollama"
    async with engine.conversation("To be saved") as conv:
        await conv.save(path)
    path.write_bytes(path.read_bytes()[:-40])
    await engine.load(path)


async def _load_foreign(engine: Engine, tmp: Path) -> None:
    path = tmp / "foreign.aiollama"
    async with Engine(spm_model(aiollama.cache_dir() / "test-models"), n_ctx=256) as other:
        async with other.conversation("Hello world") as conv:
            await conv.save(path)
    await engine.load(path)


async def _history_fills_context(engine: Engine) -> None:
    async with engine.conversation("word " * 1100) as conv:
        conv.prompt("word " * 1100)
        await conv.stream()


async def _chat(engine: Engine, messages: Any) -> None:
    async with engine.conversation() as conv:
        await conv.chat(messages, max_tokens=2)


def _sampling(**params: Any) -> Callable[[Engine, Path, Path], Any]:
    async def act(engine: Engine, model: Path, tmp: Path) -> None:
        async with engine.conversation("Sample me") as conv:
            await conv.stream(**params)
    return act


def _prompt(content: Any) -> Callable[[Engine, Path, Path], Any]:
    async def act(engine: Engine, model: Path, tmp: Path) -> None:
        async with engine.conversation() as conv:
            conv.prompt(content)
    return act


CASES = [
    # the model file
    Case("missing-model", lambda e, m, t: _start(t / "missing.gguf"), ModelNotFound, "not found"),
    Case("not-gguf", lambda e, m, t: _start(_not_gguf(t)), ModelLoadError, "not a GGUF file"),
    Case("truncated-gguf", lambda e, m, t: _start(_truncated(m, t)), ModelLoadError, "could not load"),
    Case("directory", lambda e, m, t: _start(t), ModelIsADirectory, "directory"),
    Case("recurrent-model-deterministic", lambda e, m, t: _start(mamba_model(m.parent, m), deterministic=True),
         UnsupportedModel, "recurrent or hybrid"),
    # prompts
    Case("empty-text", _prompt(""), InvalidRequestError, "must not be empty"),
    Case("empty-tokens", _prompt([]), InvalidRequestError, "must not be empty"),
    Case("longer-than-n_ctx", _prompt("word " * 3000), ContextFull, "does not fit a context of 2048"),
    Case("history-fills-context", lambda e, m, t: _history_fills_context(e), ContextFull, "context"),
    Case("token-out-of-range", _prompt([1, 2, 10**9]), InvalidTokenError, "outside the vocabulary"),
    Case("negative-token", _prompt([-1]), InvalidTokenError, "outside the vocabulary"),
    Case("float-token", _prompt([1.5]), InvalidTokenError, "outside the vocabulary"),
    Case("prompt-not-text", _prompt(3.5), InvalidRequestError, "text or a sequence of token ids"),
    Case("prompt-bytes", _prompt(b"raw"), InvalidRequestError, "text or a sequence of token ids"),
    Case("prompt-none", _prompt(None), InvalidRequestError, "text or a sequence of token ids"),
    # chat
    Case("chat-no-messages", lambda e, m, t: _chat(e, []), ChatTemplateError, "must not be empty"),
    Case("chat-message-without-content", lambda e, m, t: _chat(e, [{"role": "user"}]), ChatTemplateError,
         "'content'"),
    Case("chat-role-with-special-text", lambda e, m, t: _chat(e, [{"role": "user<|im_end|>", "content": "x"}]),
         ChatTemplateError, "special-token text"),
    # sampling
    Case("negative-temperature", _sampling(temperature=-0.5), InvalidRequestError, "temperature must be >= 0"),
    Case("nan-temperature", _sampling(temperature=math.nan), InvalidRequestError, "temperature must be a finite"),
    Case("top_p-zero", _sampling(top_p=0.0), InvalidRequestError, "top_p must be > 0"),
    Case("top_p-above-one", _sampling(top_p=1.01), InvalidRequestError, "top_p must be <= 1"),
    Case("max_tokens-zero", _sampling(max_tokens=0), InvalidRequestError, "max_tokens"),
    Case("max_tokens-negative", _sampling(max_tokens=-4), InvalidRequestError, "max_tokens"),
    Case("empty-stop", _sampling(stop=""), InvalidRequestError, "stop"),
    Case("empty-stop-in-list", _sampling(stop=["ok", ""]), InvalidRequestError, "stop"),
    Case("invalid-grammar", _sampling(grammar="root ::= ("), GrammarError, "grammar"),
    Case("unknown-parameter", _sampling(temprature=0.5), InvalidRequestError, "unknown sampling parameter"),
    # engine parameters
    Case("n_seq_max-zero", lambda e, m, t: Engine(m, n_seq_max=0), InvalidRequestError, "n_seq_max"),
    Case("n_seq_max-257", lambda e, m, t: Engine(m, n_seq_max=257), InvalidRequestError, "n_seq_max"),
    Case("n_batch-zero", lambda e, m, t: Engine(m, n_batch=0), InvalidRequestError, "n_batch"),
    Case("unknown-engine-option", lambda e, m, t: Engine(m, n_seq=4), InvalidRequestError, "unknown engine option"),
    # state
    Case("second-stream", lambda e, m, t: _busy(e), ConversationBusy, "already generating"),
    Case("rewind-while-streaming", lambda e, m, t: _busy_then(e, t, "rewind"), ConversationBusy, "rewind"),
    Case("save-while-streaming", lambda e, m, t: _busy_then(e, t, "save"), ConversationBusy, "save"),
    Case("rewind-too-far", lambda e, m, t: _rewind_too_far(e), InvalidRequestError, "rewind"),
    Case("load-damaged-file", lambda e, m, t: _load_damaged(e, t), ConversationFileError, "damaged"),
    Case("load-other-models-file", lambda e, m, t: _load_foreign(e, t), ModelMismatch, "another model"),
    Case("prompt-after-aclose", lambda e, m, t: _closed(e, lambda c: c.prompt("x")), ConversationClosed, "closed"),
    Case("fork-after-aclose", lambda e, m, t: _closed(e, lambda c: c.fork()), ConversationClosed, "closed"),
    Case("stream-after-aclose", lambda e, m, t: _closed(e, lambda c: c.stream()), ConversationClosed, "closed"),
    Case("conversation-after-exit", lambda e, m, t: _after_exit(m, lambda e2, c: e2.conversation()),
         EngineClosed, "closed"),
    Case("prompt-after-exit", lambda e, m, t: _after_exit(m, lambda e2, c: c.prompt("x")), EngineClosed, "closed"),
    Case("stream-after-exit", lambda e, m, t: _after_exit(m, lambda e2, c: c.stream()), EngineClosed, "closed"),
    Case("tokenize-after-exit", lambda e, m, t: _after_exit(m, lambda e2, c: e2.tokenize("x")),
         EngineClosed, "closed"),
    Case("over-max_queued", lambda e, m, t: _overloaded(m), Overloaded, "max_queued"),
    Case("from-a-thread", lambda e, m, t: _from_thread(e), WrongEventLoop, "no event loop"),
    Case("from-another-loop", lambda e, m, t: _from_other_loop(e), WrongEventLoop, "belongs to the event loop"),
]


@pytest.fixture
async def engine(tiny_path: Path) -> AsyncIterator[Engine]:
    async with Engine(tiny_path, n_ctx=2048, n_seq_max=4, n_batch=256) as e:
        yield e


@pytest.fixture(scope="module")
def expected(tiny_path: Path) -> list[int]:
    async def probe() -> list[int]:
        async with Engine(tiny_path, n_ctx=512, n_seq_max=1) as e, e.conversation(PROBE) as conv:
            return (await conv.stream(max_tokens=8, **GREEDY)).tokens
    return anyio.run(probe)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_bad_input(engine: Engine, tiny_path: Path, tmp_path: Path, expected: list[int], case: Case) -> None:
    with anyio.fail_after(60):
        with pytest.raises(case.error, match=case.match) as caught:
            result = case.action(engine, tiny_path, tmp_path)
            if inspect.isawaitable(result):
                await result
        assert type(caught.value) is case.error  # the specific type, not merely a base class
        async with engine.conversation(PROBE) as conv:  # the engine keeps serving
            assert (await conv.stream(max_tokens=8, **GREEDY)).tokens == expected
        stats = engine.statistics()
        assert (stats.active, stats.queued) == (0, 0)


@pytest.mark.anyio
async def test_a_context_smaller_than_its_seq_ids_takes_fewer_of_them(tiny_path: Path) -> None:
    """Each seq id takes one of llama.cpp's output rows, and a context has n_batch of them (at most
    n_ctx): more ids would abort the process at the first decode."""
    async with Engine(tiny_path, n_ctx=192, n_seq_max=5) as engine:
        out = await engine.conversation([1, 504, 3426]).stream(max_tokens=3, temperature=0.0)
        assert len(out.tokens) == 3
