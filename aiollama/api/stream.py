"""Streams of generated text, and the token history a conversation keeps on its caller's side.

A stream reads the deltas the decode thread delivers into its sink; a conversation's
:class:`TokenHistory` sees every delta as it is delivered, whether or not the stream is read.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from aiollama.api.portal import AsyncSink
from aiollama.core.outputs import (
    Delta,
    FinishReason,
    GenerationStats,
    Item,
    TokenLogprob,
)
from aiollama.formats import reasoning
from aiollama.formats.reply import ReplyReader
from aiollama.formats.toolcalls import ToolCall


@dataclass(frozen=True)
class Chunk:
    """Text and tokens generated in one step. ``text`` never holds a broken UTF-8 character. The
    last chunk has the ``finish_reason`` and the generation's ``stats``; with ``logprobs=True``,
    ``logprobs`` has one entry per token. With ``prompt_progress=True``, chunks with no text come
    while the prompt is evaluated, their ``progress`` its tokens, those found in the cache, and
    those evaluated so far."""

    text: str
    tokens: list[int]
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    progress: tuple[int, int, int] | None = None  # with prompt_progress: (prompt, cached, evaluated)


@dataclass(frozen=True)
class Completion:
    """A whole generation: ``finish_reason`` is EOG, STOP, LENGTH or CANCELLED; ``stats`` says what
    it cost (None when the engine closed under it); ``stop_sequence`` is the stop string that ended
    it (finish reason STOP). With ``prompt_logprobs``, ``prompt_logprobs`` scores each prompt token
    after the first. ``reasoning`` is the text of a thinking block
    at its start and ``content`` the rest: all of ``text`` for a model that does not think, and what
    a constraint matched. A chat turn's reply is read in its model's own format, by llama.cpp's
    parser (see :mod:`aiollama.formats.reply`), and ``tool_calls`` are the calls it makes; a plain
    prompt's text is split at ``<think>`` markers (:mod:`aiollama.formats.reasoning`)."""

    text: str
    tokens: list[int]
    finish_reason: FinishReason
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""
    content: str = ""
    stop_sequence: str | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


class TokenHistory:
    """A conversation's tokens as its caller knows them.

    Generated tokens join as their deltas are delivered to the consumer's event loop (or thread),
    whether or not anyone reads the stream, and a context shift's drop applies there too. Prompts
    given while a generation is in flight wait until its last delta arrives, as they do on the
    decode thread, so the order here is the order there. While a generation is in flight, a fork
    branches at the end of the last delta its stream yielded (``mark``). Deltas arrive on the
    consumer's event loop, or on the decode thread for ``SyncEngine``: hence the lock.
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = list(tokens)
        self._pending: deque[list[Sequence[int]]] = deque()  # per generation in flight: prompts after it
        # id of a delivered delta not yet read -> (the history's length after it, context shifts
        # made before it); shifts after it are applied when it is read, so a shift costs nothing
        # however many deltas wait unread
        self._ends: dict[int, tuple[int, int]] = {}
        self._shifts: list[tuple[int, int]] = []  # (keep, n) of each context shift, in order
        self._mark = 0
        self._lock = threading.Lock()

    def prompt(self, tokens: Sequence[int]) -> None:
        with self._lock:
            if self._pending:
                self._pending[-1].append(tokens)
            else:
                self.tokens.extend(tokens)

    def generating(self) -> None:
        with self._lock:
            if not self._pending:
                self._mark = len(self.tokens)
            self._pending.append([])

    def not_generating(self) -> None:
        """The generation just announced could not start."""
        with self._lock:
            for tokens in self._pending.pop():
                self.tokens.extend(tokens)

    @property
    def in_flight(self) -> bool:
        """A generation started and its last delta has not arrived yet."""
        return bool(self._pending)

    def take(self, item: Item) -> None:
        """A delta was delivered: its tokens join the history; the last one releases the prompts."""
        if not isinstance(item, Delta):
            return
        with self._lock:
            if item.dropped is not None:
                keep, n = item.dropped
                del self.tokens[keep:keep + n]
                self._mark = _moved(self._mark, keep, n)
                self._shifts.append((keep, n))
            self.tokens.extend(item.history)
            self._ends[id(item)] = (len(self.tokens), len(self._shifts))
            if (item.finish_reason is not None or item.error is not None) and self._pending:
                for tokens in self._pending.popleft():
                    self.tokens.extend(tokens)
                if not self._pending:
                    self._ends.clear()
                    self._shifts.clear()

    def read(self, item: Item) -> None:
        """The stream yielded ``item`` to its reader."""
        with self._lock:
            found = self._ends.pop(id(item), None)
            if found is not None:
                end, since = found
                for keep, n in self._shifts[since:]:
                    end = _moved(end, keep, n)
                self._mark = end

    def rewind(self, n_tokens: int) -> None:
        with self._lock:
            del self.tokens[n_tokens:]

    def __len__(self) -> int:
        with self._lock:
            return len(self.tokens) + sum(len(t) for prompts in self._pending for t in prompts)

    def snapshot(self) -> tuple[list[int], list[Sequence[int]]]:
        """The tokens known now, and the prompts still waiting for a generation to end."""
        with self._lock:
            return list(self.tokens), [t for prompts in self._pending for t in prompts]

    def branch(self) -> tuple[list[int], list[Sequence[int]]]:
        """Where a fork starts: up to what a running stream has yielded, then the waiting prompts."""
        with self._lock:
            waiting = [t for prompts in self._pending for t in prompts]
            return (self.tokens[:self._mark] if self._pending else list(self.tokens)), waiting


def _moved(end: int, keep: int, n: int) -> int:
    """Where a history length lands after tokens ``[keep, keep + n)`` were dropped."""
    return end if end <= keep else max(keep, end - n)


@dataclass
class Collector:
    """Accumulates a stream's deltas into what it has read and its completion."""

    parts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reader: ReplyReader | None = None  # a chat turn's reply: read in its model's format at the end
    in_thinking: bool = False  # the prompt opened a thinking block
    stop_sequence: str | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    truncated: bool = False  # the context shifted: tokens left the history

    def take(self, item: Item) -> Chunk | None:
        """Record a delta; return the chunk to hand out, or None when there is nothing to show."""
        assert isinstance(item, Delta)
        delta = item
        if delta.error is not None:
            self.finish_reason = self.finish_reason or FinishReason.ERROR
            raise delta.error
        self.parts.append(delta.text)
        self.prompt_logprobs.extend(delta.prompt_logprobs)
        self.tokens.extend(delta.tokens)
        self.logprobs.extend(delta.logprobs)
        self.truncated = self.truncated or delta.dropped is not None
        if delta.finish_reason is not None:
            self.finish_reason, self.stats, self.stop_sequence = delta.finish_reason, delta.stats, delta.stop
        if delta.progress is not None:
            return Chunk("", [], progress=delta.progress)
        if not delta.text and not delta.tokens:
            return None  # the end, or a context shift: nothing to show
        return Chunk(delta.text, list(delta.tokens), delta.finish_reason, delta.stats, list(delta.logprobs))

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def completion(self) -> Completion:
        text = self.text
        if self.reader is not None:
            message = self.reader.read(text)
            thought, content, calls = message.reasoning, message.content, message.tool_calls
        else:
            thought, content = reasoning.split(text, inside=self.in_thinking)
            calls = []
        return Completion(text, list(self.tokens), self.finish_reason or FinishReason.CANCELLED, self.stats,
                          list(self.logprobs), calls, thought, content, self.stop_sequence, list(self.prompt_logprobs))


class Stream:
    """An async stream of :class:`Chunk`. Iterate it with ``async for``, or await it for a
    :class:`Completion`. Leaving the loop early, cancelling the consuming task or a timeout ends the
    generation within one decode step."""

    def __init__(self, history: TokenHistory, cancel: Callable[[], None], sink: AsyncSink) -> None:
        self._history = history
        self._send_cancel = cancel
        self._result = Collector()
        self._cancelled = False
        self._sink = sink

    def cancel(self) -> None:
        """Ask the engine to end this generation; the stream then finishes with CANCELLED."""
        if not self._result.done:
            self._cancelled = True
            self._send_cancel()

    @property
    def running(self) -> bool:
        """Neither finished nor cancelled."""
        return not self._result.done and not self._cancelled

    def _abandon(self) -> None:
        if not self._result.done:
            self._result.finish_reason = FinishReason.CANCELLED
            self._cancelled = True
            self._send_cancel()

    def _take(self, item: Item) -> Chunk | None:
        self._history.read(item)
        return self._result.take(item)

    @property
    def reader(self) -> ReplyReader | None:
        """A chat turn's reply read in its model's format, for a caller that reads it as it streams
        (feed it each chunk's text, then finish it); None for a stream that answers no chat turn."""
        return self._result.reader

    @property
    def in_thinking(self) -> bool:
        """The prompt ended inside a thinking block (the template opened it): the text starts as
        reasoning, until ``</think>``."""
        return self._result.in_thinking

    @property
    def finish_reason(self) -> FinishReason | None:
        """None while it runs; then how it ended (ERROR if it raised)."""
        return self._result.finish_reason

    @property
    def stats(self) -> GenerationStats | None:
        """What the generation cost, once it has ended."""
        return self._result.stats

    @property
    def truncated(self) -> bool:
        """The context shifted while it ran (or at its start): tokens left the history."""
        return self._result.truncated

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the generation (finish reason STOP), else None."""
        return self._result.stop_sequence

    @property
    def prompt_logprobs(self) -> list[TokenLogprob]:
        """With ``prompt_logprobs``: each prompt token after the first, scored, as far as the
        stream has been read (all of them once its first chunk is)."""
        return self._result.prompt_logprobs

    def __del__(self) -> None:
        # Breaking out of a loop drops the stream: end its generation within a step. This only
        # queues a command (SimpleQueue.put is reentrant, so the collector may run it anywhere);
        # every native free happens on the decode thread.
        try:
            self._abandon()
        except Exception:  # noqa: BLE001 - the engine may already be gone
            pass

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Chunk:
        while not self._result.done:
            try:
                item = await self._sink.get()
            except BaseException:
                self._abandon()
                raise
            chunk = self._take(item)
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    async def next_chunks(self) -> list[Chunk]:
        """The next chunk and those already delivered behind it: one hop each time for a reader on
        another thread (``SyncStream``). Raises StopAsyncIteration at the end."""
        return [await self.__anext__(), *self._delivered()]

    async def rest(self) -> list[Chunk]:
        """Wait for the generation to end, and return the chunks not read yet. Its reader wakes
        once, where ``async for`` wakes it at every step."""
        if not self._result.done:
            try:
                await self._sink.wait_end()
            except BaseException:
                self._abandon()
                raise
        return self._delivered()

    def _delivered(self) -> list[Chunk]:
        """The chunks already delivered and not read, up to the generation's end."""
        chunks = []
        while not self._result.done and (item := self._sink.get_nowait()) is not None:
            chunk = self._take(item)
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    async def _collect(self) -> Completion:
        await self.rest()
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
