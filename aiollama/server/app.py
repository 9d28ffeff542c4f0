"""An OpenAI-compatible ASGI app (Starlette) over one Engine.

``create_app(model)`` owns an engine for its lifespan; ``create_app(engine=engine)`` serves an
engine the caller owns, so the app can be mounted in a larger service. ``n`` choices are forks of
one conversation and share its prompt's KV cells.
"""

from __future__ import annotations

import base64
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aiollama import Engine
from aiollama.errors import (
    AiollamaError,
)
from aiollama.formats.chat import REASONING_FORMATS
from aiollama.models import default_model
from aiollama.sampling import SamplingParams
from aiollama.server import messages, responses
from aiollama.server.generate import chat_completions, completions
from aiollama.server.guard import Guard, Limits, load_keys
from aiollama.server.requests import (
    BadRequest,
    embeddings_request,
)
from aiollama.server.state import State, serving_engine, translate
from aiollama.server.utility import apply_template, detokenize, tokenize


def create_app(model: str | os.PathLike[str] | None = None, *, engine: Engine | None = None,
               model_name: str | None = None, retry_after: int = 1, api_keys: Iterable[str] = (),
               limits: Limits | None = None, public_metrics: bool = False, reasoning_budget: int | None = None,
               reasoning_budget_message: str = "", fetch_images: bool = False, reasoning_format: str = "auto",
               **engine_options: Any) -> Starlette:
    """The app. ``engine_options`` go to :class:`Engine` when the app owns its engine.

    With ``api_keys`` (or keys in ``$AIOLLAMA_API_KEY``, comma-separated) every route but
    ``/health`` (and ``/metrics`` when ``public_metrics``) needs one of them; ``limits`` bound the
    body, its nesting and the requests in flight per key (:class:`~aiollama.server.guard.Limits`).
    ``reasoning_budget`` (and its message) and ``reasoning_format`` (llama-server's: how a reply's
    thinking is returned) apply to every request that gives none.
    ``fetch_images``: image_url parts may name http(s) URLs, which the server fetches.
    """
    if engine is not None and (model is not None or engine_options):
        raise ValueError("pass either an engine or the model and options to build one, not both")
    path = None if model is None else Path(model)
    name = model_name or (path.stem if path is not None else "")
    guard = Guard(load_keys(api_keys), limits or Limits(), public_metrics)
    if reasoning_format not in REASONING_FORMATS:
        raise ValueError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}")
    state = State(model_name=name, retry_after=retry_after, engine=engine, owns_engine=engine is None, guard=guard,
                  fetch_images=fetch_images, reasoning_format=reasoning_format)
    if reasoning_budget is not None:
        SamplingParams(reasoning_budget=reasoning_budget, reasoning_budget_message=reasoning_budget_message)  # checks
        state.defaults.update(reasoning_budget=reasoning_budget, reasoning_budget_message=reasoning_budget_message)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if engine is not None:
            try:
                yield
            finally:
                state.responses.close()  # the stored conversations go with the app
            return
        model_path = path if path is not None else await anyio.to_thread.run_sync(default_model)
        async with Engine(model_path, **engine_options) as owned:
            state.engine = owned
            try:
                yield
            finally:
                state.responses.close()
                state.engine = None

    routes = [
        Route("/health", _endpoint(state, "health", _health), methods=["GET"]),
        Route("/metrics", _endpoint(state, "metrics", _metrics), methods=["GET"]),
        Route("/v1/models", _endpoint(state, "models", _models), methods=["GET"]),
        Route("/v1/completions", _endpoint(state, "completions", completions), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(state, "chat", chat_completions), methods=["POST"]),
        Route("/v1/embeddings", _endpoint(state, "embeddings", _embeddings), methods=["POST"]),
        Route("/v1/responses", _endpoint(state, "responses", responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", _endpoint(state, "responses", responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{response_id}", _endpoint(state, "responses", responses.delete), methods=["DELETE"]),
        Route("/v1/messages", _endpoint(state, "messages", messages.create, messages.error_body), methods=["POST"]),
        Route("/v1/messages/count_tokens", _endpoint(state, "messages", messages.count_tokens, messages.error_body),
              methods=["POST"]),
        Route("/tokenize", _endpoint(state, "tokenize", tokenize), methods=["POST"]),
        Route("/detokenize", _endpoint(state, "detokenize", detokenize), methods=["POST"]),
        Route("/apply-template", _endpoint(state, "apply_template", apply_template), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.aiollama = state
    return app


Handler = Callable[[State, HttpRequest], Awaitable[Response]]


def _endpoint(state: State, name: str, handler: Handler,
              shape: Callable[[BadRequest], dict[str, Any]] = BadRequest.body) -> Callable[[HttpRequest], Awaitable[Response]]:
    """``handler`` as a route: its key checked, its refusals answered in ``shape`` (OpenAI's error
    object unless the API has its own), counted in the metrics."""
    async def endpoint(request: HttpRequest) -> Response:
        try:
            request.state.api_key = state.guard.identify(request, name)
            response = await handler(state, request)
        except BadRequest as exc:
            headers = {"Retry-After": str(state.retry_after)} if exc.status == 503 else None
            response = JSONResponse(shape(exc), status_code=exc.status, headers=headers)
        state.metrics.requests.labels(name, str(response.status_code)).inc()
        return response
    return endpoint


async def _health(state: State, request: HttpRequest) -> Response:
    serving_engine(state)
    return JSONResponse({"status": "ok"})


async def _metrics(state: State, request: HttpRequest) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _models(state: State, request: HttpRequest) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": state.name(), "object": "model", "created": 0, "owned_by": "aiollama"}]})


async def _embeddings(state: State, request: HttpRequest) -> Response:
    """``/v1/embeddings``: ``input`` is a string, a list of them, or token ids; ``encoding_format``
    "float" or "base64" (little-endian float32, as OpenAI's clients decode it)."""
    texts, encoding = embeddings_request(await state.guard.read_json(request))
    engine = serving_engine(state)
    try:
        vectors = await engine.embed(texts)
        n_tokens = sum(len(engine.tokenize(t, add_special=True)) if isinstance(t, str) else len(t) for t in texts)
    except AiollamaError as exc:
        raise translate(exc) from None
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if encoding == "base64" else v}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": state.name(),
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})
