"""Reranking inputs, as llama-server's ``/rerank`` builds them.

A reranker (a model pooled by rank: a classifier head over a cross-encoder) scores a query and a
document read together. Where the model file carries a ``rerank`` template, the pair is its text
with ``{query}`` and ``{document}`` replaced (special tokens parsed); otherwise it is::

    [BOS] query [EOS] [SEP] document [EOS]

each special token only where the vocabulary asks for it (EOS falls back to SEP). Pure: no engine,
no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from aiollama.errors import InvalidRequestError


class RerankVocab(Protocol):
    bos: int
    eos: int  # -1 when the model has none
    sep: int
    add_bos: bool
    add_eos: bool
    add_sep: bool

    def tokenize(self, text: str, *, add_special: bool, special: bool) -> list[int]: ...


def rerank_tokens(vocab: RerankVocab, query: str, document: str, template: str | None) -> list[int]:
    """The tokens a reranker scores for ``query`` and ``document``."""
    if template is not None:
        prompt = template.replace("{query}", query).replace("{document}", document)
        return vocab.tokenize(prompt, add_special=False, special=True)
    eos = vocab.eos if vocab.eos >= 0 else vocab.sep
    out = [vocab.bos] if vocab.add_bos else []
    out += vocab.tokenize(query, add_special=False, special=False)
    if vocab.add_eos:
        out.append(eos)
    if vocab.add_sep:
        out.append(vocab.sep)
    out += vocab.tokenize(document, add_special=False, special=False)
    if vocab.add_eos:
        out.append(eos)
    return out


def check_pairs(query: object, documents: object) -> tuple[str, list[str]]:
    """A query and its documents: a string, and a non-empty list of strings."""
    if not isinstance(query, str):
        raise InvalidRequestError(f"the query must be a string, got {type(query).__name__}", param="query")
    if isinstance(documents, str) or not isinstance(documents, Sequence) or not documents \
            or not all(isinstance(d, str) for d in documents):
        raise InvalidRequestError("the documents must be a non-empty list of strings", param="documents")
    return query, list(documents)
