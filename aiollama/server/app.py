"""An OpenAI-compatible ASGI app (Starlette) over one Engine.

``create_app(model)`` owns an engine for its lifespan; ``create_app(engine=engine)`` serves an
engine the caller owns, so the app can be mounted in a larger service. ``n`` choices are forks of
one conversation and share its prompt's KV cells.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from aiollama import Chunk, Conversation, Engine, Statistics, Stream
from aiollama.errors import (
    AiollamaError,
    ClosedError,
    ContextFull,
    EngineDead,
    InvalidRequestError,
    Overloaded,
)
from aiollama.models import default_model
from aiollama.sampling import seed_for
from aiollama.server.shape import ChatChoice, TextChoice
from aiollama.toolcalls import call_schema, tool_names
from aiollama.server.metrics import Metrics
from aiollama.server.requests import BadRequest, Request, chat_request, completion_request, embeddings_request



@dataclass
class _State:
    model_name: str
    retry_after: int
    engine: Engine | None = None
    metrics: Metrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.statistics)

    def name(self) -> str:
        """The model id clients see: as given, else the served file's name."""
        path = self.engine.model_path if self.engine is not None else None
        return self.model_name or (Path(path).stem if path is not None else "default")

    owns_engine: bool = False

    async def close_engine(self) -> None:
        """End what still runs (streams get an error event, requests a 503) by closing an engine
        this app owns; an engine the caller owns is left alone."""
        if self.owns_engine and self.engine is not None:
            await self.engine.aclose()

    def statistics(self) -> Statistics | None:
        try:
            return None if self.engine is None else self.engine.statistics()
        except AiollamaError:
            return None


def create_app(model: str | os.PathLike[str] | None = None, *, engine: Engine | None = None,
               model_name: str | None = None, retry_after: int = 1, **engine_options: Any) -> Starlette:
    """The app. ``engine_options`` go to :class:`Engine` when the app owns its engine."""
    if engine is not None and (model is not None or engine_options):
        raise ValueError("pass either an engine or the model and options to build one, not both")
    path = None if model is None else Path(model)
    name = model_name or (path.stem if path is not None else "")
    state = _State(model_name=name, retry_after=retry_after, engine=engine, owns_engine=engine is None)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if engine is not None:
            yield
            return
        model_path = path if path is not None else await anyio.to_thread.run_sync(default_model)
        async with Engine(model_path, **engine_options) as owned:
            state.engine = owned
            try:
                yield
            finally:
                state.engine = None

    routes = [
        Route("/health", _endpoint(state, "health", _health), methods=["GET"]),
        Route("/metrics", _endpoint(state, "metrics", _metrics), methods=["GET"]),
        Route("/v1/models", _endpoint(state, "models", _models), methods=["GET"]),
        Route("/v1/completions", _endpoint(state, "completions", _completions), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(state, "chat", _chat_completions), methods=["POST"]),
        Route("/v1/embeddings", _endpoint(state, "embeddings", _embeddings), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.aiollama = state
    return app


Handler = Callable[[_State, HttpRequest], Awaitable[Response]]


def _endpoint(state: _State, name: str, handler: Handler) -> Callable[[HttpRequest], Awaitable[Response]]:
    async def endpoint(request: HttpRequest) -> Response:
        try:
            response = await handler(state, request)
        except BadRequest as exc:
            response = _error(exc, state)
        state.metrics.requests.labels(name, str(response.status_code)).inc()
        return response
    return endpoint


def _error(exc: BadRequest, state: _State) -> JSONResponse:
    headers = {"Retry-After": str(state.retry_after)} if exc.status == 503 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _engine(state: _State) -> Engine:
    engine = state.engine
    if engine is not None and engine.serving:
        return engine
    raise BadRequest("the engine is not serving", status=503, code="unavailable")


async def _health(state: _State, request: HttpRequest) -> Response:
    _engine(state)
    return JSONResponse({"status": "ok"})


async def _metrics(state: _State, request: HttpRequest) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _models(state: _State, request: HttpRequest) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": state.name(), "object": "model", "created": 0, "owned_by": "aiollama"}]})


async def _body(request: HttpRequest) -> Any:
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None


def _translate(exc: AiollamaError) -> BadRequest:
    if isinstance(exc, Overloaded):
        return BadRequest(str(exc), status=503, code="overloaded")
    if isinstance(exc, ContextFull):
        return BadRequest(str(exc), code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return BadRequest(str(exc))
    if isinstance(exc, (ClosedError, EngineDead)):
        return BadRequest(str(exc), status=503, code="unavailable")
    return BadRequest(str(exc), status=500, code="internal_error")


async def _completions(state: _State, request: HttpRequest) -> Response:
    return await _serve(state, request, completion_request(await _body(request)), chat=False)


async def _chat_completions(state: _State, request: HttpRequest) -> Response:
    return await _serve(state, request, chat_request(await _body(request)), chat=True)


async def _embeddings(state: _State, request: HttpRequest) -> Response:
    """``/v1/embeddings``: ``input`` is a string, a list of them, or token ids; ``encoding_format``
    "float" or "base64" (little-endian float32, as OpenAI's clients decode it)."""
    texts, encoding = embeddings_request(await _body(request))
    engine = _engine(state)
    try:
        vectors = await engine.embed(texts)
        n_tokens = sum(len(engine.tokenize(t, add_special=True)) if isinstance(t, str) else len(t) for t in texts)
    except AiollamaError as exc:
        raise _translate(exc) from None
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if encoding == "base64" else v}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": state.name(),
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


@dataclass
class _Job:
    """One request in flight: its conversations and streams, and each choice's shaped output."""

    id: str
    chat: bool
    model: str
    created: int
    prompt_tokens: int
    convs: list[Conversation]
    streams: list[Stream]
    started: float
    choices: list[ChatChoice | TextChoice]

    async def close(self) -> None:
        for conv in self.convs:
            await conv.aclose()


def _start(state: _State, req: Request, chat: bool) -> _Job:
    engine = _engine(state)
    root = engine.conversation()
    convs = [root]
    tools = req.tools if req.tool_choice != "none" else None
    try:
        if tools:
            names = tool_names(tools)
            schema = call_schema(tools, req.tool_choice)
            if schema is not None:
                if "grammar" in req.params or "json_schema" in req.params:
                    raise BadRequest("tool_choice 'required' or a named function constrains the output; give "
                                     "no response_format, grammar or json_schema with it", param="tool_choice")
                req.params["json_schema"] = schema
        if chat:
            assert req.messages is not None
            n_prompt = root.append_chat(req.messages, tools=tools)
        else:
            tokens = engine.tokenize(req.prompt, add_special=True) if isinstance(req.prompt, str) else req.prompt
            assert tokens is not None
            root.prompt(tokens)
            n_prompt = len(tokens)
        if req.n > 1:
            convs = [root.fork() for _ in range(req.n)]  # the choices share the prompt's cells
        streams = []
        for i, conv in enumerate(convs):
            params = dict(req.params)
            if "seed" in params:
                params["seed"] = seed_for(params["seed"], i)
            streams.append(conv.stream(**params))
    except BaseException as exc:
        for conv in {root, *convs}:
            conv.close_nowait()
        if isinstance(exc, AiollamaError):
            raise _translate(exc) from None
        raise
    if req.n > 1:
        root.close_nowait()  # the forks hold what they need
    prefix = "chatcmpl-" if chat else "cmpl-"
    choices: list[ChatChoice | TextChoice] = [
        ChatChoice(i, names if tools else [], engine.token_bytes, in_thinking=stream.in_thinking) if chat
        else TextChoice(i, engine.token_bytes)
        for i, stream in enumerate(streams)]
    return _Job(prefix + uuid.uuid4().hex, chat, state.name(), int(time.time()), n_prompt, convs, streams,
                time.perf_counter(), choices)


Item = tuple[int, Chunk | AiollamaError | None]


async def _pump(job: _Job, state: _State, send: MemoryObjectSendStream[Item]) -> None:
    """Every choice's chunks, in arrival order, as (index, chunk); (index, None) when it ends, with
    its finish reason on the stream; (index, error) if it fails."""
    first = True

    metrics = state.metrics

    async def one(i: int, stream: Stream) -> None:
        nonlocal first
        last = 0.0
        try:
            try:
                async for chunk in stream:
                    if chunk.tokens:
                        now = time.perf_counter()
                        if first:
                            first = False
                            metrics.time_to_first_token.observe(now - job.started)
                        if last:
                            for _ in chunk.tokens:  # a chunk of several tokens (a draft taken) shares its gap
                                metrics.inter_token_latency.observe((now - last) / len(chunk.tokens))
                        last = now
                    await send.send((i, chunk))
            except AiollamaError as exc:
                await send.send((i, exc))
            else:
                await send.send((i, None))
            finally:
                if stream.stats is not None:
                    metrics.queue_time.observe(stream.stats.queue_seconds)
                    metrics.e2e_latency.observe(time.perf_counter() - job.started)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the response stopped reading: it is closing the job

    async with send, anyio.create_task_group() as tg:
        for i, stream in enumerate(job.streams):
            tg.start_soon(one, i, stream)


@asynccontextmanager
async def _items(job: _Job, state: _State) -> AsyncIterator[MemoryObjectReceiveStream[Item]]:
    """The job's items as they arrive, pumped by tasks that end with the block."""
    send, receive = anyio.create_memory_object_stream[Item](64)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_pump, job, state, send)
        async with receive:
            yield receive
        tg.cancel_scope.cancel()


async def _serve(state: _State, request: HttpRequest, req: Request, chat: bool) -> Response:
    job = _start(state, req, chat)
    if req.stream:
        return StreamingResponse(_events(job, state, req), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    completion_tokens = 0
    error: AiollamaError | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
            async with _items(job, state) as items:
                async for i, item in items:
                    if isinstance(item, AiollamaError):
                        error = item
                        break
                    if item is not None:
                        job.choices[i].feed(item)
                        completion_tokens += len(item.tokens)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await job.close()
    if error is not None:
        raise _translate(error)
    choices = [choice.message(job.streams[i].finish_reason) for i, choice in enumerate(job.choices)]
    return JSONResponse({"id": job.id, "object": "chat.completion" if chat else "text_completion",
                         "created": job.created, "model": job.model, "choices": choices,
                         "usage": _usage(job, completion_tokens)})


def _usage(job: _Job, completion_tokens: int) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens``: prompt tokens not evaluated (found in the prefix cache)."""
    stats = job.streams[0].stats if job.streams else None
    cached = min(stats.cached_tokens, job.prompt_tokens) if stats is not None else 0
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": job.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _cancel_on_disconnect(request: HttpRequest, scope: anyio.CancelScope) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def _events(job: _Job, state: _State, req: Request) -> AsyncIterator[str]:
    """Server-sent events. A client that disconnects cancels this generator, and with it the
    generation, within a decode step."""
    kind = "chat.completion.chunk" if job.chat else "text_completion"

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        payload = {"id": job.id, "object": kind, "created": job.created, "model": job.model,
                   "choices": choices, **extra}
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    completion_tokens = 0
    try:
        if job.chat:
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                         for i in range(len(job.streams))])
        error: AiollamaError | None = None
        async with _items(job, state) as items:
            async for i, item in items:
                if isinstance(item, AiollamaError):
                    error = item
                    break
                if item is None:
                    for delta in job.choices[i].finish(job.streams[i].finish_reason):
                        yield event([delta])
                else:
                    completion_tokens += len(item.tokens)
                    for delta in job.choices[i].feed(item):
                        yield event([delta])
        if error is not None:
            yield f"data: {json.dumps(_translate(error).body())}\n\n"
        if req.include_usage:
            yield event([], usage=_usage(job, completion_tokens))
        yield "data: [DONE]\n\n"
    finally:
        with anyio.CancelScope(shield=True):
            await job.close()
