"""llama-server's native endpoints: ``/completion`` (and ``/completions``), ``/infill``,
``/embedding`` (and ``/embeddings``), ``/props``, in its documented shapes
(``tools/server/README.md`` of llama.cpp). Each prompt is a conversation of its own (``n_cmpl``
of them forks sharing its cells); the prefix cache is every slot's, so ``id_slot`` picks nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from aiollama import Conversation, Engine, SamplingParams, Stream
from aiollama.errors import AiollamaError
from aiollama.formats.messages import IMAGE
from aiollama.sampling import seed_for
from aiollama.server.bad_request import BadRequest
from aiollama.server.generate import stream_items
from aiollama.server.llama_shape import (
    BUILD_INFO,
    NOT_IN_PROPS,
    SAMPLERS,
    Clock,
    Outcome,
    final_result,
    generation_settings,
    partial_result,
    pick_fields,
    probabilities,
)
from aiollama.server.native_request import (
    INFILL_FIELDS,
    NATIVE_FIELDS,
    Native,
    native_prompts,
    native_request,
)
from aiollama.server.neutral_request import json_object
from aiollama.server.openai_request import MAX_PROMPTS
from aiollama.server.opening import data_event, event_stream, while_connected
from aiollama.server.state import State, lora_names, serving_engine, translate


async def completion(state: State, request: HttpRequest) -> Response:
    """``/completion``: ``prompt`` as text, token ids, both mixed, or a list of prompts."""
    body = json_object(await state.guard.read_json(request), NATIVE_FIELDS)
    engine = serving_engine(state)
    native = _parse(state, engine, body)
    try:
        prompts = native_prompts(body.get("prompt"), lambda text, first: engine.tokenize(
            text, add_special=first, special=True), engine.tokenizer.check_token, MAX_PROMPTS // native.n_cmpl)
    except AiollamaError as exc:
        raise translate(exc) from None
    return await _serve(state, request, engine, native, prompts)


async def infill(state: State, request: HttpRequest) -> Response:
    """``/infill``: ``input_prefix``, ``input_suffix``, ``input_extra`` (other files' chunks) and
    ``prompt`` (text after the prefix), in the model's fill-in-the-middle tokens."""
    body = json_object(await state.guard.read_json(request), INFILL_FIELDS)
    engine = serving_engine(state)
    fim = engine.fim_tokens
    missing = [name for name in ("prefix", "suffix", "middle") if fim[name[:3]] < 0]
    if missing:
        raise BadRequest(f"Infill is not supported by this model: no {', '.join(missing)} token", status=501)
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise BadRequest(f"'{name}' is required", param=name)
    prompt, extra = body.get("prompt", ""), body.get("input_extra", [])
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string", param="prompt")
    if not isinstance(extra, list):
        raise BadRequest("'input_extra' must be a list of {'filename', 'text'} chunks", param="input_extra")
    native = _parse(state, engine, body)
    n_predict = state.defaults.get("max_tokens")  # the server's, as llama-server sizes the extra chunks by
    try:
        tokens = engine.infill_tokens(body["input_prefix"], body["input_suffix"], extra=extra, prompt=prompt,
                                      n_predict=-1 if n_predict is None else n_predict)
    except AiollamaError as exc:
        raise translate(exc) from None
    return await _serve(state, request, engine, native, [tokens])


def _parse(state: State, engine: Engine, body: dict[str, Any]) -> Native:
    try:
        return native_request(body, n_slots=engine.config.n_seq_max, tokenize=engine.tokenize)
    except AiollamaError as exc:
        raise translate(exc) from None


@dataclass
class _Task:
    """One completion of a native request: its conversation, stream and clock."""

    index: int
    conv: Conversation
    stream: Stream
    prompt: list[int]
    clock: Clock
    predicted: int = 0


async def _serve(state: State, request: HttpRequest, engine: Engine, native: Native,
                 prompts: list[list[int]]) -> Response:
    key: str = getattr(request.state, "api_key", "")
    release = state.guard.hold(key)
    try:
        params = state.params(native.params, base={"max_tokens": None})
        adapters = lora_names(engine, native.lora)
        try:
            sampling = SamplingParams(**params)
        except AiollamaError as exc:
            raise translate(exc) from None
        settings = generation_settings(
            sampling, stream=native.stream, n_probs=native.n_probs, samplers=native.samplers or SAMPLERS,
            timings_per_token=native.timings_per_token, backend_sampling=engine.config.backend_sampling,
            speculative=engine.config.draft_model is not None or bool(engine.config.draft_tokens),
            tuning=native.settings, lora=[{"id": list(engine.config.lora).index(name), "scale": scale}
                                          for name, scale in adapters.items()])
        tasks = _start(engine, native, prompts, params, adapters)
    except BaseException:
        release()
        raise
    started = time.perf_counter()

    async def close() -> None:
        release()
        for task in tasks:
            await task.conv.aclose()

    answer = _Answer(state, engine, native, settings, tasks, started)
    if native.stream:
        return event_stream(answer.events(close))
    error: AiollamaError | None = None

    async def whole(task: _Task) -> None:
        nonlocal error
        try:
            await task.stream.rest()
        except AiollamaError as exc:
            error = error or exc

    async def every() -> None:
        async with anyio.create_task_group() as each:
            for task in tasks:
                each.start_soon(whole, task)

    try:
        finished = await while_connected(request, every)
    finally:
        with anyio.CancelScope(shield=True):
            await close()
    if error is not None:
        raise translate(error)
    if not finished:
        return Response(status_code=499)  # the client went away; nobody reads this
    results = [await answer.final(task) for task in tasks]
    return JSONResponse(results[0] if len(results) == 1 else results)


def _start(engine: Engine, native: Native, prompts: list[list[int]], params: dict[str, Any],
           adapters: dict[str, float]) -> list[_Task]:
    """A conversation per prompt (``n_cmpl`` forks of it), each streaming."""
    salt = uuid.uuid4().hex if native.fresh else native.cache_salt  # cache_prompt false: no prefix is shared
    tasks: list[_Task] = []
    try:
        for tokens in prompts:
            if len(tokens) >= engine.n_ctx:
                raise BadRequest(f"the request exceeds the available context size: {len(tokens)} prompt tokens, "
                                 f"a context of {engine.n_ctx}", code="context_length_exceeded",
                                 extra={"n_prompt_tokens": len(tokens), "n_ctx": engine.n_ctx})
            root = engine.conversation(cache_salt=salt, lora=adapters)
            root.prompt(tokens)
            convs = [root] if native.n_cmpl == 1 else [root.fork() for _ in range(native.n_cmpl)]
            if native.n_cmpl > 1:
                root.close_nowait()  # the forks hold what they need
            for conv in convs:
                index = len(tasks)
                seeded = dict(params)
                if "seed" in seeded:
                    seeded["seed"] = seed_for(seeded["seed"], index)
                tasks.append(_Task(index, conv, conv.stream(**seeded), tokens, Clock()))
    except BaseException as exc:
        for task in tasks:
            task.conv.close_nowait()
        if isinstance(exc, AiollamaError):
            raise translate(exc) from None
        raise
    return tasks


class _Answer:
    """The results of a native request: whole, or as llama-server's server-sent events."""

    def __init__(self, state: State, engine: Engine, native: Native, settings: dict[str, Any], tasks: list[_Task],
                 started: float) -> None:
        self.state, self.engine, self.native, self.settings = state, engine, native, settings
        self.tasks, self.started = tasks, started
        self.id_slot = -1  # no slot is chosen here: every request is a conversation of its own

    async def final(self, task: _Task) -> dict[str, Any]:
        done = await task.stream  # ended: what it gave, at once
        outcome = Outcome(done.text, list(done.tokens), done.finish_reason, done.stop_sequence, done.stats,
                          task.stream.truncated, list(done.logprobs))
        task.clock.predicted = len(done.tokens)
        result = final_result(outcome, index=task.index, id_slot=self.id_slot, model=self.state.name(),
                              prompt=self.engine.detokenize(task.prompt, special=True), n_prompt=len(task.prompt),
                              settings=self.settings, clock=task.clock, token_bytes=self.engine.token_bytes,
                              return_tokens=self.native.return_tokens, stream=self.native.stream,
                              n_probs=self.native.n_probs)
        return result if self.native.response_fields is None else pick_fields(result, self.native.response_fields)

    async def events(self, close: Any) -> AsyncIterator[str]:
        """Server-sent events: a chunk per step (and per progress report with ``return_progress``),
        then each task's final result; an error event if the engine fails."""
        native = self.native

        try:
            async with stream_items([t.stream for t in self.tasks], self.started, self.state) as items:
                async for i, item in items:
                    task = self.tasks[i]
                    if isinstance(item, AiollamaError):
                        yield data_event(translate(item).llama_body())
                        break
                    if item is None:
                        yield data_event(await self.final(task))
                        continue
                    if item.progress is not None:
                        progress = task.clock.progress(item.progress)
                        if native.return_progress:
                            yield data_event(partial_result(
                                index=task.index, id_slot=self.id_slot, text="", tokens=[], n_predicted=0,
                                n_prompt=len(task.prompt), progress=progress,
                                timings=task.clock.timings() if native.timings_per_token else None))
                        continue
                    task.clock.tokens(len(item.tokens))
                    task.predicted += len(item.tokens)
                    probs = probabilities(item.logprobs, self.engine.token_bytes) if native.n_probs else None
                    yield data_event(partial_result(
                        index=task.index, id_slot=self.id_slot, text=item.text, tokens=list(item.tokens),
                        n_predicted=task.predicted, n_prompt=len(task.prompt), probs=probs,
                        timings=task.clock.timings() if native.timings_per_token else None))
        finally:
            with anyio.CancelScope(shield=True):
                await close()


def props(state: State, engine: Engine) -> dict[str, Any]:
    """``/props``: the model, the context, the chat template and the default sampling settings."""
    sampling = SamplingParams(**state.params({}, base={"max_tokens": None}))
    params = generation_settings(sampling, stream=False, n_probs=0, backend_sampling=engine.config.backend_sampling,
                                 speculative=engine.config.draft_model is not None or bool(engine.config.draft_tokens))
    for name in NOT_IN_PROPS:
        params.pop(name)
    tokenizer, info, template = engine.tokenizer, engine.model_info, engine.chat_template
    return {
        "default_generation_settings": {"params": params, "n_ctx": engine.n_ctx},
        "total_slots": engine.config.n_seq_max, "model_alias": state.name(), "model_ftype": str(info["ftype"]),
        "model_path": str(engine.model_path or ""),
        "modalities": {"vision": engine.config.mmproj is not None, "video": False, "audio": False},
        "media_marker": IMAGE, "endpoint_slots": False, "endpoint_props": state.props_writable,
        "endpoint_metrics": True, "ui": False, "ui_settings": {}, "chat_template": template.source,
        "chat_template_caps": template.caps,
        "bos_token": tokenizer.piece(tokenizer.bos).decode("utf-8", "replace") if tokenizer.bos >= 0 else "",
        "eos_token": tokenizer.piece(tokenizer.eos).decode("utf-8", "replace") if tokenizer.eos >= 0 else "",
        "build_info": BUILD_INFO, "is_sleeping": False, "cors_proxy_enabled": False}


async def get_props(state: State, request: HttpRequest) -> Response:
    return JSONResponse(props(state, serving_engine(state)))


async def post_props(state: State, request: HttpRequest) -> Response:
    """llama-server changes nothing here either; it answers only when started with ``--props``."""
    await state.guard.read_json(request)
    if not state.props_writable:
        raise BadRequest("This server does not support changing global properties. Start it with `--props`",
                         status=501)
    return JSONResponse({"success": True})
