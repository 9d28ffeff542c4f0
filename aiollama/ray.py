"""Replicas of the engine on Ray Serve, routed by exact prefix affinity.

``build_app(model, replicas=2)`` is a Serve application: a thin ingress deployment takes every HTTP
request and hands it to one of ``replicas`` engine replicas, each owning one :class:`Engine` and
serving the OpenAI API of :mod:`aiollama.server` in-process (the same routes, answers and errors as
``aiollama serve``). Which replica gets a request is decided by :class:`PrefixAffinityRouter`, a
Ray Serve request router: a request whose conversation so far (its ``user`` field, an
``X-Session-Id`` header, or the exact messages or prompt text before its last part) was served by a
replica goes back to it while that replica has room, so the replica's prefix cache holds its KV;
otherwise it goes to the least loaded replica.

    from ray import serve
    from aiollama.ray import build_app
    serve.run(build_app("model.gguf", replicas=2, n_seq_max=16))

    serve run aiollama.ray:build_app model=model.gguf replicas=2      # the same, from the shell

Ray Serve allows a replica only ``max_ongoing_requests`` requests at a time (5 by default, which
would cap a batch at 5); the replicas here take ``2 * n_seq_max`` unless told otherwise: the
engine's batch, and as many waiting their turn inside it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)
from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from aiollama import Engine, EngineConfig

SESSION_HEADER = "x-session-id"
REPLICA_HEADER = "x-aiollama-replica"  # on every response: the replica that served it
MAX_KEYS = 100_000  # affinity entries a router remembers (least recently used go first)
# the engine's options (EngineConfig's fields), and how ``serve run``'s strings are read for each
ENGINE_OPTIONS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name != "model_path"}


@dataclass
class Forwarded:
    """An HTTP request on its way to a replica, with what the router keys affinity on."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keys: tuple[str, ...] = ()  # affinity keys, the most specific (longest prefix) first
    record: tuple[str, ...] = ()  # the keys this request's conversation will continue from
    holder: str | None = None  # the replica that holds the stored response this request names

    @classmethod
    def of(cls, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> Forwarded:
        lookup, record = affinity_keys(headers, body)
        return cls(method, path, query, headers, body, lookup, record, holder_of(path, body))


def holder_of(path: str, body: bytes) -> str | None:
    """The replica a request must reach: the one that holds the stored response it continues
    (``previous_response_id``), reads or deletes (``/v1/responses/{id}``); its id names it."""
    from aiollama.server.responses import replica_of

    if "/responses/" in path:
        return replica_of(path.rsplit("/", 1)[-1])
    if not body or b"previous_response_id" not in body:
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    return replica_of(request.get("previous_response_id")) if isinstance(request, dict) else None


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def affinity_keys(headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a request's conversation is known by: (keys to look up, most specific first; keys to
    remember for its next turn). A session header or ``user`` names the conversation outright;
    otherwise chat messages are keyed by every prefix of the list (a next turn starts with this
    turn's messages and the reply), and a text prompt by its 256-character blocks. Every key is
    the request's ``cache_salt``'s: a tenant's conversation is never routed by another's keys."""
    session = next((v.decode("latin-1") for k, v in headers if k.lower() == SESSION_HEADER.encode()), None)
    try:
        request = json.loads(body) if body else {}
    except ValueError:
        return (), ()
    if not isinstance(request, dict):
        return (), ()
    salt = request.get("cache_salt")
    tenant = f"{_digest(salt)}:" if isinstance(salt, str) and salt else ""
    user = request.get("user")
    named = f"session:{session}" if session else (f"user:{user}" if isinstance(user, str) and user else None)
    if named is not None:
        return (tenant + named,), (tenant + named,)
    messages = request.get("messages")
    if isinstance(messages, list) and messages:
        keys = [f"{tenant}chat:{_digest(messages[:n])}" for n in range(len(messages), 0, -1)]
        return tuple(keys), (keys[0],)
    prompt = request.get("prompt")
    if isinstance(prompt, str) and prompt:
        ends = list(range(len(prompt), 0, -256))
        keys = [f"{tenant}text:{_digest(prompt[:n // 256 * 256])}" for n in ends if n >= 256]
        return tuple(keys), tuple(keys[:1])
    return (), ()


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router: a conversation goes back to the replica that served its previous
    turn (whose prefix cache holds it) while that replica has room and is not ``imbalance`` requests
    busier than the least loaded one; anything else goes to the least loaded replica.

    Each handle (each ingress replica) has its own router and remembers what it routed; a replica
    that dies is forgotten.
    """

    def initialize_state(self, imbalance: int = 8, **_: Any) -> None:
        self._imbalance = imbalance
        self._owner: OrderedDict[str, ReplicaID] = OrderedDict()

    def _load(self, replica: RunningReplica) -> int:
        n = self._replica_queue_len_cache.get(replica.replica_id)
        return 0 if n is None else int(n)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_load = sorted(candidate_replicas, key=lambda r: (self._load(r), random.random()))  # ties: any
        request = _forwarded(pending_request)
        if request is not None and request.holder is not None:
            holder = next((r for r in candidate_replicas if r.replica_id.unique_id == request.holder), None)
            if holder is not None:
                return [[holder]]  # only it holds the conversation: it answers, whatever its load
            # the holder is gone: any replica answers that the response is not there (a 404)
        chosen = by_load[0]
        if request is not None:
            by_id = {r.replica_id: r for r in candidate_replicas}
            least = self._load(chosen)
            for key in request.keys:
                owner = by_id.get(self._owner.get(key))  # type: ignore[arg-type]
                if owner is None:
                    continue
                load = self._load(owner)
                if load < owner.max_ongoing_requests and load - least <= self._imbalance:
                    chosen = owner
                break
            # The first rank is taken unless it refuses the request (full): then ``on_request_routed``
            # corrects this.
            self._remember(request, chosen.replica_id)
        return [[chosen], [r for r in by_load if r is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = _forwarded(pending_request)
        if request is not None:
            self._remember(request, replica_id)

    def _remember(self, request: Forwarded, replica_id: ReplicaID) -> None:
        for key in request.record:
            self._owner[key] = replica_id
            self._owner.move_to_end(key)
        while len(self._owner) > MAX_KEYS:
            self._owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [k for k, owner in self._owner.items() if owner == replica_id]:
            del self._owner[key]


def _forwarded(pending_request: PendingRequest | None) -> Forwarded | None:
    """The request's :class:`Forwarded`. Matched by name: the router and the ingress may hold
    copies of the class that Ray unpickled apart."""
    if pending_request is None:
        return None
    return next((a for a in pending_request.args if type(a).__name__ == Forwarded.__name__), None)


class EngineReplica:
    """One engine and the OpenAI API of :mod:`aiollama.server` around it, driven in-process."""

    def __init__(self, model: str | None, engine_options: Mapping[str, Any],
                 app_options: Mapping[str, Any] | None = None) -> None:
        self._model = model
        self._options = dict(engine_options)
        self._app_options = {"model_name": self._name(), **(app_options or {})}
        self._engine: Engine | None = None
        self._app: Any = None
        self._lifespan: asyncio.Future[None] | None = None

    async def _started(self) -> Any:
        if self._app is None:
            from aiollama.server import create_app
            from aiollama.server.run import freeze_startup_heap

            engine = Engine(self._model, **self._options)
            await engine.start()
            replica = "".join(c for c in self._id() if c.isalnum())
            app = create_app(engine=engine, replica=replica, **self._app_options)
            self._lifespan = asyncio.ensure_future(_live(app))  # the app's background work: the store's sweep
            self._engine, self._app = engine, app
            # as `aiollama serve` does: a replica is a process of its own (Ray's actor), whose full
            # collections would otherwise scan all that its start built while every stream waits
            freeze_startup_heap()
        return self._app

    def _name(self) -> str | None:
        from pathlib import Path

        return Path(self._model).stem if self._model else None

    async def handle(self, request: Forwarded) -> AsyncIterator[dict[str, Any] | bytes]:
        """Run the request through the app: first ``{"status", "headers"}``, then body chunks."""
        app = await self._started()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
                 "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
                 "query_string": request.query, "headers": request.headers, "client": None, "server": None,
                 "root_path": "", "state": {}}
        async for item in _drive(app, scope, request.body):
            if isinstance(item, dict):
                item["headers"] = [*item["headers"], (REPLICA_HEADER.encode(), self._id().encode())]
            yield item

    @staticmethod
    def _id() -> str:
        try:
            return str(serve.get_replica_context().replica_id.unique_id)
        except Exception:  # not inside a replica (a test driving the class directly)
            return "local"

    async def check_health(self) -> None:
        if self._engine is not None and not self._engine.serving:
            raise RuntimeError("the engine stopped serving")

    async def __del__(self) -> None:
        if self._lifespan is not None:
            self._lifespan.cancel()
        if self._engine is not None:
            await self._engine.aclose()


async def _live(app: Any) -> None:
    """Run ``app``'s lifespan until cancelled (Ray drives its requests, not a server)."""
    async with app.router.lifespan_context(app):
        await asyncio.Event().wait()


async def _drive(app: Any, scope: dict[str, Any], body: bytes) -> AsyncIterator[dict[str, Any] | bytes]:
    """Call an ASGI app with one request body; yield its response start, then its body chunks."""
    import anyio

    send_out, receive_out = anyio.create_memory_object_stream[dict[str, Any]](64)
    disconnected = anyio.Event()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await send_out.send(message)

    async def run() -> None:
        async with send_out:
            await app(scope, receive, send)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        try:
            async with receive_out:
                async for message in receive_out:
                    if message["type"] == "http.response.start":
                        yield {"status": message["status"], "headers": message.get("headers", [])}
                    elif message["type"] == "http.response.body":
                        if message.get("body"):
                            yield message["body"]
                        if not message.get("more_body", False):
                            break
        finally:
            disconnected.set()  # the caller went away or the response ended: the app stops streaming


class Ingress:
    """Takes HTTP requests from Serve's proxy and streams each one from an engine replica."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine.options(stream=True)

    async def __call__(self, request: HttpRequest) -> Response:
        forwarded = Forwarded.of(request.method, request.url.path, request.scope.get("query_string", b""),
                                 [(k, v) for k, v in request.scope["headers"] if k.lower() != b"host"],
                                 await request.body())
        chunks = self._engine.handle.remote(forwarded)
        head = await chunks.__anext__()
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head["headers"]
                   if k.lower() not in (b"content-length", b"transfer-encoding")}

        async def rest() -> AsyncIterator[bytes]:
            async for chunk in chunks:
                yield chunk

        return StreamingResponse(rest(), status_code=head["status"], headers=headers)


def build_app(model: Any = None, *, replicas: int = 1, n_seq_max: int = 16, max_ongoing_requests: int | None = None,
              autoscaling_config: Mapping[str, Any] | None = None, ray_actor_options: Mapping[str, Any] | None = None,
              imbalance: int = 8, app_options: Mapping[str, Any] | None = None, **engine_options: Any) -> Any:
    """A Serve application of ``replicas`` engine replicas behind one ingress.

    ``model`` is a .gguf path (None: the default model). ``engine_options`` go to each replica's
    :class:`Engine` (``n_ctx``, ``n_threads``, ``n_gpu_layers``...). ``autoscaling_config`` (Ray
    Serve's, with ``min_replicas`` and ``max_replicas``) replaces the fixed ``replicas``;
    ``ray_actor_options`` sets each replica's resources (``{"num_cpus": 8}`` or ``{"num_gpus": 1}``).
    ``app_options`` go to each replica's :func:`aiollama.server.create_app` (``reasoning_budget``,
    ``sampling``, ``responses_max``...). ``serve run aiollama.ray:build_app model=... replicas=2
    n_ctx=8192`` passes its arguments as one mapping of strings, which is accepted too.

    A stored response (``/v1/responses``) lives in the replica that made it, and its id names that
    replica: a follow-up, a read and a delete go there whatever its load; if it is gone, the
    answer is a 404.
    """
    if isinstance(model, Mapping):  # serve run's application builder: one dict of strings
        args = dict(model)
        model = args.pop("model", None)
        replicas = int(args.pop("replicas", replicas))
        n_seq_max = int(args.pop("n_seq_max", n_seq_max))
        if "max_ongoing_requests" in args:
            max_ongoing_requests = int(args.pop("max_ongoing_requests"))
        engine_options = {**{k: _parse(k, v) for k, v in args.items()}, **engine_options}
    unknown = sorted(set(engine_options) - set(ENGINE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
    EngineConfig.from_options(model, n_seq_max=n_seq_max, **engine_options)  # each value checked now, not in a replica
    ongoing = max_ongoing_requests or 2 * n_seq_max
    router: Any = f"{__name__}.PrefixAffinityRouter"  # an import path (its stubs say otherwise)
    options: dict[str, Any] = {"max_ongoing_requests": ongoing, "ray_actor_options": dict(ray_actor_options or {}),
                               "request_router_config": RequestRouterConfig(
                                   request_router_class=router, request_router_kwargs={"imbalance": imbalance})}
    if autoscaling_config is not None:
        options["autoscaling_config"] = dict(autoscaling_config)
    else:
        options["num_replicas"] = replicas
    deployment: Any = serve.deployment  # its stubs type only the decorator form
    engine = deployment(EngineReplica).options(name="EngineReplica", **options)
    # the ingress only forwards bytes: it takes no CPU from the engines' share
    ingress = deployment(Ingress).options(name="Ingress", max_ongoing_requests=ongoing * max(1, replicas),
                                                ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(None if model is None else str(model),
                                    {"n_seq_max": n_seq_max, **engine_options}, dict(app_options or {})))


def _parse(name: str, value: Any) -> Any:
    """``serve run``'s string for an engine option, as the option's type (read from its default)."""
    if name not in ENGINE_OPTIONS or not isinstance(value, str):
        return value
    default = ENGINE_OPTIONS[name]
    if isinstance(default, bool) or name in ("flash_attn",):
        return None if value.lower() in ("auto", "none") else value.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int) or name in ("n_threads", "cache_seq_ids"):
        return value if value == "auto" else int(value)
    return value


__all__ = ["EngineReplica", "Forwarded", "Ingress", "PrefixAffinityRouter", "affinity_keys", "build_app"]
