"""Many models behind one URL, as llama-server's router mode: each request goes to the model its
``model`` field names (a GET's ``?model=``, a stored response's id), loaded on first use.

Every model is served by an app of its own (``create_app`` over the engine a
:class:`~aiollama.ModelSet` opened), with every route and API of a single-model server; the router
reads a request's body once, finds the model, holds it for the request (so that it is never closed
under a stream), and hands the request on. The router itself answers ``/health``, the model list
(``/models``, ``/v1/models``, with each model's state), ``/models/load`` and ``/models/unload`` in
llama-server's shape, and ``/metrics`` with every loaded model's series labelled by model.

An idle model is closed after its keep-alive (``--keep-alive``; Ollama's ``keep_alive`` field of a
request sets it for that model from then on), and the least recently used idle one makes room
past ``--models-max``. A model's stored responses go with it when it closes.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import Message, Receive, Scope, Send

from aiollama import Engine, ModelEntry, ModelSet, ModelStatus
from aiollama.errors import AiollamaError, ModelBusy, UnknownModel
from aiollama.server.bad_request import BadRequest
from aiollama.server.cors import Cors, CorsMiddleware
from aiollama.server.guard import Guard, Limits
from aiollama.server.responses import replica_of
from aiollama.server.state import translate

# llama-server's native routes answer errors in its own shape, the Messages API in Anthropic's
NATIVE_PATHS = ("/completion", "/completions", "/infill", "/embedding", "/props", "/tokenize", "/detokenize",
                "/apply-template", "/rerank", "/reranking", "/v1/rerank", "/v1/reranking")
LOCAL_PAGES = Cors()  # CORS for pages served from this machine, as a single-model server's default
RESPONSE_PATH = re.compile(r"(?:/v1)?/responses/([^/]+)(?:/cancel)?")
DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)?")


@dataclass
class _Child:
    """One model's app, while its engine is loaded."""

    app: Starlette
    engine: Engine
    ready: anyio.Event = field(default_factory=anyio.Event)
    stop: anyio.Event = field(default_factory=anyio.Event)


def keep_alive_seconds(value: Any) -> float:
    """Ollama's ``keep_alive``: seconds, or a duration ("10m", "1h", "30s"); negative: forever."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = DURATION.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise BadRequest("'keep_alive' must be seconds or a duration such as '5m'", param="keep_alive")
    return float(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[match.group(2)]


class Router:
    """The models and their apps. ``app_options`` go to each model's ``create_app``, under the
    model's own in ``model_options``."""

    def __init__(self, entries: list[ModelEntry], *, app_options: dict[str, Any],
                 model_options: dict[str, dict[str, Any]] | None = None, api_keys: tuple[str, ...] = (),
                 limits: Limits | None = None, public_metrics: bool = False, max_loaded: int = 4,
                 memory_bytes: int | None = None, keep_alive: float = 300.0, autoload: bool = True) -> None:
        self.models = ModelSet(entries, max_loaded=max_loaded, memory_bytes=memory_bytes, keep_alive=keep_alive,
                               autoload=autoload, conversations_hold=False, on_close=self._closed)
        self.replicas = {entry.name: f"m{i}" for i, entry in enumerate(entries)}
        self.app_options = {**app_options, "api_keys": api_keys, "limits": limits, "public_metrics": public_metrics,
                            "cors": None}
        self.model_options = model_options or {}
        self.guard = Guard(api_keys, limits or Limits(), public_metrics)
        self.children: dict[str, _Child] = {}
        self._tg: anyio.abc.TaskGroup | None = None

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with self.models, anyio.create_task_group() as tg:
            self._tg = tg
            try:
                yield
            finally:
                for child in self.children.values():
                    child.stop.set()
                self._tg = None

    async def close_engine(self) -> None:
        """Close every loaded model's engine: what still runs ends with an error (the end of the
        grace period on shutdown)."""
        await self.models.close_all()

    def _closed(self, name: str) -> None:
        child = self.children.pop(name, None)
        if child is not None:
            child.stop.set()  # its stored responses go with it

    async def _child(self, name: str, engine: Engine) -> _Child:
        """The app serving ``name`` over ``engine``, started on first use."""
        from aiollama.server.app import create_app

        child = self.children.get(name)
        if child is not None and child.engine is engine:
            await child.ready.wait()
            return child
        if child is not None:
            child.stop.set()
        options = {**self.app_options, "model_name": name, **self.model_options.get(name, {})}
        child = _Child(create_app(engine=engine, replica=self.replicas[name], **options), engine)
        self.children[name] = child
        assert self._tg is not None

        async def host() -> None:
            async with child.app.router.lifespan_context(child.app):
                child.ready.set()
                await child.stop.wait()
        self._tg.start_soon(host)
        await child.ready.wait()
        return child

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the request's body, find its model, and hand the request to that model's app."""
        request = HttpRequest(scope, receive)
        path = scope["path"]
        try:
            self.guard.identify(request, "models")
            body = b""
            async for chunk in request.stream():
                body += chunk
                if len(body) > self.guard.limits.max_body_bytes:
                    raise BadRequest(f"the request body is larger than {self.guard.limits.max_body_bytes} bytes",
                                     status=413, code="request_too_large")
            name, keep_alive, body = self._model_of(request, path, body)
            autoload = request.query_params.get("autoload")
            async with self.models.use(name, keep_alive=keep_alive,
                                       autoload=None if autoload is None else autoload == "true") as engine:
                child = await self._child(self.models.entry(name).name, engine)
                sent = False

                async def replay() -> Message:
                    nonlocal sent
                    if sent:
                        return await receive()  # the disconnect, when it comes
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await child.app(scope, replay, send)
        except (BadRequest, AiollamaError) as raised:
            response = _error(raised, path)
            await response(scope, receive, send)

    def _model_of(self, request: HttpRequest, path: str, body: bytes) -> tuple[str, float | None, bytes]:
        """(the model a request names, its keep_alive, its body without the router's own fields)."""
        name: Any = request.query_params.get("model")
        keep_alive = None
        if body:
            try:
                fields = json.loads(body)
            except ValueError:
                raise BadRequest("the request body is not valid JSON") from None
            if isinstance(fields, dict):
                name = fields.get("model", name)
                if "keep_alive" in fields:
                    keep_alive = keep_alive_seconds(fields.pop("keep_alive"))
                    body = json.dumps(fields).encode()
        found = RESPONSE_PATH.fullmatch(path)
        if name is None and found is not None:  # a stored response: its id names the model's app
            replica = replica_of(found.group(1))
            name = next((n for n, r in self.replicas.items() if r == replica), None)
            if name is None:
                raise BadRequest(f"no stored response '{found.group(1)}'", status=404, code="not_found")
        if name is None and len(self.replicas) == 1:
            name = next(iter(self.replicas))
        if not isinstance(name, str):
            raise BadRequest("'model' is required: this server serves several models (see /v1/models)",
                             param="model")
        return name, keep_alive, body


def _error(raised: BadRequest | AiollamaError, path: str) -> Response:
    if isinstance(raised, UnknownModel):
        exc = BadRequest(str(raised), status=404, param="model", code="model_not_found")
    elif isinstance(raised, ModelBusy):
        exc = BadRequest(str(raised), status=409, param="model", code="model_busy")
    else:
        exc = raised if isinstance(raised, BadRequest) else translate(raised)
    body = exc.anthropic_body() if path.startswith("/v1/messages") else \
        exc.llama_body() if path in NATIVE_PATHS else exc.body()
    return JSONResponse(body, status_code=exc.status)


def create_router(entries: list[ModelEntry], *, app_options: dict[str, Any] | None = None,
                  model_options: dict[str, dict[str, Any]] | None = None, api_keys: tuple[str, ...] = (),
                  limits: Limits | None = None, public_metrics: bool = False, cors: Cors | None = LOCAL_PAGES,
                  max_loaded: int = 4, memory_bytes: int | None = None, keep_alive: float = 300.0,
                  autoload: bool = True) -> Starlette:
    """The app serving ``entries`` behind one URL (see the module's text). ``app_options`` are
    ``create_app``'s, for every model, under each model's own in ``model_options``."""
    router = Router(entries, app_options=app_options or {}, model_options=model_options, api_keys=api_keys, limits=limits,
                    public_metrics=public_metrics, max_loaded=max_loaded, memory_bytes=memory_bytes,
                    keep_alive=keep_alive, autoload=autoload)
    routes = [*_routes(router), Mount("/", app=router.dispatch)]
    app = Starlette(routes=routes, lifespan=router.lifespan)
    app.router.redirect_slashes = False
    app.state.router = app.state.aiollama = router  # run.serve closes the engines after the grace period
    if cors is not None:
        app.add_middleware(CorsMiddleware, cors=cors)
    return app


def _routes(router: Router) -> list[Route]:
    """The router's own routes: health, the model list, loading and unloading, and metrics."""
    def route(path: str, name: str, handler: Callable[[HttpRequest], Awaitable[Response]],
              method: str = "GET") -> Route:
        async def endpoint(request: HttpRequest) -> Response:
            try:
                router.guard.identify(request, name)
                return await handler(request)
            except (BadRequest, AiollamaError) as raised:
                return _error(raised, request.url.path)
        return Route(path, endpoint, methods=[method])

    async def health(request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def listing(request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(status) for status in router.models.status()]})

    async def load(request: HttpRequest) -> Response:
        await router.models.load(await _named(router, request))
        return JSONResponse({"success": True})

    async def unload(request: HttpRequest) -> Response:
        name = await _named(router, request)
        wait = request.query_params.get("wait", "true") != "false"
        return JSONResponse({"success": await router.models.unload(name, wait=wait)})

    async def metrics(request: HttpRequest) -> Response:
        return Response(model_metrics(router), media_type="text/plain; version=0.0.4; charset=utf-8")

    return [route("/health", "health", health), route("/v1/health", "health", health),
            route("/models", "models", listing), route("/v1/models", "models", listing),
            route("/models/load", "models", load, "POST"), route("/models/unload", "models", unload, "POST"),
            route("/metrics", "metrics", metrics)]


async def _named(router: Router, request: HttpRequest) -> str:
    body = await router.guard.read_json(request)
    name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str):
        raise BadRequest("'model' must be given, a string", param="model")
    return router.models.entry(name).name


def _model_card(status: ModelStatus) -> dict[str, Any]:
    """A model in the list: OpenAI's fields, llama-server's ``status`` and ``path``, and its
    aliases, kind, size and keep-alive."""
    card: dict[str, Any] = {"id": status.name, "object": "model", "created": 0, "owned_by": "aiollama",
                            "path": str(status.path), "aliases": list(status.aliases), "status": {"value": status.state},
                            "kind": status.kind, "bytes": status.bytes, "in_use": status.users, "loads": status.loads}
    if status.load_seconds is not None:
        card["load_seconds"] = round(status.load_seconds, 3)
    if status.expires_in is not None:
        card["expires_in"] = round(status.expires_in, 3)
    return card


def model_metrics(router: Router) -> str:
    """Every loaded model's metrics, each series labelled with its model, grouped by family as the
    text format asks; and whether each model is loaded."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for name, child in list(router.children.items()):
        label = _label(name)
        family: tuple[list[str], list[str]] = ([], [])
        for line in generate_latest(child.app.state.aiollama.metrics.registry).decode().splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = families.setdefault(line.split()[2], ([], []))
                if line not in family[0]:
                    family[0].append(line)
            elif line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                series = series[:-1] + "," + label + "}" if series.endswith("}") else series + "{" + label + "}"
                family[1].append(series + " " + value)
    lines = [line for headers, samples in families.values() for line in (*headers, *samples)]
    lines += ["# HELP aiollama_model_loaded whether the model is loaded", "# TYPE aiollama_model_loaded gauge"]
    lines += [f'aiollama_model_loaded{{{_label(s.name)}}} {int(s.state == "loaded")}' for s in router.models.status()]
    return "\n".join(lines) + "\n"


def _label(name: str) -> str:
    """``model="name"``, escaped as the text format asks (a model named by a file may hold anything)."""
    return 'model="' + name.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') + '"'
