"""Reranking over HTTP: llama-server's ``/rerank`` (also ``/reranking``, ``/v1/rerank`` and
``/v1/reranking``), in the shape Jina's and Cohere's clients read, or TEI's.

A body gives a ``query`` and its ``documents`` (strings, or ``{"text": ...}`` objects as Cohere
and Jina send them); ``top_n`` keeps the best. The answer lists ``{"index", "relevance_score"}``,
the most relevant first (``return_documents`` adds each one's ``document``), with ``usage``. A
body with ``texts`` instead of ``documents`` is TEI's: the answer is a bare list of
``{"index", "score"}`` (``return_text`` adds each one's ``text``).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from aiollama.errors import AiollamaError
from aiollama.server.bad_request import BadRequest
from aiollama.server.neutral_request import integer_field, json_object
from aiollama.server.openai_request import MAX_INPUTS
from aiollama.server.state import State, serving_engine, translate

# Any other field (TEI's truncate and raw_scores, Cohere's max_chunks_per_doc and rank_fields) is
# refused with a 400 naming it: none is taken and dropped
RERANK_FIELDS = frozenset({"model", "query", "documents", "texts", "top_n", "return_documents", "return_text"})


def rerank_request(body: Any) -> tuple[str, list[str], int | None, bool, bool]:
    """(query, documents, top_n, whether TEI's shape, whether the texts come back)."""
    body = json_object(body, RERANK_FIELDS)
    query = body.get("query")
    if not isinstance(query, str):
        raise BadRequest("\"query\" must be a string" if "query" in body else "\"query\" must be provided",
                         param="query")
    tei = "texts" in body and "documents" not in body
    name = "texts" if tei else "documents"
    value = body.get(name)
    if not isinstance(value, list) or not value:
        raise BadRequest(f"\"{name}\" must be a non-empty string array", param=name)
    if len(value) > MAX_INPUTS:
        raise BadRequest(f"'{name}' holds {len(value)} documents; at most {MAX_INPUTS} a request", param=name)
    docs = []
    for i, doc in enumerate(value):
        text = doc.get("text") if isinstance(doc, dict) and not tei else doc
        if not isinstance(text, str):
            raise BadRequest(f"{name}[{i}] must be a string{'' if tei else ' or a {text} object'}", param=f"{name}[{i}]")
        docs.append(text)
    top_n = integer_field(body, "top_n", 0)
    back = body.get("return_text" if tei else "return_documents", False)
    if not isinstance(back, bool):
        raise BadRequest(f"'{'return_text' if tei else 'return_documents'}' must be a boolean")
    return query, docs, top_n, tei, back


async def route(state: State, request: HttpRequest) -> Response:
    query, docs, top_n, tei, back = rerank_request(await state.guard.read_json(request))
    engine = serving_engine(state)
    if engine.model_info.get("kind") != "rerank":
        raise BadRequest("This server does not support reranking: its model is not a reranker (serve one, or give "
                         "--pooling rank)", status=501)
    try:
        scores = await engine.rerank(query, docs)
        n_tokens = sum(len(engine.rerank_tokens(query, doc)) for doc in docs)
    except AiollamaError as exc:
        raise translate(exc) from None
    label = "score" if tei else "relevance_score"
    results: list[dict[str, Any]] = sorted(({"index": i, label: score} for i, score in enumerate(scores)),
                                           key=lambda r: -r[label])[:top_n]
    for result in results if back else ():
        result.update({"text": docs[result["index"]]} if tei else {"document": {"text": docs[result["index"]]}})
    if tei:
        return JSONResponse(results)
    return JSONResponse({"model": state.name(), "object": "list", "results": results,
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})
