"""Embeddings: pooled, normalised vectors for texts, on a context of their own.

A generative model embeds with mean pooling over its last hidden states; a dedicated embedding model
(BERT and its kin, which attend to the whole input at once) with the pooling its file names. Many
texts go into one decode, each in its own sequence, and the context is emptied afterwards: the
conversations' KV cache is never touched. Runs on the decode thread, between steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from aiollama.errors import ContextFull, DecodeError, InvalidRequestError
from aiollama.native import Batch, Context, DecodeStatus, Model

MAX_EMBED_TOKENS = 2048  # the longest text embedded (also capped by the model's training context)
MAX_TEXTS_PER_DECODE = 64


def is_embedding_model(model: Model) -> bool:
    """A model that attends to whole inputs (BERT and its kin): it embeds and cannot generate."""
    arch = model.metadata("general.architecture")
    return arch is not None and model.metadata(f"{arch}.attention.causal") == "false"


class Embedder:
    """An embeddings context over ``model``."""

    def __init__(self, model: Model, *, n_threads: int | None) -> None:
        self.size = min(MAX_EMBED_TOKENS, model.n_ctx_train or MAX_EMBED_TOKENS)
        pooling = None if is_embedding_model(model) else "mean"
        with contextlib.ExitStack() as stack:
            self.ctx: Context = stack.enter_context(Context(
                model, n_ctx=self.size, n_batch=self.size, n_ubatch=self.size, n_seq_max=MAX_TEXTS_PER_DECODE,
                n_threads=n_threads, embeddings=True, pooling=pooling))
            self.batch: Batch = stack.enter_context(Batch(self.size))
            self._handles = stack.pop_all()

    def embed(self, texts: Sequence[Sequence[int]], normalize: bool = True) -> list[list[float]]:
        """One vector per token list, in order. Raises ContextFull for a text longer than the
        embeddings context, InvalidRequestError for an empty one."""
        for i, tokens in enumerate(texts):
            if not tokens:
                raise InvalidRequestError(f"text {i} is empty")
            if len(tokens) > self.size:
                raise ContextFull(f"text {i} has {len(tokens)} tokens; embeddings take at most {self.size}")
        out: list[list[float]] = []
        group: list[Sequence[int]] = []
        for tokens in texts:
            if group and (sum(map(len, group)) + len(tokens) > self.size or len(group) == MAX_TEXTS_PER_DECODE):
                out += self._decode(group, normalize)
                group = []
            group.append(tokens)
        if group:
            out += self._decode(group, normalize)
        return out

    def _decode(self, group: Sequence[Sequence[int]], normalize: bool) -> list[list[float]]:
        self.batch.clear()
        for seq_id, tokens in enumerate(group):
            # llama.cpp pools every token of an embeddings batch, whatever the output flags say
            self.batch.add_tokens(tokens, 0, seq_id, output_last=True)
        try:
            status = self.ctx.decode(self.batch)
            if status is not DecodeStatus.OK:
                raise DecodeError(f"the embeddings decode failed: {status.name}")
            vectors = [self.ctx.embedding(seq_id) for seq_id in range(len(group))]
        finally:
            self.ctx.memory_clear()
        if normalize:
            array = np.asarray(vectors, dtype=np.float64)
            norms = np.linalg.norm(array, axis=1, keepdims=True)
            vectors = (array / np.where(norms == 0, 1.0, norms)).tolist()
        return vectors

    def close(self) -> None:
        self._handles.close()

