"""CORS as llama-server answers it, so that a web page on another origin can call the server.

Every answer to a request from an allowed origin says so (``Access-Control-Allow-Origin``); a
preflight ``OPTIONS`` is answered at once, before any key is checked (browsers send none with it),
with the methods, headers and credentials allowed. The default allows only pages served from
localhost (llama-server's ``--cors-origins localhost``); ``"*"`` allows any, a comma-separated list
those named.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_local(origin: str) -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) is a page served from this machine."""
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and (parts.hostname or "") in LOCAL_HOSTS


@dataclass(frozen=True)
class Cors:
    """What the server allows: ``origins`` ("localhost", "*" or a comma-separated list), the
    ``methods`` and ``headers`` of a preflight, and whether credentials (keys, cookies) go along."""

    origins: str = "localhost"
    methods: str = "GET, POST, DELETE, OPTIONS"
    headers: str = "*"
    credentials: bool = True

    def allowed(self, origin: str) -> str | None:
        """The ``Access-Control-Allow-Origin`` for a request from ``origin``; None: not allowed."""
        if not origin:
            return None
        if self.origins == "*":
            return origin if self.credentials else "*"  # credentials need the origin named
        if self.origins == "localhost":
            return origin if is_local(origin) else None
        listed = {o.strip().rstrip("/") for o in self.origins.split(",") if o.strip()}
        return origin if origin.rstrip("/") in listed else None


class CorsMiddleware:
    """``app`` with CORS answered as ``cors`` says."""

    def __init__(self, app: App, cors: Cors) -> None:
        self.app, self.cors = app, cors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        allow = self.cors.allowed(headers.get("origin", ""))
        if scope["method"] == "OPTIONS":
            await self._preflight(send, allow, headers.get("access-control-request-headers", ""))
            return
        if allow is None:
            await self.app(scope, receive, send)
            return

        async def send_with_origin(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [(b"access-control-allow-origin", allow.encode("latin-1")), (b"vary", b"Origin")]
                if self.cors.credentials:
                    extra.append((b"access-control-allow-credentials", b"true"))
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_origin)

    async def _preflight(self, send: Send, allow: str | None, asked_headers: str) -> None:
        cors = self.cors
        # "*" is taken literally by browsers when credentials go along: name the headers asked for
        allowed_headers = asked_headers if cors.headers == "*" and cors.credentials and asked_headers else cors.headers
        headers = [(b"access-control-allow-methods", cors.methods.encode("latin-1")),
                   (b"access-control-allow-headers", allowed_headers.encode("latin-1")),
                   (b"access-control-allow-credentials", b"true" if cors.credentials else b"false"),
                   (b"access-control-max-age", b"600"), (b"vary", b"Origin"), (b"content-length", b"0")]
        if allow is not None:
            headers.insert(0, (b"access-control-allow-origin", allow.encode("latin-1")))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
