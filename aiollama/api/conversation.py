"""Conversations: the public face of the engine.

A conversation is the whole token history. ``prompt()`` appends to it without blocking; ``stream()``
generates a continuation of everything prompted and generated so far; ``fork()`` branches it, and the
branches share the KV cells of their common prefix; ``rewind()`` cuts its end; ``save()`` writes it
to a file that ``Engine.load()`` reads back. Every call only queues a command for the decode thread;
none of this code calls into llama.cpp, except the tokenizer, which is thread-safe.

A conversation knows its own history (``tokens``) as it was delivered to its caller: prompts as
they are given, generated tokens as their chunks arrive. Forking a conversation while it streams
branches it at what the stream has yielded so far. Prompting a conversation while it streams
appends after that generation ends.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import anyio

from aiollama._validate import lora_set, number
from aiollama.api.chat_turns import ChatTurns, check_turn, reader_for, reply_params
from aiollama.api.client import EngineClient
from aiollama.api.images import Image
from aiollama.api.pooled import saved
from aiollama.api.portal import AsyncSink
from aiollama.api.stream import Chunk, Completion, Stream, TokenHistory
from aiollama.core.commands import (
    Cancel,
    Close,
    Fork,
    Generate,
    Prompt,
    Rewind,
    Save,
)
from aiollama.core.outputs import Item
from aiollama.errors import (
    ConversationBusy,
    ConversationClosed,
    InvalidRequestError,
    Overloaded,
)
from aiollama.formats import savefile
from aiollama.formats.chat import Rendered
from aiollama.formats.messages import Messages
from aiollama.sampling import SamplingParams

__all__ = ["Chunk", "Completion", "Conversation", "Stream"]



class Conversation:
    """A conversation for async code (asyncio or trio). Create it with ``Engine.conversation()``.

    It belongs to the engine's event loop: its methods raise ``WrongEventLoop`` anywhere else.
    """

    def __init__(self, client: EngineClient, conv_id: int, *, tokens: Sequence[int] = ()) -> None:
        self._client = client
        self.id = conv_id
        self._history = TokenHistory(tokens)
        self._chat = ChatTurns()
        self._closed = False
        self._last_stream: weakref.ref[Stream] | None = None
        self._turn: Rendered | None = None  # the chat turn whose reply the next stream is
        client.conversations.add(self)

    def _check(self) -> None:
        self._client.check()
        if self._closed:
            raise ConversationClosed("the conversation is closed")
        self._client.check_loop()

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

    def prompt(self, content: str | Sequence[int] | Sequence[str | Image | int], *, special: bool = False) -> None:
        """Append text, token ids, or a list of parts (text, :class:`~aiollama.Image`, token ids; not
        an image last). Never blocks, but encodes a picture (``await engine.encode_images()`` first).

        The first prompt of a conversation gets BOS as the model's metadata asks where it begins with
        text or a picture; token ids are taken as they are. ``special`` parses special-token text
        (``<|im_start|>``) into those tokens.

        Raises:
            InvalidTokenError, ImageError: a bad token id or image, or an engine without a projector.
            InvalidRequestError: content that is empty, or neither text nor token ids.
            ContextFull: a prompt as long as the context or longer.
            ConversationClosed, EngineClosed, EngineDead.
        """
        self._check()
        tokens, images = self._client.prompt_tokens(content, first=len(self) == 0, special=special)
        if not tokens or (isinstance(content, str) and not content):
            raise InvalidRequestError("a prompt must not be empty")
        self._append(tokens, images)

    def _append(self, tokens: list[int], images: dict[int, Any] | None = None) -> None:
        self._client.check_prompt(tokens)
        self._client.send(Prompt(self.id, tuple(tokens), images or {}))
        self._history.prompt(tokens)
        self._turn = None  # a stream after this is no chat turn's reply

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The chat so far: every message given to ``chat()`` and the replies streamed back."""
        return self._chat.messages

    def append_chat(self, messages: Messages, **options: Any) -> int:
        """Append ``messages`` as the next chat turn, with the assistant's generation prompt, without
        generating (``chat()`` does both; a ``stream()`` afterwards is the turn's reply, read and
        constrained as ``chat()``'s). ``options`` are ``chat()``'s (``tools``, ``tool_choice``,
        ``chat_template_kwargs``...). Returns the number of tokens appended."""
        self._check()
        self._check_idle()
        start = len(self)
        tokens, rendered, images = self._chat.render(self._client, messages, first=start == 0, **options)
        self._append(tokens, images)
        self._turn = rendered
        self._chat.appended(start, len(tokens), rendered)
        return len(tokens)

    def _check_idle(self) -> None:
        last = self._last_stream() if self._last_stream is not None else None
        if last is not None and last.running:
            raise ConversationBusy("the conversation is already generating: read that stream to its "
                                   "end or cancel it first")

    def _check_settled(self, what: str) -> None:
        last = self._last_stream() if self._last_stream is not None else None
        if (last is not None and last.running) or self._history.in_flight:
            raise ConversationBusy(f"{what} waits until the last stream has ended: read it to its end "
                                   "(or await stream.aclose()) first")

    def fork(self) -> Conversation:
        """A new conversation with this one's history, sharing its KV prefix. Never blocks.

        Forking while a stream runs branches at what that stream has yielded to its reader so far;
        prompts given meanwhile follow there too.
        """
        self._check()
        known, waiting = self._history.branch()
        child = Conversation(self._client, self._client.new_id(), tokens=known)
        self._client.send(Fork(self.id, child.id, len(known)))
        for tokens in waiting:
            child._append(list(tokens))
        child._chat = self._chat.copy()
        child._turn = self._turn
        return child

    def rewind(self, n: int) -> None:
        """Drop the last ``n`` tokens, to generate differently from there (regenerate a reply, say).
        Never blocks. In a chat, cutting to where a reply began lets the next ``stream()`` be that
        reply again, and cutting to where a turn began removes the turn from ``messages``.

        Raises:
            ConversationBusy: a stream of this conversation has not ended yet.
            InvalidRequestError: ``n`` is not an int in ``[0, len(conv)]``.
            ConversationClosed, EngineClosed, EngineDead.
        """
        self._check()
        self._check_settled("rewind()")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(self):
            raise InvalidRequestError(f"rewind() takes a number of tokens in [0, {len(self)}], got {n!r}")
        keep = len(self) - n
        self._client.send(Rewind(self.id, keep))
        self._history.rewind(keep)
        self._chat.rewound(keep, self._client.detokenize)
        self._turn = None

    def close_nowait(self) -> None:
        """Close without waiting: the decode thread frees the seq id and cells at its next step."""
        if not self._closed:
            self._closed = True
            if self._client.usable:
                self._client.send(Close(self.id))

    def _cancel(self) -> None:
        if not self._closed and self._client.usable:
            self._client.send(Cancel(self.id))

    def __del__(self) -> None:
        # A forgotten conversation frees its cells: only a command is queued (see Stream).
        try:
            self.close_nowait()
        except Exception:  # noqa: BLE001 - the engine may already be gone
            pass

    def stream(self, **params: Any) -> Stream:
        """Start generating; returns a :class:`Stream` to iterate or await.

        Parameters are those of :class:`aiollama.sampling.SamplingParams` (max_tokens, temperature,
        top_k, top_p, min_p, typical_p, repeat_penalty, frequency_penalty, presence_penalty,
        penalty_last_n, seed, logit_bias, grammar, stop, ignore_eos, context_shift, n_keep,
        draft_tokens, json_schema, regex, lark, logprobs, top_logprobs, logits_processors, priority);
        ``lora={name: scale}`` switches the LoRA adapters from this stream on (``{}``: none).

        ``guidance=other`` with ``guidance_scale=w`` (classifier-free guidance): ``other``, a
        conversation of the same engine (a negative prompt, say), is decoded in the same batch at
        every step, this stream samples from ``g + w * (l - g)`` (``l`` its own logits, ``g``
        the other's), and each token chosen is appended to both. Scale 1 is the plain stream.
        ``other`` counts as generating until the stream ends: its prompts wait, it cannot stream.

        Raises:
            InvalidRequestError: a bad parameter (a ValueError naming it).
            ConversationBusy: the previous stream is neither finished nor cancelled.
            Overloaded: ``max_queued`` generations are already waiting.
            ConversationClosed, EngineClosed, EngineDead.
        The stream itself raises ContextFull when the history fills the context (unless it shifts
        the context), and GrammarError for a grammar that does not parse.
        """
        guide, scale = guidance(self, params)
        sink = self._client.async_sink(extends(self, guide))
        stream = Stream(self._history, self._cancel, sink)
        start(self, params, sink, stream, guide, scale)
        return stream

    def chat(self, messages: Messages, *, tools: list[dict[str, Any]] | None = None, tool_choice: Any = "auto",
             chat_template_kwargs: dict[str, Any] | None = None, reasoning_effort: str | None = None,
             continue_final_message: bool = False, reasoning_format: str = "auto",
             parallel_tool_calls: bool | None = None, **params: Any) -> Stream:
        """Append a chat turn in the model's own template, then stream the assistant's reply.

        ``messages`` is a str (one user message), a {"role", "content"} mapping, or a list of them
        (assistant messages with ``tool_calls`` and ``reasoning_content``, ``tool`` messages too).
        Each call appends to this conversation: earlier turns stay in the KV cache and are never
        evaluated again. The template is rendered by llama.cpp as llama-server renders it. Content
        is plain text: it never becomes control tokens. ``tools`` are OpenAI-style function tools,
        given to the template (or described in a system message when it has no place for them); the
        reply is read in the model's own format (llama.cpp's parser of it), and the completion's
        ``reasoning``, ``content`` and ``tool_calls`` are what it holds. ``tool_choice`` "required"
        or ``{"type": "function", "function": {"name": ...}}`` constrains the reply to a call in that
        format (llama.cpp's grammar), "none" leaves the calls in the content.
        ``chat_template_kwargs`` are variables for the template (only those it reads;
        ``enable_thinking`` where it has a thinking switch, which is on by default as in
        llama-server), ``reasoning_effort`` the level of a template that reads one ("none" switches
        thinking off). ``continue_final_message``: the last message is the assistant's, and the
        reply continues it. ``reasoning_format`` is llama-server's: "auto" (or "deepseek") reads a
        thinking block into ``reasoning``, "none" leaves it in the content, "deepseek-legacy" keeps
        its tags in the content as well. ``parallel_tool_calls`` None lets a template that can make
        several calls in a reply do so. Parameters are those of ``stream()``.

        Raises:
            ChatTemplateError: a malformed message, a role with special-token text, or messages the
                template refuses.
            ConversationBusy, InvalidRequestError, ContextFull, and what ``stream()`` raises. If
            ``stream()`` raises (``Overloaded``), the turn stays appended: call ``stream()`` later
            for the reply.
        """
        self._check()
        check_turn(params, tool_choice)
        self.append_chat(messages, tools=tools, tool_choice=tool_choice, chat_template_kwargs=chat_template_kwargs,
                         reasoning_effort=reasoning_effort, continue_final_message=continue_final_message,
                         reasoning_format=reasoning_format, parallel_tool_calls=parallel_tool_calls)
        return self.stream(**params)

    async def snapshot(self, *, cells: bool = True) -> bytes:
        """What ``save`` writes: tokens, chat, the model's fingerprint, and with ``cells`` a copy of
        the KV cells (without, ``Engine.restore`` evaluates the tokens again: smaller, and still a
        correct continuation). ConversationBusy while a stream of it has not ended."""
        sink = self._client.async_sink()
        self._check()
        self._check_settled("snapshot()")
        self._client.send(Save(self.id, sink))
        with anyio.CancelScope(shield=True):
            item = await sink.get()
        return saved(self._client, self._chat.state(), item, cells)

    async def save(self, path: str | os.PathLike[str], *, cells: bool = True) -> None:
        """Write :meth:`snapshot` to ``path`` (OSError if it cannot be); ``Engine.load(path)`` reads it."""
        self._check_settled("save()")
        await anyio.to_thread.run_sync(savefile.write_file, path, await self.snapshot(cells=cells))

    async def aclose(self) -> None:
        """End any generation and free the conversation; its cached prefix stays in the engine's
        prefix cache for any later conversation that starts with it. Idempotent."""
        sink = self._client.async_sink()
        if close_command(self, sink):
            with anyio.CancelScope(shield=True):
                await sink.get()

    async def __aenter__(self) -> Conversation:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


def guidance(conv: Conversation, params: dict[str, Any]) -> tuple[Conversation | None, float]:
    """Take ``guidance`` and ``guidance_scale`` out of a stream's parameters, checked."""
    guide = params.pop("guidance", None)
    scale = params.pop("guidance_scale", None)
    if guide is None:
        if scale is not None:
            raise InvalidRequestError("guidance_scale needs guidance=<a conversation>")
        return None, 1.0
    if not isinstance(guide, Conversation) or guide._client is not conv._client:
        raise InvalidRequestError(f"guidance must be a conversation of the same engine, got {guide!r}")
    if guide is conv:
        raise InvalidRequestError("a conversation cannot guide its own stream")
    scale = 1.0 if scale is None else number("guidance_scale", scale)
    guide._check()
    guide._check_settled("guiding another stream")
    if not len(guide):
        raise InvalidRequestError("the guidance conversation is empty: prompt it first")
    return guide, scale


def extends(conv: Conversation, guide: Conversation | None) -> Callable[[Item], None]:
    """What a stream's sink does with each delivered item: the histories it extends."""
    if guide is None:
        return conv._history.take
    mine, theirs = conv._history.take, guide._history.take

    def take(item: Item) -> None:
        mine(item)
        theirs(item)
    return take


def start(conv: Conversation, params: dict[str, Any], sink: AsyncSink, stream: Stream,
          guide: Conversation | None = None, scale: float = 1.0) -> None:
    """Ask the decode thread for a generation of ``conv`` into ``stream``, its parameters checked."""
    created = time.perf_counter()
    conv._check()
    client, history = conv._client, conv._history
    adapters = None if "lora" not in params else lora_set(params.pop("lora"), client.config.lora)
    turn = conv._turn
    if turn is not None:
        params = reply_params(turn, params)
    sampling = SamplingParams.from_kwargs(**params)
    conv._check_idle()
    if guide is not None and sampling.context_shift:
        raise InvalidRequestError("a guided stream cannot shift its context: the two histories stay in step")
    inside = client.generation_start(history.tokens[-4:], guide._history.tokens[-1:] if guide else ())
    matcher = client.constraint(sampling, inside_thinking=inside)
    admission = client.admission
    if not admission.enter():
        raise Overloaded(f"{admission.limit} generations are already waiting (max_queued); retry later")
    begin = len(conv)
    history.generating()  # before the command: its answer may come at once (SyncEngine)
    if guide is not None:
        guide._history.generating()
    try:
        client.send(Generate(conv.id, sampling, sink, matcher, None if guide is None else guide.id,
                             scale, created, adapters))
    except BaseException:
        admission.leave()
        history.not_generating()
        if guide is not None:
            guide._history.not_generating()
        raise
    if guide is not None:
        guide._last_stream = weakref.ref(stream)
    conv._chat.streaming(begin, stream._result)
    conv._turn = None
    if turn is not None:
        stream._result.reader = reader_for(client, turn)
    stream._result.in_thinking = inside
    conv._last_stream = weakref.ref(stream)


def close_command(conv: Conversation, ack: AsyncSink) -> bool:
    """Mark ``conv`` closed and ask the decode thread to free everything; False if nothing to wait for."""
    if conv._closed:
        return False
    conv._closed = True
    if not conv._client.usable:
        return False
    conv._client.send(Close(conv.id, ack))
    return True
