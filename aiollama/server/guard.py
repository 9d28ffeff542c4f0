"""What makes the server safe to expose: API keys, and limits that answer 4xx before any work.

Keys are compared in constant time (``hmac.compare_digest`` against every key, whatever matched
first). A body is read up to ``max_body_bytes`` and no further (its declared length is refused
before a byte is read), parsed, and refused when it nests deeper than ``max_json_depth``: none of
it reaches the tokenizer. ``max_streams_per_key`` bounds the generations one key (or, without
keys, everyone together) has in flight.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request as HttpRequest

from aiollama.server.bad_request import BadRequest

ENV_KEYS = "AIOLLAMA_API_KEY"  # one key, or several separated by commas


@dataclass(frozen=True)
class Limits:
    """The server's limits; each has a ``serve`` option of the same name."""

    max_body_bytes: int = 8 << 20
    max_json_depth: int = 64
    max_streams_per_key: int = 0  # 0: no limit

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_streams_per_key"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_streams_per_key" else 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def load_keys(keys: Iterable[str] = (), key_file: str | os.PathLike[str] | None = None) -> tuple[str, ...]:
    """The keys given, those of ``key_file`` (one a line; blank lines and ``#`` comments skipped)
    and those of ``$AIOLLAMA_API_KEY``, without repeats."""
    out = [k.strip() for k in keys]
    if key_file is not None:
        lines = Path(key_file).read_text().splitlines()
        out += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    out += [k.strip() for k in os.environ.get(ENV_KEYS, "").split(",")]
    return tuple(dict.fromkeys(k for k in out if k))


@dataclass
class Guard:
    """The keys and limits of one app, and the generations each key has in flight."""

    keys: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    public_metrics: bool = False
    in_flight: dict[str, int] = field(default_factory=dict)

    def identify(self, request: HttpRequest, route: str) -> str:
        """The key a request carries (``Authorization: Bearer KEY`` or ``x-api-key: KEY``), or ""
        when the server has no keys; 401 for a missing or wrong key. ``/health`` is always open,
        ``/metrics`` when ``public_metrics``."""
        if not self.keys or route == "health" or (route == "metrics" and self.public_metrics):
            return ""
        given = request.headers.get("x-api-key", "")
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        found = ""
        for key in self.keys:  # every key compared, so the time says nothing of which matched
            if hmac.compare_digest(given.encode(), key.encode()):
                found = key
        if not found:
            raise BadRequest("a valid API key is needed: 'Authorization: Bearer KEY'", status=401,
                             code="invalid_api_key")
        return found

    def hold(self, key: str) -> Callable[[], None]:
        """Count one more generation of ``key`` (429 past ``max_streams_per_key``); the function
        returned gives its place back, once however often it is called."""
        n = self.in_flight.get(key, 0)
        if self.limits.max_streams_per_key and n >= self.limits.max_streams_per_key:
            raise BadRequest(f"this key already has {n} requests in flight (the limit)", status=429,
                             code="too_many_requests")
        self.in_flight[key] = n + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self.in_flight[key] - 1
            if left:
                self.in_flight[key] = left
            else:
                del self.in_flight[key]
        return release

    async def read_json(self, request: HttpRequest) -> Any:
        """The body as JSON, read no further than ``max_body_bytes`` (413 past it) and no deeper
        than ``max_json_depth`` (400)."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        try:
            value = json.loads(b"".join(chunks))
        except RecursionError:
            raise _too_deep(self.limits.max_json_depth) from None
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        if depth(value, self.limits.max_json_depth) > self.limits.max_json_depth:
            raise _too_deep(self.limits.max_json_depth)
        return value


def depth(value: Any, stop: int) -> int:
    """How deep ``value`` nests (a scalar is 0, ``[]`` is 1), counted no further than ``stop + 1``."""
    deepest = 0
    todo: list[tuple[Any, int]] = [(value, 0)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (dict, list)):
            level += 1
            deepest = max(deepest, level)
            if level > stop:
                return level
            todo.extend((child, level) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _too_large(limit: int) -> BadRequest:
    return BadRequest(f"the request body is larger than {limit} bytes", status=413, code="request_too_large")


def _too_deep(limit: int) -> BadRequest:
    return BadRequest(f"the request body nests deeper than {limit} levels", code="json_too_deep")
