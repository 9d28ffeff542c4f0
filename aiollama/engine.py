"""The engine: one model, one context, one decode thread, any number of conversations.

``Engine`` serves async code (asyncio or trio, through anyio); ``SyncEngine`` serves plain threads.
Both put their conversations into the same batches: neither takes a lock around decoding, and no
caller gets a context of its own.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio

from aiollama.chat import ChatTemplate, Segment
from aiollama.commands import NewConversation, Portal
from aiollama.conversation import Completion, Conversation, SyncConversation
from aiollama.decode_loop import DecodeLoop, EngineConfig, Statistics
from aiollama.errors import (
    ChatTemplateError,
    ClosedError,
    EngineClosed,
    EngineDead,
    InvalidRequestError,
    WrongEventLoop,
)
from aiollama.models import default_model
from aiollama.native import Vocab
from aiollama.native.batch import MAX_SEQ
from aiollama.portal import current_portal


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequestError(f"{name} must be an int {bound}, got {value!r}")
    return value


class EngineCore:
    """What an engine's conversations share: the decode loop, ids, and the tokenizer."""

    def __init__(self, config: EngineConfig) -> None:
        self.loop = DecodeLoop(config)
        self._ids = itertools.count(1)
        self.closed = False
        self.vocab: Vocab | None = None
        self.owner: Any = None  # the event loop (or trio token) of an async engine
        self._chat_template: ChatTemplate | None = None

    def check_loop(self) -> Portal:
        """The caller's portal; WrongEventLoop if an async engine is used outside its own loop."""
        portal = current_portal()
        if self.owner is not None and portal.owner is not self.owner:
            raise WrongEventLoop("this engine belongs to the event loop that started it; start one "
                                 "engine per event loop, or use SyncEngine from threads")
        return portal

    @property
    def n_ctx(self) -> int:
        return self.loop.scheduler.n_ctx

    def start(self) -> None:
        """Load the model and start the decode thread; blocks until the model is loaded."""
        self.loop.start()
        self.loop.wait_ready()
        assert self.loop.model is not None
        self.vocab = self.loop.model.vocab

    def close(self) -> None:
        """Stop the decode thread (running streams end with EngineClosed); raises EngineDead if it
        had failed."""
        self.closed = True
        self.loop.shutdown()
        if self.loop.dead is not None:
            raise self.loop.dead

    @property
    def usable(self) -> bool:
        return not self.closed and self.loop.dead is None and self.loop.alive

    def check(self) -> None:
        if self.loop.dead is not None:
            raise self.loop.dead
        if self.closed or self.vocab is None:
            raise EngineClosed("the engine is closed" if self.closed else "the engine is not started")

    def send(self, command: Any) -> None:
        self.check()
        self.loop.send(command)

    def new_id(self) -> int:
        return next(self._ids)

    @contextlib.contextmanager
    def _pinned_vocab(self) -> Iterator[Vocab]:
        """The vocab, with the model pinned: the decode thread may close it meanwhile."""
        self.check()
        assert self.vocab is not None
        model = self.vocab._model
        try:
            model._acquire_native()
        except ClosedError:
            raise EngineClosed("the engine is closed") from None
        try:
            yield self.vocab
        finally:
            model._release()

    def tokenize(self, text: str, *, add_special: bool, special: bool) -> list[int]:
        with self._pinned_vocab() as vocab:
            return vocab.tokenize(text, add_special=add_special, parse_special=special)

    def encode(self, content: str | Sequence[int], *, first: bool, special: bool) -> list[int]:
        """Token ids for a prompt: text is tokenized (BOS on the first prompt), ids are checked."""
        if isinstance(content, str):
            return self.tokenize(content, add_special=first, special=special)
        if isinstance(content, (bytes, bytearray)) or not isinstance(content, Sequence):
            raise InvalidRequestError(f"a prompt is text or a sequence of token ids, got {type(content).__name__}")
        self.check()
        assert self.vocab is not None
        return [self.vocab.check_token(t) for t in content]  # type: ignore[arg-type]

    def detokenize(self, tokens: Sequence[int]) -> str:
        with self._pinned_vocab() as vocab:
            return vocab.detokenize(tokens)

    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template (built on first use)."""
        if self._chat_template is None:
            with self._pinned_vocab() as vocab:
                source = vocab._model.chat_template()
                texts = {t: vocab.token_text(t) for t in (vocab.bos, vocab.eos, vocab.eot) if t >= 0}

            def builtin(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
                with self._pinned_vocab() as v:
                    try:
                        return v.apply_chat_template(messages, template=source or "chatml",
                                                     add_assistant=add_generation_prompt)
                    except InvalidRequestError:  # a template llama.cpp does not recognize
                        return v.apply_chat_template(messages, template="chatml",
                                                     add_assistant=add_generation_prompt)

            self._chat_template = ChatTemplate(
                source, bos_token=texts.get(vocab.bos, ""), eos_token=texts.get(vocab.eos, ""), builtin=builtin,
                eog_texts=[texts[t] for t in (vocab.eot, vocab.eos) if t in texts])
        return self._chat_template

    def chat_tokens(self, parts: list[Segment], *, first: bool) -> list[int]:
        """Tokens of rendered chat text: template text with special tokens, caller text without."""
        out: list[int] = []
        bos = self.vocab.bos if self.vocab is not None else -1
        for i, part in enumerate(parts):
            add_bos = first and i == 0 and part.template
            tokens = self.tokenize(part.text, add_special=add_bos, special=part.template)
            if add_bos and len(tokens) > 1 and tokens[0] == tokens[1] == bos:
                tokens = tokens[1:]  # the template wrote BOS itself
            out += tokens
        return out

    def check_role(self, role: str) -> None:
        if self.tokenize(role, add_special=False, special=True) != self.tokenize(role, add_special=False,
                                                                                  special=False):
            raise ChatTemplateError(f"the role {role!r} holds special-token text")


class _EngineBase:
    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        n_ctx: int = 8192,
        n_seq_max: int = 16,
        n_batch: int = 512,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        step_tokens: int = 256,
        max_queued: int = 1024,
    ) -> None:
        _check_int("n_ctx", n_ctx, 1)
        _check_int("n_seq_max", n_seq_max, 1, MAX_SEQ)
        _check_int("n_batch", n_batch, 1)
        if n_threads is not None:
            _check_int("n_threads", n_threads, 1)
        _check_int("n_gpu_layers", n_gpu_layers, -1)
        _check_int("step_tokens", step_tokens, 1)
        _check_int("max_queued", max_queued, 0)
        self._model_path = None if model_path is None else Path(model_path)
        self._params = dict(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch, n_threads=n_threads,
                            n_gpu_layers=n_gpu_layers, step_tokens=step_tokens, max_queued=max_queued)
        self._core: EngineCore | None = None

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None and not core.closed:
            warnings.warn("unclosed aiollama engine: use 'async with' / 'with', or close it",
                          ResourceWarning, source=self, stacklevel=2)
            core.closed = True
            core.loop.shutdown(timeout=0)  # asks the decode thread to stop; does not wait

    def _start(self, owner: Any = None) -> None:
        if self._core is not None:
            raise RuntimeError("the engine was already started")
        path = self._model_path if self._model_path is not None else default_model()
        core = EngineCore(EngineConfig(model_path=path, **self._params))  # type: ignore[arg-type]
        core.owner = owner
        try:
            core.start()
        except BaseException:
            core.close()  # the decode thread has already ended; nothing stays open
            raise
        self._core = core

    @property
    def model_path(self) -> Path:
        """The GGUF file the engine serves (the default model's path once started without one)."""
        if self._core is not None:
            return self._core.loop.config.model_path
        return self._model_path if self._model_path is not None else Path("default")

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise EngineClosed("the engine is not started: use 'async with' / 'with', or start it")
        return self._core

    def tokenize(self, text: str, *, add_special: bool = False, special: bool = False) -> list[int]:
        """Token ids for ``text``; thread-safe, does not wait for the decode thread."""
        return self.core.tokenize(text, add_special=add_special, special=special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.core.detokenize(tokens)

    def statistics(self) -> Statistics:
        """The engine's counters after the latest decode step (conversations, KV cells, tokens, time)."""
        return self.core.loop.statistics

    @property
    def n_ctx(self) -> int:
        return self.core.n_ctx

    def _new(self, cls: type[Any], prompt: str | Sequence[int] | None) -> Any:
        core = self.core
        core.check()
        if core.owner is not None:
            core.check_loop()
        conv = cls(core, core.new_id(), fresh=True)
        core.send(NewConversation(conv.id))
        if prompt is not None:
            conv.prompt(prompt)
        return conv


class Engine(_EngineBase):
    """Serves many concurrent conversations from one llama.cpp context, for asyncio and trio.

    ``async with Engine(path, ...) as engine`` loads the model (``path`` None means the default
    model, fetched on first use) and starts the decode thread; leaving the block ends running
    generations (their streams raise ``EngineClosed``) and frees everything, and raises
    ``EngineDead`` if the decode thread had failed. The engine belongs to the event loop that
    started it (elsewhere: ``WrongEventLoop``). ``step_tokens`` is the per-step token budget: decode
    rows of running streams go first, prompt chunks share the rest, so a long prompt never stalls
    streams. ``max_queued`` bounds the generations waiting for a seq id; beyond it ``stream()``
    raises ``Overloaded``.
    """

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            await self.aclose()
        except EngineDead:
            if exc is None:
                raise  # otherwise the body's own exception (often this EngineDead) goes on

    async def start(self) -> None:
        """Load the model and start the decode thread (in a worker thread: the loop keeps running).

        The engine then belongs to this event loop; anywhere else it raises ``WrongEventLoop``.
        """
        owner = current_portal().owner
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._start, owner)

    async def aclose(self) -> None:
        """Cancel running generations, stop the decode thread and free all native memory.

        Raises ``EngineDead`` if the decode thread had failed (every stream got it too).
        """
        core = self._core
        if core is None:
            return
        if not core.closed:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(core.close)
        elif core.loop.dead is not None:
            raise core.loop.dead

    def conversation(self, prompt: str | Sequence[int] | None = None) -> Conversation:
        """A new, empty conversation (or one holding ``prompt``). Cheap: it takes no seq id yet."""
        conv: Conversation = self._new(Conversation, prompt)
        return conv

    async def generate_parallel(self, prompts: Sequence[str | Sequence[int]], **params: Any) -> list[Completion]:
        """One completion per prompt, in order, generated in the same batches. With a ``seed``,
        prompt ``i`` is sampled with ``seed + i``."""
        convs = [self.conversation(p) for p in prompts]
        results: list[Completion | None] = [None] * len(convs)
        try:
            streams = [c.stream(**_seeded(params, i)) for i, c in enumerate(convs)]

            async def collect(i: int) -> None:
                results[i] = await streams[i]

            async with anyio.create_task_group() as tg:
                for i in range(len(streams)):
                    tg.start_soon(collect, i)
        finally:
            for conv in convs:
                await conv.aclose()
        return [r for r in results if r is not None]


class SyncEngine(_EngineBase):
    """The blocking facade: many OS threads share one engine, and their conversations land in the
    same batches as everyone else's. ``with SyncEngine(path) as engine: ...``"""

    def __enter__(self) -> SyncEngine:
        self._start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.close()
        except EngineDead:
            if exc is None:
                raise

    def start(self) -> None:
        self._start()

    def close(self) -> None:
        """Stop the decode thread and free everything; raises ``EngineDead`` if it had failed."""
        core = self._core
        if core is None:
            return
        if not core.closed:
            core.close()
        elif core.loop.dead is not None:
            raise core.loop.dead

    def conversation(self, prompt: str | Sequence[int] | None = None) -> SyncConversation:
        conv: SyncConversation = self._new(SyncConversation, prompt)
        return conv

    def generate_parallel(self, prompts: Sequence[str | Sequence[int]], **params: Any) -> list[Completion]:
        convs = [self.conversation(p) for p in prompts]
        try:
            streams = [c.stream(**_seeded(params, i)) for i, c in enumerate(convs)]
            return [s.result() for s in streams]
        finally:
            for conv in convs:
                conv.close()


def _seeded(params: dict[str, Any], i: int) -> dict[str, Any]:
    if params.get("seed") is None:
        return params
    return {**params, "seed": (params["seed"] + i) % (2**32 - 1)}
