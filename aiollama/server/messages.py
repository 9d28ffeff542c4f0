"""Anthropic's Messages API: ``/v1/messages`` (whole or streamed) and ``/v1/messages/count_tokens``.

A reply's thinking (the text of the model's thinking block) becomes a ``thinking`` block, its
text a ``text`` block and its tool calls ``tool_use`` blocks. Text that may start a tool call is
held back while it streams, so a call never leaks into a text block. ``usage.input_tokens`` counts
the prompt tokens evaluated, ``cache_read_input_tokens`` those found in the KV cache.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from aiollama import FinishReason, Stream
from aiollama.errors import AiollamaError
from aiollama.formats.reply import ReplyDelta
from aiollama.formats.toolcalls import ToolCall
from aiollama.server.images import read_images
from aiollama.server.messages_request import MessagesRequest, messages_request
from aiollama.server.neutral_request import message_text
from aiollama.server.opening import event_stream, json_text, open_route, while_connected
from aiollama.server.state import (
    CHAT_DEFAULTS,
    State,
    check_prompt_size,
    serving_engine,
    translate,
)

STOP_REASONS = {FinishReason.EOG: "end_turn", FinishReason.STOP: "stop_sequence", FinishReason.LENGTH: "max_tokens",
                FinishReason.CANCELLED: "end_turn"}


async def count_tokens(state: State, request: HttpRequest) -> Response:
    """``/v1/messages/count_tokens``: the prompt tokens the same body would evaluate."""
    req = messages_request(await state.guard.read_json(request), count_only=True)
    engine = serving_engine(state)
    check_prompt_size(state, engine, [message_text(m) for m in req.messages], engine.n_ctx)
    options = req.chat_options(engine)
    if any(not isinstance(m.get("content"), str) for m in req.messages):  # pictures: count as a turn takes them
        await read_images(engine, req.messages, state.fetcher)
        conv = engine.conversation()
        try:
            return JSONResponse({"input_tokens": conv.append_chat(req.messages, **options)})
        except AiollamaError as exc:
            raise translate(exc) from None
        finally:
            conv.close_nowait()
    try:
        text = engine.render_chat(req.messages, **options)
    except AiollamaError as exc:
        raise translate(exc) from None
    tokens = await anyio.to_thread.run_sync(lambda: engine.tokenize(text, add_special=False, special=True))
    return JSONResponse({"input_tokens": len(tokens)})


async def create(state: State, request: HttpRequest) -> Response:
    req = messages_request(await state.guard.read_json(request))
    reply, release = await open_route(state, request, req.messages, lambda: _start(state, req))
    if req.stream:
        return event_stream(_events(reply, release))

    text: list[str] = []

    async def read() -> None:  # woken once, at the end; the reply is read whole after
        for chunk in await reply.stream.rest():
            text.append(chunk.text)
            reply.generated += len(chunk.tokens)

    try:
        finished = await while_connected(request, read)  # a client that goes away cancels its generation
    except AiollamaError as exc:
        raise translate(exc) from None
    finally:
        release()
        with anyio.CancelScope(shield=True):
            await reply.stream.aclose()
            await reply.close()
    if not finished:
        return Response(status_code=499)
    blocks = reply.blocks("".join(text))
    called = any(block["type"] == "tool_use" for block in blocks)
    return JSONResponse(reply.message(blocks, *reply.stop(called), reply.usage(reply.generated)))


class Reply:
    """One message being generated: its conversation's stream, and how its output is shaped."""

    def __init__(self, state: State, req: MessagesRequest, stream: Stream, close: Callable[[], Any],
                 input_tokens: int) -> None:
        self.stream, self.close = stream, close
        self.id = "msg_" + uuid.uuid4().hex
        self.model = state.name()
        self.input_tokens = input_tokens
        assert stream.reader is not None
        self.reader = stream.reader  # the reply read in the model's format: neutral deltas, then a Message
        self.generated = 0
        self.show_thinking = req.show_thinking

    def message(self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None,
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def usage(self, output_tokens: int) -> dict[str, Any]:
        stats = self.stream.stats
        cached = min(stats.cached_tokens, self.input_tokens) if stats is not None else 0
        return {"input_tokens": self.input_tokens - cached, "output_tokens": output_tokens,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def stop(self, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence), once the generation has ended; ``called``: it made tool calls."""
        if called:
            return "tool_use", None
        reason = STOP_REASONS.get(self.stream.finish_reason or FinishReason.EOG, "end_turn")
        return reason, self.stream.stop_sequence if reason == "stop_sequence" else None

    def blocks(self, text: str | None = None) -> list[dict[str, Any]]:
        """The whole reply as content blocks (``text``: the reply, when it was not fed as it streamed)."""
        message = self.reader.read(text) if text is not None else self.reader.message
        out: list[dict[str, Any]] = []
        if message.reasoning:
            out.append({"type": "thinking", "thinking": message.reasoning if self.show_thinking else "", "signature": ""})
        if message.content:
            out.append({"type": "text", "text": message.content})
        out += [tool_use(call) for call in message.tool_calls]
        return out


def tool_use(call: ToolCall) -> dict[str, Any]:
    """A tool call as a ``tool_use`` block: its arguments, JSON text as the model wrote them, as an object."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments or "{}")}


def _start(state: State, req: MessagesRequest) -> Reply:
    engine = serving_engine(state)
    check_prompt_size(state, engine, [message_text(m) for m in req.messages], engine.n_ctx)
    conv = engine.conversation()
    try:
        stream = conv.chat(req.messages, **state.chat(req.chat_options(engine)), **state.params(req.params, CHAT_DEFAULTS))
    except BaseException as exc:
        conv.close_nowait()
        if isinstance(exc, AiollamaError):
            raise translate(exc) from None
        raise
    return Reply(state, req, stream, conv.aclose, len(conv))


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json_text({'type': kind, **fields})}\n\n"


async def _events(reply: Reply, release: Callable[[], None]) -> AsyncIterator[str]:
    """The streaming event sequence: ``message_start``, each block's ``content_block_start``,
    deltas and ``content_block_stop``, then ``message_delta`` and ``message_stop``."""
    index = -1
    kind: str | None = None  # the open block's type

    def switch(to: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, kind
        out = [_event("content_block_stop", index=index)] if kind is not None else []
        index, kind = index + 1, to
        return out + [_event("content_block_start", index=index, content_block=block)]

    def pieces(deltas: list[ReplyDelta]) -> list[str]:
        out = []
        for delta in deltas:
            if delta.reasoning:
                if kind != "thinking":
                    out += switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                if reply.show_thinking:
                    out.append(_event("content_block_delta", index=index,
                                      delta={"type": "thinking_delta", "thinking": delta.reasoning}))
            if delta.content:
                if kind != "text":
                    out += switch("text", {"type": "text", "text": ""})
                out.append(_event("content_block_delta", index=index, delta={"type": "text_delta", "text": delta.content}))
            for call in delta.calls:
                if call.name:  # a call begins: its id and name, then its arguments as they come
                    out += switch("tool_use", {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
                                               "name": call.name, "input": {}})
                elif call.arguments:
                    out.append(_event("content_block_delta", index=index,
                                      delta={"type": "input_json_delta", "partial_json": call.arguments}))
        return out

    try:
        yield _event("message_start", message=reply.message([], None, None, reply.usage(0)))
        try:
            async for chunk in reply.stream:
                reply.generated += len(chunk.tokens)
                for line in pieces(reply.reader.feed(chunk.text)):
                    yield line
            for line in pieces(reply.reader.finish()):
                yield line
        except AiollamaError as exc:
            error = translate(exc)
            yield _event("error", error=error.anthropic_body()["error"])
            return
        if kind is not None:
            yield _event("content_block_stop", index=index)
        stop_reason, stop_sequence = reply.stop(kind == "tool_use")  # calls come last
        usage = reply.usage(reply.generated)
        yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                     usage={"output_tokens": reply.generated, "input_tokens": usage["input_tokens"],
                            "cache_read_input_tokens": usage["cache_read_input_tokens"]})
        yield _event("message_stop")
    finally:
        release()
        with anyio.CancelScope(shield=True):
            await reply.stream.aclose()
            await reply.close()
