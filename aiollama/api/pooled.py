"""Requests answered between the decode steps: pooled rows (embeddings, and a reranker's scores),
a conversation's snapshot, and how a caller waits for such an answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio

from aiollama.api.client import EngineClient
from aiollama.api.portal import AsyncSink
from aiollama.core.commands import Embed
from aiollama.core.outputs import Delta, Item, Snapshot, Vectors
from aiollama.errors import InvalidRequestError
from aiollama.formats import savefile
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
    client.send(Embed(tuple(tuple(pair_tokens(client, query, doc)) for doc in docs), False, sink))


def pair_tokens(client: EngineClient, query: str, document: str) -> list[int]:
    """The tokens a reranker scores for one (query, document) pair."""
    query, [document] = check_pairs(query, [document])
    tokenizer: Any = client.tokenizer  # the model's own: it has the reranker's special tokens and template
    return rerank_tokens(tokenizer, query, document, getattr(tokenizer, "rerank_template", None))


def vectors(item: Item) -> list[Any]:
    if isinstance(item, Delta) and item.error is not None:
        raise item.error
    assert isinstance(item, Vectors)
    return item.vectors


async def reply(client: EngineClient, request: Callable[[AsyncSink], Any]) -> Item:
    """Send ``request`` (it gives the decode thread a sink) and wait for the answer: the decode
    thread answers between steps, so the wait is shielded (the work is done anyway)."""
    sink = client.async_sink()
    request(sink)
    with anyio.CancelScope(shield=True):
        item = await sink.get()
    return item


async def answer(client: EngineClient, request: Callable[[AsyncSink], Any]) -> list[Any]:
    """:func:`reply`'s rows (embeddings, or a reranker's scores)."""
    return vectors(await reply(client, request))


def saved(client: EngineClient, chat: Any, item: Item, cells: bool = True) -> bytes:
    """The file of a conversation (its ``chat`` state), from the decode thread's snapshot of it
    (``cells``: with them)."""
    if isinstance(item, Delta) and item.error is not None:
        raise item.error
    assert isinstance(item, Snapshot)
    n_cached, state = (item.n_cached, item.state) if cells else (0, b"")
    return savefile.dump(savefile.Saved(item.tokens, n_cached, state, chat,
                                        client.fingerprint, client.images.saved(item.images)))
