"""An OpenAI-compatible ASGI app (Starlette) over one Engine.

``create_app(model)`` owns an engine for its lifespan; ``create_app(engine=engine)`` serves an
engine the caller owns, so the app can be mounted in a larger service. ``n`` choices are forks of
one conversation and share its prompt's KV cells.
"""

from __future__ import annotations

import logging
import os
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
from aiollama.errors import AiollamaError
from aiollama.formats.chat import REASONING_FORMATS
from aiollama.models import default_model
from aiollama.sampling import SamplingParams
from aiollama.server import embeddings, messages, native, rerank, responses
from aiollama.server.background import Runs
from aiollama.server.bad_request import BadRequest
from aiollama.server.cors import Cors, CorsMiddleware
from aiollama.server.fetch import Fetcher
from aiollama.server.generate import chat_completions, completions
from aiollama.server.guard import Guard, Limits, load_keys
from aiollama.server.prompt_tools import apply_template, detokenize, tokenize
from aiollama.server.response_db import ResponseDB
from aiollama.server.state import State, serving_engine, translate
from aiollama.server.store import SWEEP_SECONDS, ResponseStore, Sizing

# llama-server's routes that mean nothing here, answered as its own disabled endpoints are (501,
# not_supported_error) with the reason: (methods, paths, reason)
NOT_SERVED: tuple[tuple[tuple[str, ...], tuple[str, ...], str], ...] = (
    (("GET", "POST"), ("/slots", "/slots/{id_slot}"),
     "there are no slots here: every request is a conversation of its own, and all share one prefix cache"),
    (("GET", "POST"), ("/lora-adapters",),
     "adapters are loaded with --lora and chosen by each request's 'lora' field, with its scale"),
    (("POST",), ("/audio/transcriptions", "/v1/audio/transcriptions"), "audio models are not served"),
    (("POST",), ("/v1/chat/completions/control",), "a reply's reasoning is ended by its reasoning_budget"),
    (("POST",), ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens", "/responses/input_tokens",
                 "/v1/responses/input_tokens"), "/apply-template gives a chat request's prompt, /tokenize its tokens"),
    (("GET", "POST", "DELETE"), ("/v1/stream", "/v1/streams/lookup"),
     "streams are not kept for a client to come back to"),
    (("POST", "GET", "DELETE"), ("/models/load", "/models/unload"),
     "this server serves one model: --models-dir or --models-preset serves several, loaded and unloaded here"),
    (("GET",), ("/models/sse",), "model loading is not streamed as events: GET /v1/models gives each model's state"),
    (("POST",), ("/v1/systemone",), "not served"),
    (("GET", "POST"), ("/cors-proxy", "/tools"), "server tools and the CORS proxy of llama-server's web UI are not served"),
)
LOCAL_PAGES = Cors()  # CORS for pages served from this machine, llama-server's --cors-origins localhost


def create_app(model: str | os.PathLike[str] | None = None, *, engine: Engine | None = None,
               model_name: str | None = None, retry_after: int = 1, api_keys: Iterable[str] = (),
               limits: Limits | None = None, public_metrics: bool = False, reasoning_budget: int | None = None,
               reasoning_budget_message: str = "", fetch_images: bool = False, fetch_private_addresses: bool = False,
               allowed_media_domains: Iterable[str] = (), reasoning_format: str = "auto",
               sampling: dict[str, Any] | None = None, chat_defaults: dict[str, Any] | None = None,
               embd_normalize: int = 2, cors: Cors | None = LOCAL_PAGES, props_writable: bool = False,
               load_in_background: bool = False, responses_max: int = 256, responses_ttl: float = 3600.0,
               responses_mib: int = 256, responses_db: str | os.PathLike[str] | None = None, replica: str = "",
               **engine_options: Any) -> Starlette:
    """The app. ``engine_options`` go to :class:`Engine` when the app owns its engine.

    With ``api_keys`` (or keys in ``$AIOLLAMA_API_KEY``, comma-separated) every route but
    ``/health`` (and ``/metrics`` when ``public_metrics``) needs one of them; ``limits`` bound the
    body, its nesting and the requests in flight per key (:class:`~aiollama.server.guard.Limits`).
    ``reasoning_budget`` (and its message), ``reasoning_format`` (llama-server's: how a reply's
    thinking is returned), ``sampling`` (stream parameters: llama-server's ``--temp``,
    ``--top-k``, ``-n``...) and ``chat_defaults`` (``chat_template_kwargs``, merged under a
    request's, and ``reasoning_effort``) apply to every request that gives none;
    ``embd_normalize`` is ``/embedding``'s normalisation where a request gives none.
    ``responses_max``, ``responses_ttl`` (seconds) and ``responses_mib`` bound the responses kept
    for ``previous_response_id`` (their conversations' cells and pictures counted), in memory and,
    with ``responses_db`` (an SQLite file), on disk too, where a restart finds them. ``replica``
    names this app among replicas: its response ids carry it, so that a router sends the next turn
    to the replica that holds the conversation.
    ``fetch_images``: image_url parts may name http(s) URLs, which the server fetches from public
    addresses (``fetch_private_addresses``: any), of ``allowed_media_domains`` when given.
    ``cors``: which web pages may call the server (:class:`~aiollama.server.cors.Cors`; localhost
    by default, None: no CORS answer at all). ``props_writable``: ``POST /props`` answers, as
    llama-server's ``--props``. ``load_in_background``: the app answers while its engine loads
    (``/health`` says 503 "Loading model", as llama-server's does), instead of after.

    Every route is served as llama-server serves it: the OpenAI routes with and without ``/v1``,
    and its native ``/completion``, ``/infill``, ``/embedding``, ``/props`` (docs/llama-server.md).
    """
    if engine is not None and (model is not None or engine_options):
        raise ValueError("pass either an engine or the model and options to build one, not both")
    path = None if model is None else Path(model)
    name = model_name or (path.stem if path is not None else "")
    guard = Guard(load_keys(api_keys), limits or Limits(), public_metrics)
    if reasoning_format not in REASONING_FORMATS:
        raise ValueError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}")
    state = State(model_name=name, retry_after=retry_after, engine=engine, owns_engine=engine is None, guard=guard,
                  fetcher=Fetcher(tuple(d.lower().strip(".") for d in allowed_media_domains), fetch_private_addresses)
                  if fetch_images else None, reasoning_format=reasoning_format, props_writable=props_writable,
                  chat_defaults={k: v for k, v in (chat_defaults or {}).items() if v is not None},
                  embd_normalize=embd_normalize, replica=replica,
                  responses=ResponseStore(responses_max, responses_ttl, responses_mib << 20, db=None if responses_db is None
                                          else ResponseDB(responses_db, max_items=responses_max, ttl=responses_ttl,
                                                          max_bytes=responses_mib << 20)),
                  runs=Runs(responses_ttl))
    if replica and not replica.isalnum():
        raise ValueError(f"a replica's name is letters and digits, not {replica!r}")
    unknown = set(state.chat_defaults) - {"chat_template_kwargs", "reasoning_effort"}
    if unknown:
        raise ValueError(f"chat_defaults takes chat_template_kwargs and reasoning_effort, not {sorted(unknown)}")
    if sampling:
        SamplingParams(**sampling)  # checks
        state.defaults.update(sampling)
    if reasoning_budget is not None:
        SamplingParams(reasoning_budget=reasoning_budget, reasoning_budget_message=reasoning_budget_message)  # checks
        state.defaults.update(reasoning_budget=reasoning_budget, reasoning_budget_message=reasoning_budget_message)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async def load() -> None:
            model_path = path if path is not None else await anyio.to_thread.run_sync(default_model)
            owned = Engine(model_path, **engine_options)
            try:
                await owned.start()
            except BaseException as exc:
                state.load_error = exc
                raise
            state.engine = owned
            state.responses.sizing = Sizing.of(owned.model_info)

        async with anyio.create_task_group() as tg:
            tg.start_soon(_sweep, state.responses)
            state.task_group = tg
            try:
                if engine is not None:
                    if engine.serving:
                        state.responses.sizing = Sizing.of(engine.model_info)
                elif load_in_background:
                    tg.start_soon(_logged, load)
                else:
                    await load()
                yield
            finally:
                state.runs.close()  # background responses end with the app
                tg.cancel_scope.cancel()
                state.task_group = None
                state.responses.close()  # the stored conversations go with the app
                if engine is None:
                    owned, state.engine = state.engine, None
                    if owned is not None:
                        with anyio.CancelScope(shield=True):
                            await owned.aclose()

    app = Starlette(routes=_routes(state), lifespan=lifespan,
                    exception_handlers={404: _no_route, 405: _no_route})
    app.router.redirect_slashes = False  # a path with a stray slash is a 404, not a redirect to another route
    app.state.aiollama = state
    if cors is not None:
        app.add_middleware(CorsMiddleware, cors=cors)
    return app


async def _no_route(request: HttpRequest, exc: Exception) -> Response:
    """An unknown path or method, answered as OpenAI does: a JSON error, not a bare page."""
    status = getattr(exc, "status_code", 404)
    what = "Invalid URL" if status == 404 else "Method not allowed"
    return JSONResponse({"error": {"message": f"{what} ({request.method} {request.url.path})",
                                   "type": "invalid_request_error", "param": None, "code": None}}, status_code=status)


async def _sweep(store: ResponseStore) -> None:
    """Expired responses go within a second, their conversations' cells with them."""
    while True:
        await anyio.sleep(SWEEP_SECONDS)
        store.sweep()


async def _logged(load: Callable[[], Awaitable[None]]) -> None:
    """A background load whose failure is told (the app answers 503 with it) but ends nothing."""
    try:
        await load()
    except Exception:
        logging.getLogger("aiollama.server").exception("the model failed to load")


def _routes(state: State) -> list[Route]:
    """Every route, under the names llama-server serves it by: the OpenAI routes with and without
    ``/v1`` (``/completions`` without it is llama-server's native completion, as there)."""
    def route(path: str, name: str, handler: Handler, method: str = "POST",
              shape: Callable[[BadRequest], dict[str, Any]] = BadRequest.body) -> Route:
        return Route(path, _endpoint(state, name, handler, shape), methods=[method])

    llama = BadRequest.llama_body
    routes = [
        route("/health", "health", _health, "GET", llama), route("/v1/health", "health", _health, "GET", llama),
        route("/metrics", "metrics", _metrics, "GET"),
        route("/props", "props", native.get_props, "GET", llama), route("/props", "props", native.post_props, "POST", llama),
        route("/completion", "completion", native.completion, shape=llama),
        route("/completions", "completion", native.completion, shape=llama),
        route("/infill", "infill", native.infill, shape=llama),
        route("/embedding", "embedding", embeddings.native_route, shape=llama),
        route("/embeddings", "embedding", embeddings.either_route, shape=llama),
        route("/tokenize", "tokenize", tokenize), route("/detokenize", "detokenize", detokenize),
        route("/apply-template", "apply_template", apply_template),
        route("/v1/completions", "completions", completions),
        route("/v1/messages", "messages", messages.create, shape=BadRequest.anthropic_body),
        route("/v1/messages/count_tokens", "messages", messages.count_tokens, shape=BadRequest.anthropic_body),
    ]
    for prefix in ("/v1", ""):
        routes += [
            route(f"{prefix}/models", "models", _models, "GET"),
            route(f"{prefix}/chat/completions", "chat", chat_completions),
            route(f"{prefix}/responses", "responses", responses.create),
            route(f"{prefix}/responses/{{response_id}}", "responses", responses.retrieve, "GET"),
            route(f"{prefix}/responses/{{response_id}}", "responses", responses.delete, "DELETE"),
            route(f"{prefix}/responses/{{response_id}}/cancel", "responses", responses.cancel),
        ]
    routes.append(route("/v1/embeddings", "embeddings", embeddings.openai_route))
    routes += [route(path, "rerank", rerank.route) for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")]
    for methods, paths, reason in NOT_SERVED:
        for path in paths:
            routes.append(Route(path, _endpoint(state, "not_served", _refuse(reason), llama), methods=list(methods)))
    return routes


def _refuse(reason: str) -> Handler:
    async def refuse(state: State, request: HttpRequest) -> Response:
        raise BadRequest(f"{request.url.path} is not supported by this server: {reason}", status=501)
    return refuse


Handler = Callable[[State, HttpRequest], Awaitable[Response]]


Endpoint = Callable[[HttpRequest], Awaitable[Response]]


def _endpoint(state: State, name: str, handler: Handler,
              shape: Callable[[BadRequest], dict[str, Any]] = BadRequest.body) -> Endpoint:
    """``handler`` as a route: its key checked, its refusals (and the engine's, a typed error
    whichever route raises it) answered in ``shape`` (OpenAI's error object unless the API has its
    own), counted in the metrics."""
    async def endpoint(request: HttpRequest) -> Response:
        try:
            request.state.api_key = state.guard.identify(request, name)
            response = await handler(state, request)
        except (BadRequest, AiollamaError) as raised:  # an engine's refusal is the client's error too
            exc = raised if isinstance(raised, BadRequest) else translate(raised)
            headers = {"Retry-After": str(state.retry_after)} if exc.status == 503 else None
            response = JSONResponse(shape(exc), status_code=exc.status, headers=headers)
        state.metrics.requests.labels(name, str(response.status_code)).inc()
        return response
    return endpoint


async def _health(state: State, request: HttpRequest) -> Response:
    """``{"status": "ok"}`` while serving; a 503 while the model loads (llama-server's answer) or
    after it failed to."""
    serving_engine(state)
    return JSONResponse({"status": "ok"})


async def _metrics(state: State, request: HttpRequest) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _models(state: State, request: HttpRequest) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": state.name(), "object": "model", "created": 0, "owned_by": "aiollama"}]})
