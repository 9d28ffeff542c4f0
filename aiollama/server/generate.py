"""Completions and chat completions: a request becomes conversations (``n`` forks of one) and
streams, whose chunks are shaped into OpenAI's responses or server-sent events."""

from __future__ import annotations

import json
import random
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from aiollama import Chunk, Conversation, Engine, SamplingParams, Stream, TokenLogprob
from aiollama.errors import AiollamaError
from aiollama.sampling import seed_for
from aiollama.server.chat_request import chat_request
from aiollama.server.llama_shape import (
    BUILD_INFO,
    Clock,
    Outcome,
    final_result,
    generation_settings,
    probabilities,
)
from aiollama.server.native_request import Native, llama_fields
from aiollama.server.neutral_request import ChatRequest, message_text
from aiollama.server.openai_request import completion_request
from aiollama.server.opening import data_event, event_stream, open_route, while_connected
from aiollama.server.shape import ChatChoice, TextChoice, prompt_logprobs
from aiollama.server.state import (
    State,
    check_prompt_size,
    lora_names,
    serving_engine,
    translate,
)


async def completions(state: State, request: HttpRequest) -> Response:
    body = await state.guard.read_json(request)
    return await _serve(state, request, _with_llama_fields(state, body, completion_request(body)), chat=False)


async def chat_completions(state: State, request: HttpRequest) -> Response:
    body = await state.guard.read_json(request)
    return await _serve(state, request, _with_llama_fields(state, body, chat_request(body)), chat=True)


def _with_llama_fields(state: State, body: dict[str, Any], req: ChatRequest) -> ChatRequest:
    """``req`` with the llama.cpp fields of its body (``n_predict`` over ``max_tokens``...)."""
    req.llama = llama_fields(body, n_slots=serving_engine(state).config.n_seq_max)
    req.params.update(req.llama.params)
    return req


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
    llama: Native = field(default_factory=Native)  # llama.cpp's fields of the request
    clocks: list[Clock] = field(default_factory=list)  # each choice's llama-server timings
    verbose: Callable[[int, Any], dict[str, Any]] | None = None  # llama-server's __verbose of a choice
    release: Callable[[], None] = lambda: None  # gives back the request's place in its key's limit

    async def close(self) -> None:
        self.release()
        for conv in self.convs:
            await conv.aclose()


def _start(state: State, req: ChatRequest, chat: bool) -> _Job:
    engine = serving_engine(state)
    texts = [req.prompt] if isinstance(req.prompt, str) else [message_text(m) for m in req.messages or ()]
    check_prompt_size(state, engine, texts, engine.n_ctx)
    root = engine.conversation(cache_salt=req.cache_salt, lora=lora_names(engine, req.lora))
    convs = [root]
    echo: tuple[str, list[int]] | None = None
    try:
        if chat:
            assert req.messages is not None
            n_prompt = root.append_chat(req.messages, **state.chat(req.chat_options(engine)))
        elif req.suffix is not None:  # fill in the middle, between the prompt and the suffix
            assert req.prompt is not None
            middle = engine.infill_tokens(req.prompt, req.suffix, n_predict=req.params.get("max_tokens") or -1)
            root.prompt(middle)
            n_prompt = len(middle)
        else:
            tokens = engine.tokenize(req.prompt, add_special=True) if isinstance(req.prompt, str) else req.prompt
            assert tokens is not None
            root.prompt(tokens)
            n_prompt = len(tokens)
            if req.echo:
                echo = (req.prompt if isinstance(req.prompt, str) else engine.detokenize(tokens), list(tokens))
        if req.n > 1:
            convs = [root.fork() for _ in range(req.n)]  # the choices share the prompt's cells
        streams = []
        for i, conv in enumerate(convs):
            params = state.params(req.params, req.defaults)
            if "seed" in params:
                params["seed"] = seed_for(params["seed"], i)
            streams.append(conv.stream(**params))
        llama = req.llama or Native()
        verbose = _verbose(state, engine, llama, req, streams[0], root) if llama.verbose else None
    except BaseException as exc:
        for conv in {root, *convs}:
            conv.close_nowait()
        if isinstance(exc, AiollamaError):
            raise translate(exc) from None
        raise
    if req.n > 1:
        root.close_nowait()  # the forks hold what they need
    prefix = "chatcmpl-" if chat else "cmpl-"
    choices: list[ChatChoice | TextChoice] = [
        ChatChoice(i, stream.reader, engine.token_bytes) if chat and stream.reader is not None
        else TextChoice(i, engine.token_bytes, echo=echo,
                        scored=_scored(stream) if req.params.get("logprobs") else None)
        for i, stream in enumerate(streams)]
    return _Job(prefix + uuid.uuid4().hex, chat, state.name(), int(time.time()), n_prompt, convs, streams,
                time.perf_counter(), choices, llama, [Clock() for _ in streams], verbose)


def _verbose(state: State, engine: Engine, llama: Native, req: ChatRequest, stream: Stream,
             conv: Conversation) -> Callable[[int, Any], dict[str, Any]]:
    """llama-server's ``__verbose`` of a choice: its native final result, with the prompt as
    evaluated and the sampling settings in force."""
    prompt_tokens = conv.tokens
    settings = generation_settings(SamplingParams(**state.params(req.params, req.defaults)), stream=req.stream,
                                   n_probs=llama.n_probs, timings_per_token=llama.timings_per_token)

    def verbose(index: int, done: Any) -> dict[str, Any]:
        outcome = Outcome(done.text, list(done.tokens), done.finish_reason, done.stop_sequence, done.stats,
                          stream.truncated, list(done.logprobs))
        clock = Clock(predicted=len(done.tokens))
        return final_result(outcome, index=index, id_slot=-1, model=state.name(),
                            prompt=engine.detokenize(prompt_tokens, special=True), n_prompt=len(prompt_tokens),
                            settings=settings,
                            clock=clock, token_bytes=engine.token_bytes, return_tokens=False, stream=False,
                            n_probs=llama.n_probs)
    return verbose


def _scored(stream: Stream) -> Callable[[], list[TokenLogprob]]:
    return lambda: stream.prompt_logprobs


Item = tuple[int, Chunk | AiollamaError | None]


class _Seen:
    """One request's timing metrics as its streams' chunks arrive."""

    def __init__(self, started: float, state: State) -> None:
        self.started = started
        self.metrics = state.metrics
        self.first = True


async def _items(i: int, stream: Stream, seen: _Seen) -> AsyncGenerator[Item, None]:
    """One stream's chunks as (i, chunk); (i, None) when it ends, with its finish reason on the
    stream; (i, error) if it fails."""
    metrics = seen.metrics
    last = 0.0
    try:
        try:
            async for chunk in stream:
                if chunk.tokens:
                    now = time.perf_counter()
                    if seen.first:
                        seen.first = False
                        metrics.time_to_first_token.observe(now - seen.started)
                    if last:
                        for _ in chunk.tokens:  # a chunk of several tokens (a draft taken) shares its gap
                            metrics.inter_token_latency.observe((now - last) / len(chunk.tokens))
                    last = now
                yield i, chunk
        except AiollamaError as exc:
            yield i, exc
        else:
            yield i, None
    finally:
        if stream.stats is not None:
            metrics.queue_time.observe(stream.stats.queue_seconds)
            metrics.e2e_latency.observe(time.perf_counter() - seen.started)


async def _pump(streams: list[Stream], seen: _Seen, send: MemoryObjectSendStream[Item]) -> None:
    """Every stream's items, in arrival order."""

    async def one(i: int, stream: Stream) -> None:
        try:
            async with aclosing(_items(i, stream, seen)) as items:
                async for item in items:
                    await send.send(item)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the response stopped reading: it is closing the job

    async with send, anyio.create_task_group() as tg:
        for i, stream in enumerate(streams):
            tg.start_soon(one, i, stream)


@asynccontextmanager
async def stream_items(streams: list[Stream], started: float, state: State) -> AsyncIterator[AsyncIterator[Item]]:
    """The streams' items as they arrive. One stream is read where they are used (no task and no
    queue between: a hop less a token); several are pumped by tasks that end with the block."""
    seen = _Seen(started, state)
    if len(streams) == 1:
        async with aclosing(_items(0, streams[0], seen)) as items:
            yield items
        return
    send, receive = anyio.create_memory_object_stream[Item](64)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_pump, streams, seen, send)
        async with receive:
            yield receive
        tg.cancel_scope.cancel()


async def _serve(state: State, request: HttpRequest, req: ChatRequest, chat: bool) -> Response:
    job, release = await open_route(state, request, req.messages if chat else None, lambda: _start(state, req, chat))
    job.release = release
    if req.stream:
        return event_stream(_events(job, state, req))
    error: AiollamaError | None = None
    completion_tokens = 0

    async def whole(i: int, stream: Stream) -> None:
        # woken once, at the end: a response nobody reads token by token costs no wake-up per step
        nonlocal error, completion_tokens
        try:
            chunks = await stream.rest()
        except AiollamaError as exc:
            error = error or exc
            return
        for chunk in chunks:
            job.choices[i].feed(chunk)
        n_tokens = sum(len(chunk.tokens) for chunk in chunks)
        job.clocks[i].tokens(n_tokens)
        completion_tokens += n_tokens
        _observe_whole(state, job, stream, n_tokens)

    async def every() -> None:
        async with anyio.create_task_group() as each:
            for i, stream in enumerate(job.streams):
                each.start_soon(whole, i, stream)

    try:
        finished = await while_connected(request, every)
    finally:
        with anyio.CancelScope(shield=True):
            await job.close()
    if error is not None:
        raise translate(error)
    if not finished:
        return Response(status_code=499)  # the client went away; nobody reads this
    choices = [choice.message(job.streams[i].finish_reason) for i, choice in enumerate(job.choices)]
    body: dict[str, Any] = {"id": job.id, "object": "chat.completion" if chat else "text_completion", "created": job.created,
            "model": job.model, "system_fingerprint": BUILD_INFO, "choices": choices,
            "usage": _usage(job, completion_tokens)}
    body["timings"] = job.clocks[0].timings(job.streams[0].stats)
    if job.llama.n_probs or job.verbose is not None:
        done = [await stream for stream in job.streams]  # ended: what each gave, at once
        if job.llama.n_probs:  # llama-server's shape of the log-probabilities it asks for
            for choice, completion in zip(choices, done):
                choice["logprobs"] = {"content": probabilities(completion.logprobs, job.choices[0].token_bytes)}
        if job.verbose is not None:
            body["__verbose"] = job.verbose(0, done[0])
    if req.prompt_logprobs is not None:  # vLLM's place: beside the choices for chat, in each for completions
        scored = [prompt_logprobs(s.prompt_logprobs, job.choices[0].token_bytes, req.prompt_logprobs)
                  for s in job.streams]
        if chat:
            body["prompt_logprobs"] = scored[0]
        else:
            for choice, rows in zip(choices, scored):
                choice["prompt_logprobs"] = rows
    return JSONResponse(body)


def _observe_whole(state: State, job: _Job, stream: Stream, n_tokens: int) -> None:
    """The latency histograms of a choice that was not streamed, from its stats: each gap
    between its tokens is taken as their mean (their sum and count are exact)."""
    stats = stream.stats
    if stats is None:
        return
    metrics = state.metrics
    if stream is job.streams[0]:
        metrics.time_to_first_token.observe(stats.time_to_first_token)
    gaps = n_tokens - 1
    for _ in range(gaps):
        metrics.inter_token_latency.observe(stats.decode_seconds / gaps)
    metrics.queue_time.observe(stats.queue_seconds)
    metrics.e2e_latency.observe(time.perf_counter() - job.started)


def _usage(job: _Job, completion_tokens: int) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens``: prompt tokens not evaluated (found in the prefix cache)."""
    stats = job.streams[0].stats if job.streams else None
    cached = min(stats.cached_tokens, job.prompt_tokens) if stats is not None else 0
    usage = {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": job.prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
    if job.chat:  # of the completion tokens, those the replies thought in
        thought = sum(c.reasoning_tokens for c in job.choices if isinstance(c, ChatChoice))
        usage["completion_tokens_details"] = {"reasoning_tokens": thought}
    return usage


async def _events(job: _Job, state: State, req: ChatRequest) -> AsyncIterator[str]:
    """Server-sent events. A client that disconnects cancels this generator, and with it the
    generation, within a decode step."""
    kind = "chat.completion.chunk" if job.chat else "text_completion"

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        payload = {"id": job.id, "object": kind, "created": job.created, "model": job.model,
                   "system_fingerprint": BUILD_INFO, "choices": choices, **extra}
        if req.include_usage:  # OpenAI's: every chunk has usage, null but in the last
            payload.setdefault("usage", None)
        if req.obfuscate:  # padding that hides the length of what a chunk carries
            payload["obfuscation"] = secrets.token_urlsafe(random.randint(1, 24))[:random.randint(1, 32)]
        return data_event(payload)

    completion_tokens = 0
    # the scored prompt goes out with each choice's first event (once, beside the choices, for chat)
    unscored = set() if req.prompt_logprobs is None else ({0} if job.chat else set(range(len(job.streams))))
    try:
        if job.chat:
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                         for i in range(len(job.streams))])
        error: AiollamaError | None = None
        async with stream_items(job.streams, job.started, state) as items:
            async for i, item in items:
                if isinstance(item, AiollamaError):
                    error = item
                    break
                if i in unscored:
                    unscored.discard(i)
                    assert req.prompt_logprobs is not None
                    rows = prompt_logprobs(job.streams[i].prompt_logprobs, job.choices[i].token_bytes,
                                           req.prompt_logprobs)
                    yield (event([], prompt_logprobs=rows) if job.chat else event(
                        [{"index": i, "text": "", "logprobs": None, "finish_reason": None, "prompt_logprobs": rows}]))
                llama, clock = job.llama, job.clocks[i]
                if item is None:
                    extra: dict[str, Any] = {"timings": clock.timings(job.streams[i].stats)}
                    if job.verbose is not None:
                        extra["__verbose"] = job.verbose(i, await job.streams[i])
                    deltas = job.choices[i].finish(job.streams[i].finish_reason)
                elif item.progress is not None:  # the prompt's evaluation so far
                    progress = clock.progress(item.progress)
                    if not llama.return_progress:
                        continue
                    deltas = [{"index": i, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                               "finish_reason": None} if job.chat else
                              {"index": i, "text": "", "logprobs": None, "finish_reason": None}]
                    extra = {"prompt_progress": progress}
                    if llama.timings_per_token:
                        extra["timings"] = clock.timings()
                else:
                    completion_tokens += len(item.tokens)
                    clock.tokens(len(item.tokens))
                    deltas = job.choices[i].feed(item)
                    if deltas and llama.n_probs and item.logprobs:
                        deltas[-1]["logprobs"] = {"content": probabilities(item.logprobs, job.choices[i].token_bytes)}
                    extra = {"timings": clock.timings()} if llama.timings_per_token else {}
                for k, delta in enumerate(deltas):  # the extra fields go with the last
                    yield event([delta], **(extra if k == len(deltas) - 1 else {}))
        if error is not None:
            yield f"data: {json.dumps(translate(error).body())}\n\n"
        if req.include_usage:
            yield event([], usage=_usage(job, completion_tokens))
        yield "data: [DONE]\n\n"
    finally:
        with anyio.CancelScope(shield=True):
            await job.close()
