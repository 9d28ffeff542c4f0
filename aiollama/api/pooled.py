"""Requests answered with pooled rows: embeddings, and a reranker's scores."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio

from aiollama.api.client import EngineClient
from aiollama.api.portal import AsyncSink
from aiollama.core.commands import Embed
from aiollama.core.outputs import Delta, Item, Vectors
from aiollama.errors import InvalidRequestError
from aiollama.formats.rerank import check_pairs, rerank_tokens


def embed_request(client: EngineClient, texts: str | Sequence[str] | Sequence[Sequence[int]], normalize: bool,
                  sink: AsyncSink) -> None:
    if isinstance(texts, str):
        texts = [texts]
    if not texts:
        raise InvalidRequestError("embed() needs at least one text")
    token_lists = tuple(tuple(client.encode(t, first=True, special=False)) for t in texts)
    client.send(Embed(token_lists, normalize, sink))


def rerank_request(client: EngineClient, query: Any, documents: Any, sink: AsyncSink) -> None:
    """Ask for a reranker's rows of each (query, document) pair, unnormalised, into ``sink``."""
    query, docs = check_pairs(query, documents)
    if client.model_info.get("pooling") != "rank":
        raise InvalidRequestError("this model does not rerank: it needs a reranker (a model pooled by rank), "
                                  "or the engine's pooling='rank'", param="model")
    tokenizer: Any = client.tokenizer  # the model's own: it has the reranker's special tokens and template
    template = getattr(tokenizer, "rerank_template", None)
    client.send(Embed(tuple(tuple(rerank_tokens(tokenizer, query, doc, template)) for doc in docs), False, sink))


def vectors(item: Item) -> list[Any]:
    if isinstance(item, Delta) and item.error is not None:
        raise item.error
    assert isinstance(item, Vectors)
    return item.vectors


async def answer(client: EngineClient, request: Callable[[AsyncSink], None]) -> list[Any]:
    """Send ``request`` (it fills a sink) and wait for its rows: the decode thread answers between
    steps, so the wait is shielded (the rows are computed anyway)."""
    sink = client.async_sink()
    request(sink)
    with anyio.CancelScope(shield=True):
        item = await sink.get()
    return vectors(item)
