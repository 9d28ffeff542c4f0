"""Conversations and their streams: the public face of the engine.

A conversation is the whole token history. ``prompt()`` appends to it without blocking; ``stream()``
generates a continuation of everything prompted and generated so far; ``fork()`` branches it, and the
branches share the KV cells of their common prefix. Every call only queues a command for the decode
thread; none of this code calls into llama.cpp, except the tokenizer, which is thread-safe.

A conversation knows its own history (``tokens``) as it was delivered to its caller: prompts as
they are given, generated tokens as their chunks arrive. Forking a conversation while it streams
branches it at what the stream has yielded so far. Prompting a conversation while it streams
appends after that generation ends.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import anyio

from aiollama.boundary import Cancel, Close, Delta, FinishReason, Fork, Generate, Item, Prompt
from aiollama.chat import REPLY, Messages, normalize, protect, segments
from aiollama.client import EngineClient
from aiollama.errors import (
    ChatTemplateError,
    ContextFull,
    ConversationBusy,
    ConversationClosed,
    InvalidRequestError,
    Overloaded,
)
from aiollama.portal import AsyncSink, ThreadSink
from aiollama.sampling import SamplingParams


@dataclass(frozen=True)
class Chunk:
    """Text and tokens generated in one step. ``text`` never holds a broken UTF-8 character."""

    text: str
    tokens: list[int]
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class Completion:
    """A whole generation: ``finish_reason`` is EOG, STOP, LENGTH or CANCELLED."""

    text: str
    tokens: list[int]
    finish_reason: FinishReason


class _History:
    """A conversation's tokens as its caller knows them.

    Generated tokens join as their items are delivered to the consumer's event loop (or thread),
    whether or not anyone reads the stream. Prompts given while a generation is in flight wait
    until its last item arrives, as they do on the decode thread, so the order here is the order
    there. ``unread`` counts tokens of the generation in flight that its stream has not yielded yet:
    a fork branches before them. Items arrive on the consumer's event loop, or on the decode thread
    for ``SyncEngine``: hence the lock.
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = list(tokens)
        self._waiting: list[Sequence[int]] | None = None  # None: no generation in flight
        self._unread = 0
        self._lock = threading.Lock()

    def prompt(self, tokens: Sequence[int]) -> None:
        with self._lock:
            if self._waiting is None:
                self.tokens.extend(tokens)
            else:
                self._waiting.append(tokens)

    def generating(self) -> None:
        with self._lock:
            self._waiting = []
            self._unread = 0

    def take(self, item: Item) -> None:
        """An item was delivered: its tokens join the history; the last one releases the prompts."""
        if isinstance(item, Delta):
            with self._lock:
                self.tokens.extend(item.history)
                self._unread += len(item.history)
            if item.finish_reason is not None or item.error is not None:
                self.release()

    def read(self, item: Item) -> None:
        """The stream yielded an item to its reader."""
        if isinstance(item, Delta):
            with self._lock:
                self._unread = max(0, self._unread - len(item.history))

    def release(self) -> None:
        """No generation is in flight any more: the prompts that waited join the history."""
        with self._lock:
            for tokens in self._waiting or ():
                self.tokens.extend(tokens)
            self._waiting = None
            self._unread = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self.tokens) + sum(len(tokens) for tokens in self._waiting or ())

    def snapshot(self) -> tuple[list[int], list[Sequence[int]]]:
        """The tokens known now, and the prompts still waiting for the generation to end."""
        with self._lock:
            return list(self.tokens), list(self._waiting or ())

    def branch(self) -> tuple[list[int], list[Sequence[int]]]:
        """Where a fork starts: the tokens up to what a running stream has yielded, and the prompts
        waiting for that generation."""
        with self._lock:
            return self.tokens[:len(self.tokens) - self._unread], list(self._waiting or ())


@dataclass
class _Collector:
    """Accumulates a stream's deltas; shared by the async and the blocking streams."""

    parts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def take(self, item: Item) -> Chunk | None:
        """Record a delta; return the chunk to hand out, or None when there is nothing left."""
        assert isinstance(item, Delta)
        delta = item
        if delta.error is not None:
            self.finish_reason = self.finish_reason or FinishReason.ERROR
            raise delta.error
        self.parts.append(delta.text)
        self.tokens.extend(delta.tokens)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            if not delta.text and not delta.tokens:
                return None
        return Chunk(delta.text, list(delta.tokens), delta.finish_reason)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def completion(self) -> Completion:
        return Completion("".join(self.parts), list(self.tokens), self.finish_reason or FinishReason.CANCELLED)


class _StreamBase:
    def __init__(self, conv: _ConversationBase) -> None:
        self._conv = conv
        self._result = _Collector()
        self._cancelled = False

    def cancel(self) -> None:
        """Ask the engine to end this generation; the stream then finishes with CANCELLED."""
        if not self._result.done:
            self._cancelled = True
            self._conv._cancel()

    @property
    def _running(self) -> bool:
        return not self._result.done and not self._cancelled

    def _abandon(self) -> None:
        if not self._result.done:
            self._result.finish_reason = FinishReason.CANCELLED
            self._cancelled = True
            self._conv._cancel()

    @property
    def finish_reason(self) -> FinishReason | None:
        """None while it runs; then how it ended (ERROR if it raised)."""
        return self._result.finish_reason

    def __del__(self) -> None:
        # Breaking out of a loop drops the stream: end its generation within a step. This only
        # queues a command (SimpleQueue.put is reentrant, so the collector may run it anywhere);
        # every native free happens on the decode thread.
        try:
            self._abandon()
        except Exception:  # noqa: BLE001 - the engine may already be gone
            pass


class Stream(_StreamBase):
    """An async stream of :class:`Chunk`. Iterate it with ``async for``, or await it for a
    :class:`Completion`. Leaving the loop early, cancelling the consuming task or a timeout ends the
    generation within one decode step."""

    def __init__(self, conv: Conversation, sink: AsyncSink) -> None:
        super().__init__(conv)
        self._sink = sink

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Chunk:
        while not self._result.done:
            try:
                delta = await self._sink.get()
            except BaseException:
                self._abandon()
                raise
            self._conv._history.read(delta)
            chunk = self._result.take(delta)
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    async def _collect(self) -> Completion:
        async for _ in self:
            pass
        return self._result.completion()

    def __await__(self) -> Generator[Any, None, Completion]:
        return self._collect().__await__()

    async def aclose(self) -> None:
        """Cancel the generation and wait until the engine has ended it."""
        self.cancel()
        with anyio.CancelScope(shield=True):
            async for _ in self:
                pass

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class SyncStream(_StreamBase):
    """A blocking stream of :class:`Chunk` for code on plain threads; ``result()`` collects it."""

    def __init__(self, conv: SyncConversation, sink: ThreadSink) -> None:
        super().__init__(conv)
        self._sink = sink

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        while not self._result.done:
            try:
                delta = self._sink.get()
            except BaseException:
                self._abandon()
                raise
            self._conv._history.read(delta)
            chunk = self._result.take(delta)
            if chunk is not None:
                return chunk
        raise StopIteration

    def result(self) -> Completion:
        for _ in self:
            pass
        return self._result.completion()

    def close(self) -> None:
        self.cancel()
        for _ in self:
            pass

    def __enter__(self) -> SyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_C = TypeVar("_C", bound="_ConversationBase")


class _ConversationBase:
    def __init__(self, core: EngineClient, conv_id: int, *, tokens: Sequence[int] = ()) -> None:
        self._core = core
        self.id = conv_id
        self._history = _History(tokens)
        self._closed = False
        self._last_stream: weakref.ref[_StreamBase] | None = None
        self._chat: list[dict[str, str]] | None = None  # messages so far; None before the first chat()
        self._reply: _Collector | None = None  # the latest chat() stream's reply

    def _check(self) -> None:
        self._core.check()
        if self._closed:
            raise ConversationClosed("the conversation is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def tokens(self) -> tuple[int, ...]:
        """The conversation's history as delivered to its caller: every prompt, and every token
        generated (an end-of-generation token too) once its chunk has arrived. Prompts given while a
        stream runs come last, after the tokens that stream has delivered so far."""
        known, waiting = self._history.snapshot()
        return tuple(known + [t for tokens in waiting for t in tokens])

    def __len__(self) -> int:
        return len(self._history)

    def __bool__(self) -> bool:
        return True  # an empty conversation is still a conversation (``if conv:`` stays true)

    @property
    def _fresh(self) -> bool:
        """No token yet: the first text prompt gets BOS if the model wants it."""
        return len(self._history) == 0

    def prompt(self, content: str | Sequence[int], *, special: bool = False) -> None:
        """Append text or token ids to the conversation. Never blocks.

        The first text prompt of a conversation gets BOS as the model's metadata asks; token ids are
        taken as they are. ``special`` parses special-token text (``<|im_start|>``) into those tokens.

        Raises:
            InvalidTokenError: a token id outside the vocabulary.
            InvalidRequestError: content that is empty, or neither text nor token ids.
            ContextFull: a prompt as long as the context or longer.
            ConversationClosed, EngineClosed, EngineDead.
        """
        self._check()
        tokens = self._core.encode(content, first=self._fresh, special=special)
        if not tokens or (isinstance(content, str) and not content):
            raise InvalidRequestError("a prompt must not be empty")
        self._append(tokens)

    def _append(self, tokens: list[int]) -> None:
        n_ctx = self._core.n_ctx
        if len(tokens) >= n_ctx:
            raise ContextFull(f"a prompt of {len(tokens)} tokens does not fit a context of {n_ctx} "
                              "with room to generate")
        self._core.send(Prompt(self.id, tuple(tokens)))
        self._history.prompt(tokens)

    @property
    def messages(self) -> list[dict[str, str]]:
        """The chat so far: every message given to ``chat()`` and the replies streamed back."""
        out = [dict(m) for m in self._chat or ()]
        if self._reply is not None:
            out.append({"role": "assistant", "content": "".join(self._reply.parts)})
        return out

    def append_chat(self, messages: Messages) -> int:
        """Append ``messages`` as the next chat turn, with the assistant's generation prompt, without
        generating (``chat()`` does both). Returns the number of tokens appended. Never blocks."""
        self._check()
        self._check_idle()
        core = self._core
        new = normalize(messages)
        for message in new:
            core.check_role(message["role"])
        protected, contents = protect(new)
        template = core.chat_template
        history = self.messages
        if self._chat is None:
            rendered = template.render(protected, True)
        else:
            if self._reply is None:
                history.append({"role": "assistant", "content": ""})
            previous = history[:-1] + [{"role": "assistant", "content": REPLY}]
            full = template.render(previous + protected, True)
            at = full.rfind(REPLY)
            if at < 0:
                raise ChatTemplateError("the chat template drops the previous assistant reply, so a turn "
                                        "cannot be appended; start a new conversation with all messages")
            rendered = full[at + len(REPLY):]
            if self._reply is not None and self._reply.finish_reason is FinishReason.EOG:
                # the reply's end-of-generation token is already in the conversation
                rendered = next((rendered[len(t):] for t in template.eog_texts if rendered.startswith(t)),
                                rendered)
        tokens = core.chat_tokens(segments(rendered, contents), first=self._fresh)
        if not tokens:
            raise ChatTemplateError("the chat template rendered nothing for these messages")
        self._append(tokens)
        self._chat, self._reply = history + new, None
        return len(tokens)

    def _chat_turn(self, messages: Messages, params: dict[str, Any]) -> None:
        self._check()
        SamplingParams.from_kwargs(**params)  # a bad parameter must not leave half a turn behind
        self.append_chat(messages)

    def _check_idle(self) -> None:
        last = self._last_stream() if self._last_stream is not None else None
        if last is not None and last._running:
            raise ConversationBusy("the conversation is already generating: read that stream to its "
                                   "end or cancel it first")

    def fork(self: _C) -> _C:
        """A new conversation with this one's history, sharing its KV prefix. Never blocks.

        Forking while a stream runs branches at what that stream has yielded to its reader so far;
        prompts given meanwhile follow there too.
        """
        self._check()
        known, waiting = self._history.branch()
        child = type(self)(self._core, self._core.new_id(), tokens=known)
        self._core.send(Fork(self.id, child.id, len(known)))
        for tokens in waiting:
            child._append(list(tokens))
        if self._chat is not None:
            child._chat = [dict(m) for m in self._chat]
            reply = self._reply
            if reply is not None and not reply.done:  # forked mid-reply: the child's reply stops here
                reply = _Collector(list(reply.parts), list(reply.tokens))
            child._reply = reply
        return child

    def _start(self, params: dict[str, Any], sink: AsyncSink | ThreadSink) -> None:
        self._check()
        sampling = SamplingParams.from_kwargs(**params)
        self._check_idle()
        admission = self._core.admission
        if not admission.enter():
            raise Overloaded(f"{admission.limit} generations are already waiting (max_queued); retry later")
        self._history.generating()  # before the command: its answer may come at once (SyncEngine)
        try:
            self._core.send(Generate(self.id, sampling, sink))
        except BaseException:
            admission.leave()
            self._history.release()
            raise

    def _close_command(self, ack: AsyncSink | ThreadSink) -> bool:
        """Mark closed and ask the decode thread to free everything; False if nothing to wait for."""
        if self._closed:
            return False
        self._closed = True
        if not self._core.usable:
            return False
        self._core.send(Close(self.id, ack))
        return True

    def close_nowait(self) -> None:
        """Close without waiting: the decode thread frees the seq id and cells at its next step."""
        if not self._closed:
            self._closed = True
            if self._core.usable:
                self._core.send(Close(self.id))

    def _cancel(self) -> None:
        if not self._closed and self._core.usable:
            self._core.send(Cancel(self.id))

    def __del__(self) -> None:
        # A forgotten conversation frees its cells: only a command is queued (see _StreamBase).
        try:
            self.close_nowait()
        except Exception:  # noqa: BLE001 - the engine may already be gone
            pass


class Conversation(_ConversationBase):
    """A conversation for async code (asyncio or trio). Create it with ``Engine.conversation()``.

    It belongs to the engine's event loop: its methods raise ``WrongEventLoop`` anywhere else.
    """

    def _check(self) -> None:
        super()._check()
        self._core.check_loop()

    def stream(self, **params: Any) -> Stream:
        """Start generating; returns a :class:`Stream` to iterate or await.

        Parameters are those of :class:`aiollama.sampling.SamplingParams` (max_tokens, temperature,
        top_k, top_p, min_p, typical_p, repeat_penalty, frequency_penalty, presence_penalty,
        penalty_last_n, seed, logit_bias, grammar, stop, ignore_eos).

        Raises:
            InvalidRequestError: a bad parameter (a ValueError naming it).
            ConversationBusy: the previous stream is neither finished nor cancelled.
            Overloaded: ``max_queued`` generations are already waiting.
            ConversationClosed, EngineClosed, EngineDead.
        The stream itself raises ContextFull when the history fills the context, and GrammarError for
        a grammar that does not parse.
        """
        sink = AsyncSink(self._core.check_loop(), self._history.take)
        self._start(params, sink)
        stream = Stream(self, sink)
        self._last_stream = weakref.ref(stream)
        return stream

    def chat(self, messages: Messages, **params: Any) -> Stream:
        """Append a chat turn in the model's own template, then stream the assistant's reply.

        ``messages`` is a str (one user message), a {"role", "content"} mapping, or a list of them.
        Each call appends to this conversation: earlier turns stay in the KV cache and are never
        evaluated again. Content is plain text: it never becomes control tokens. Parameters are those
        of ``stream()``.

        Raises:
            ChatTemplateError: a malformed message, a role with special-token text, or messages the
                template refuses.
            ConversationBusy, InvalidRequestError, ContextFull, and what ``stream()`` raises. If
            ``stream()`` raises (``Overloaded``), the turn stays appended: call ``stream()`` later
            for the reply.
        """
        self._chat_turn(messages, params)
        stream = self.stream(**params)
        self._reply = stream._result
        return stream

    async def aclose(self) -> None:
        """End any generation and free the conversation's seq id and KV cells. Idempotent."""
        sink = AsyncSink(self._core.check_loop())
        if self._close_command(sink):
            with anyio.CancelScope(shield=True):
                await sink.get()

    async def __aenter__(self) -> Conversation:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class SyncConversation(_ConversationBase):
    """A conversation for code on plain threads. Create it with ``SyncEngine.conversation()``."""

    def stream(self, **params: Any) -> SyncStream:
        """Start generating; iterate the result, or call ``result()``. See ``Conversation.stream``."""
        sink = ThreadSink(self._history.take)
        self._start(params, sink)
        stream = SyncStream(self, sink)
        self._last_stream = weakref.ref(stream)
        return stream

    def chat(self, messages: Messages, **params: Any) -> SyncStream:
        """Append a chat turn and stream the reply; see ``Conversation.chat``."""
        self._chat_turn(messages, params)
        stream = self.stream(**params)
        self._reply = stream._result
        return stream

    def close(self) -> None:
        """End any generation and free the conversation's seq id and KV cells. Idempotent."""
        sink = ThreadSink()
        if self._close_command(sink):
            sink.get()

    def __enter__(self) -> SyncConversation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
