"""The blocking API, for code on plain threads: an :class:`~aiollama.api.engine.Engine` on an event
loop of its own (anyio's blocking portal, one thread), and proxies whose every call runs there.

Nothing is written twice: a blocking conversation is an async one driven through the portal, so
``WrongEventLoop``, shielded cleanup, cancellation and liveness hold by construction. Any number of
threads share one engine; their conversations land in the same batches as everyone's. Each call
crosses to the portal's thread and back (a chunk read costs one such hop), and the thread waits
while the engine works, which is what it asked for; the decode thread does not wait for it (but
for a lone generation's first token, at most 2 ms: see :func:`aiollama.core.outbox.hand_over`).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import anyio.from_thread
from anyio.from_thread import BlockingPortal

from aiollama.api.conversation import Conversation
from aiollama.api.engine import Engine, ExecutorFactory
from aiollama.api.stream import Chunk, Completion, Stream
from aiollama.config import EngineConfig
from aiollama.core.outputs import (
    FinishReason,
    GenerationStats,
    Statistics,
    TokenLogprob,
)
from aiollama.errors import EngineClosed, EngineDead
from aiollama.formats.messages import Messages


class SyncStream:
    """A blocking stream of :class:`Chunk`: iterate it, or ``result()`` for the whole completion.
    Leaving it early and ``close()`` cancel the generation."""

    def __init__(self, portal: BlockingPortal, stream: Stream) -> None:
        self._portal = portal
        self._stream = stream
        self._ready: deque[Chunk] = deque()  # chunks fetched in the last hop, not yet read

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        if not self._ready:
            try:
                self._ready.extend(self._portal.call(self._stream.next_chunks))
            except StopAsyncIteration:
                raise StopIteration from None
        return self._ready.popleft()

    def result(self) -> Completion:
        """Read the stream to its end and return the completion (what awaiting a Stream gives)."""
        return self._portal.call(_collect, self._stream)

    def cancel(self) -> None:
        """End the generation within a decode step; never blocks for long."""
        self._portal.call(self._stream.cancel)

    def close(self) -> None:
        """Cancel and wait until the engine has ended the generation."""
        self._portal.call(self._stream.aclose)

    @property
    def running(self) -> bool:
        return self._stream.running

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._stream.finish_reason

    @property
    def stats(self) -> GenerationStats | None:
        return self._stream.stats

    @property
    def stop_sequence(self) -> str | None:
        return self._stream.stop_sequence

    @property
    def prompt_logprobs(self) -> list[TokenLogprob]:
        return self._stream.prompt_logprobs

    @property
    def in_thinking(self) -> bool:
        return self._stream.in_thinking

    def __enter__(self) -> SyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _collect(stream: Stream) -> Completion:
    return await stream


class SyncConversation:
    """A conversation for code on plain threads (see :class:`~aiollama.api.conversation.Conversation`,
    whose methods these are, blocking). Create it with ``SyncEngine.conversation()``."""

    def __init__(self, portal: BlockingPortal, conv: Conversation) -> None:
        self._portal = portal
        self._conv = conv

    @property
    def id(self) -> int:
        return self._conv.id

    @property
    def closed(self) -> bool:
        return self._conv.closed

    @property
    def tokens(self) -> tuple[int, ...]:
        return self._portal.call(lambda: self._conv.tokens)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self._portal.call(lambda: self._conv.messages)

    def __len__(self) -> int:
        return self._portal.call(len, self._conv)

    def __bool__(self) -> bool:
        return True

    def prompt(self, content: str | Sequence[int], *, special: bool = False) -> None:
        self._portal.call(functools.partial(self._conv.prompt, content, special=special))

    def append_chat(self, messages: Messages, **options: Any) -> int:
        """Append a chat turn without generating; see ``Conversation.append_chat``."""
        return self._portal.call(functools.partial(self._conv.append_chat, messages, **options))

    def fork(self) -> SyncConversation:
        return SyncConversation(self._portal, self._portal.call(self._conv.fork))

    def rewind(self, n: int) -> None:
        self._portal.call(self._conv.rewind, n)

    def stream(self, **params: Any) -> SyncStream:
        """Start generating; see ``Conversation.stream`` (``guidance`` takes a SyncConversation)."""
        if isinstance(params.get("guidance"), SyncConversation):
            params["guidance"] = params["guidance"]._conv
        return SyncStream(self._portal, self._start(functools.partial(self._conv.stream, **params)))

    def chat(self, messages: Messages, **params: Any) -> SyncStream:
        """Append a chat turn and stream the reply; see ``Conversation.chat`` (its options and
        ``stream()``'s parameters)."""
        return SyncStream(self._portal, self._start(functools.partial(self._conv.chat, messages, **params)))

    def _start(self, start: Callable[[], Stream]) -> Stream:
        # a Stream is awaitable: returned in a box, so that the portal hands it over instead of awaiting it
        return self._portal.call(lambda: [start()])[0]

    def save(self, path: str | os.PathLike[str]) -> None:
        self._portal.call(self._conv.save, path)

    def close(self) -> None:
        """End any generation and free the conversation. Idempotent."""
        self._portal.call(self._conv.aclose)

    def close_nowait(self) -> None:
        self._conv.close_nowait()

    def __enter__(self) -> SyncConversation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncEngine:
    """The blocking engine: ``with SyncEngine(path, **options) as engine: ...``. Options are those of
    :class:`~aiollama.api.engine.Engine`; a bad one raises ``InvalidRequestError`` at once."""

    def __init__(self, model_path: str | os.PathLike[str] | None = None, *,
                 executor: ExecutorFactory | None = None, **options: Any) -> None:
        self._engine = Engine(model_path, executor=executor, **options)
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = None
        self._portal_: BlockingPortal | None = None

    def start(self) -> None:
        """Start the event loop thread and the engine on it (loading the model)."""
        if self._portal_cm is not None:
            raise RuntimeError("the engine was already started")
        cm = anyio.from_thread.start_blocking_portal()
        portal = cm.__enter__()
        try:
            portal.call(self._engine.start)
        except BaseException as exc:
            cm.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._portal_cm, self._portal_ = cm, portal

    def close(self) -> None:
        """Stop the engine and its loop; raises ``EngineDead`` if the decode thread had failed."""
        cm, self._portal_cm = self._portal_cm, None
        if cm is None:
            return
        try:
            assert self._portal_ is not None
            self._portal_.call(self._engine.aclose)
        finally:
            cm.__exit__(None, None, None)

    def __enter__(self) -> SyncEngine:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.close()
        except EngineDead:
            if exc is None:
                raise

    def __del__(self) -> None:
        if getattr(self, "_portal_cm", None) is not None:
            warnings.warn("unclosed aiollama SyncEngine: use 'with', or close it", ResourceWarning,
                          source=self, stacklevel=2)

    @property
    def _portal(self) -> BlockingPortal:
        if self._portal_ is None or self._portal_cm is None:
            raise EngineClosed("the engine is not started: use 'with', or start it")
        return self._portal_

    def conversation(self, prompt: str | Sequence[int] | None = None, *, cache_salt: str | None = None,
                     lora: Mapping[str, float] | None = None) -> SyncConversation:
        return SyncConversation(self._portal, self._portal.call(
            functools.partial(self._engine.conversation, prompt, cache_salt=cache_salt, lora=lora)))

    def load(self, path: str | os.PathLike[str]) -> SyncConversation:
        """A saved conversation; see ``Engine.load``."""
        return SyncConversation(self._portal, self._portal.call(self._engine.load, path))

    def embed(self, texts: str | Sequence[str] | Sequence[Sequence[int]], *,
              normalize: bool = True) -> list[Any]:
        """Embeddings; see ``Engine.embed``."""
        return self._portal.call(functools.partial(self._engine.embed, texts, normalize=normalize))

    def encode_images(self, images: Sequence[Any]) -> None:
        """Encode pictures ahead of the prompts that send them; see ``Engine.encode_images``."""
        self._portal.call(functools.partial(self._engine.encode_images, images))

    def clear_cache(self) -> None:
        """Drop the prefix cache; see ``Engine.clear_cache``."""
        self._portal.call(self._engine.clear_cache)

    def generate_parallel(self, prompts: Sequence[str | Sequence[int]], **params: Any) -> list[Completion]:
        """One completion per prompt, in order, generated in the same batches; see ``Engine``."""
        return self._portal.call(functools.partial(self._engine.generate_parallel, prompts, **params))

    # reads that need no hop: the engine's own thread-safe ones

    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    @property
    def model_path(self) -> os.PathLike[str] | None:
        return self._engine.model_path

    @property
    def serving(self) -> bool:
        return self._portal_cm is not None and self._engine.serving

    @property
    def n_ctx(self) -> int:
        return self._engine.n_ctx

    @property
    def n_vocab(self) -> int:
        return self._engine.n_vocab

    def statistics(self) -> Statistics:
        return self._engine.statistics()

    def tokenize(self, text: str, *, add_special: bool = False, special: bool = False) -> list[int]:
        return self._engine.tokenize(text, add_special=add_special, special=special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        return self._engine.detokenize(tokens, special=special)

    def token_bytes(self, token: int) -> bytes:
        return self._engine.token_bytes(token)

    def render_chat(self, messages: Messages, *, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        return self._engine.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)
