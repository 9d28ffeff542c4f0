"""llama-server's tools for debugging prompts: ``/tokenize``, ``/detokenize``, ``/apply-template``.

The shapes are llama-server's, so the scripts written for it work here: a piece is a string when
its bytes are whole UTF-8, else the list of its byte values.
"""

from __future__ import annotations

from typing import Any

import anyio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from aiollama.errors import AiollamaError
from aiollama.server.bad_request import BadRequest
from aiollama.server.chat_request import chat_request
from aiollama.server.neutral_request import json_object
from aiollama.server.state import State, serving_engine, translate


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return value



async def tokenize(state: State, request: HttpRequest) -> Response:
    """``{"content", "add_special" (false), "parse_special" (true), "with_pieces" (false)}``."""
    body = json_object(await state.guard.read_json(request),
                       frozenset({"content", "add_special", "parse_special", "with_pieces"}))
    content = body.get("content")
    if not isinstance(content, str):
        raise BadRequest("'content' must be a string", param="content")
    add_special, special = _flag(body, "add_special", False), _flag(body, "parse_special", True)
    engine = serving_engine(state)
    # a worker thread: a large text takes seconds, which the event loop's other requests would wait
    tokens = await anyio.to_thread.run_sync(lambda: engine.tokenize(content, add_special=add_special, special=special))
    if not _flag(body, "with_pieces", False):
        return JSONResponse({"tokens": tokens})
    pieces = []
    for token in tokens:
        raw = engine.token_bytes(token)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": token, "piece": piece})
    return JSONResponse({"tokens": pieces})


async def detokenize(state: State, request: HttpRequest) -> Response:
    """``{"tokens": [ids]}`` -> ``{"content": text}``."""
    body = json_object(await state.guard.read_json(request), frozenset({"tokens"}))
    tokens = body.get("tokens")
    engine = serving_engine(state)
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < engine.n_vocab for t in tokens):
        raise BadRequest(f"'tokens' must be a list of token ids in [0, {engine.n_vocab})", param="tokens")
    return JSONResponse({"content": engine.detokenize(tokens)})


async def apply_template(state: State, request: HttpRequest) -> Response:
    """A chat body (``messages``, ``tools``, the template's switches, ``add_generation_prompt``,
    ``continue_final_message``) -> ``{"prompt": text}``: what a chat request would evaluate."""
    body = await state.guard.read_json(request)
    json_object(body, frozenset({"messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort",
                                 "reasoning_format", "parallel_tool_calls", "add_generation_prompt",
                                 "continue_final_message"}))
    req = chat_request(body)
    engine = serving_engine(state)
    assert req.messages is not None
    try:
        options = req.chat_options(engine)
        prompt = engine.render_chat(req.messages, add_generation_prompt=body.get("add_generation_prompt", True),
                                    **options)
    except AiollamaError as exc:
        raise translate(exc) from None
    return JSONResponse({"prompt": prompt})
