"""Embeddings: pooled, normalised vectors for texts, on a context of their own.

A generative model embeds with mean pooling over its last hidden states; a dedicated embedding model
(BERT and its kin, which attend to the whole input at once) with the pooling its file names; either
with the pooling the engine was given instead (``none``: a vector per token). Many texts go into
one decode, each in its own sequence, and the context is emptied afterwards: the conversations' KV
cache is never touched. Runs on the decode thread, between steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from aiollama.errors import ContextFull, DecodeError, InvalidRequestError
from aiollama.native import Batch, Context, DecodeStatus, Model

MAX_EMBED_TOKENS = 2048  # the longest text embedded (also capped by the model's training context)
MAX_TEXTS_PER_DECODE = 64


def is_embedding_model(model: Model) -> bool:
    """A model that attends to whole inputs (BERT and its kin): it embeds and cannot generate."""
    arch = model.metadata("general.architecture")
    return arch is not None and model.metadata(f"{arch}.attention.causal") == "false"


# llama.cpp's pooling types by number, as a model file's ``{arch}.pooling_type`` gives them
POOLING_NAMES = {"0": "none", "1": "mean", "2": "cls", "3": "last", "4": "rank"}


def embed_pooling(model: Model, pooling: str | None) -> str:
    """The pooling ``embed()`` applies: the engine's option, else the model file's own for a
    dedicated embedding model (or a reranker: "rank"), else mean."""
    if pooling is not None:
        return pooling
    if not is_embedding_model(model):
        return "mean"
    arch = model.metadata("general.architecture")
    return POOLING_NAMES.get(model.metadata(f"{arch}.pooling_type") or "", "mean")


def embedder_options(model: Model, n_threads: int | None, pooling: str | None) -> dict[str, Any]:
    """The embeddings context of ``model`` (what a plan simulates for an embedding model)."""
    size = min(MAX_EMBED_TOKENS, model.n_ctx_train or MAX_EMBED_TOKENS)
    if pooling is None:
        pooling = None if is_embedding_model(model) else "mean"
    return {"n_ctx": size, "n_batch": size, "n_ubatch": size, "n_seq_max": MAX_TEXTS_PER_DECODE,
            "n_threads": n_threads, "embeddings": True, "pooling": pooling}


class Embedder:
    """An embeddings context over ``model``."""

    def __init__(self, model: Model, *, n_threads: int | None, pooling: str | None = None) -> None:
        options = embedder_options(model, n_threads, pooling)
        self.size = options["n_ctx"]
        self.per_token = options["pooling"] == "none"
        with contextlib.ExitStack() as stack:
            self.ctx: Context = stack.enter_context(Context(model, **options))
            self.batch: Batch = stack.enter_context(Batch(self.size))
            self._handles = stack.pop_all()

    def embed(self, texts: Sequence[Sequence[int]], normalize: bool = True) -> list[Any]:
        """One vector per token list, in order (without pooling, a list of one vector per token).
        Raises ContextFull for a text longer than the embeddings context, InvalidRequestError for
        an empty one."""
        for i, tokens in enumerate(texts):
            if not tokens:
                raise InvalidRequestError(f"text {i} is empty")
            if len(tokens) > self.size:
                raise ContextFull(f"text {i} has {len(tokens)} tokens; embeddings take at most {self.size}")
        out: list[Any] = []
        group: list[Sequence[int]] = []
        for tokens in texts:
            if group and (sum(map(len, group)) + len(tokens) > self.size or len(group) == MAX_TEXTS_PER_DECODE):
                out += self._decode(group, normalize)
                group = []
            group.append(tokens)
        if group:
            out += self._decode(group, normalize)
        return out

    def _decode(self, group: Sequence[Sequence[int]], normalize: bool) -> list[Any]:
        self.batch.clear()
        lasts = []
        for seq_id, tokens in enumerate(group):
            # llama.cpp pools every token of an embeddings batch, whatever the output flags say
            lasts.append(self.batch.add_tokens(tokens, 0, seq_id, output_last=not self.per_token,
                                               n_outputs=len(tokens) if self.per_token else 0))
        try:
            status = self.ctx.decode(self.batch)
            if status is not DecodeStatus.OK:
                raise DecodeError(f"the embeddings decode failed: {status.name}")
            if self.per_token:
                return [_normed([self.ctx.token_embedding(row) for row in range(last - len(tokens) + 1, last + 1)],
                                normalize) for tokens, last in zip(group, lasts)]
            vectors = [self.ctx.embedding(seq_id) for seq_id in range(len(group))]
        finally:
            self.ctx.memory_clear()
        return _normed(vectors, normalize)

    def close(self) -> None:
        self._handles.close()


def _normed(vectors: list[list[float]], normalize: bool) -> list[list[float]]:
    """The vectors scaled to unit length (with ``normalize``; a zero vector stays zero)."""
    if not normalize:
        return vectors
    array = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(array, axis=1, keepdims=True)
    return (array / np.where(norms == 0, 1.0, norms)).tolist()  # type: ignore[no-any-return]
