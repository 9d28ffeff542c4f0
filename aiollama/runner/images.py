"""Steps that hold images: the rows of a picture are embeddings, not tokens, and llama.cpp decodes a
batch of one kind only.

A slice whose tokens hold placeholders (see :mod:`aiollama.formats.images`) is cut into runs of
text and runs of image rows. Its last text run stays in the step's last decode, beside every other
slice's rows, where the logits are read; the runs before it are decoded first, in phases: run k
from the end of every slice in the same phase, text in one decode and image rows in another (the
sequences of one phase differ, so their order does not matter). A picture is thereby evaluated
within the step budget like any prompt: the scheduler cuts it where the budget ends, and running
streams decode in the same step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from aiollama.config import EngineConfig
from aiollama.errors import DecodeError, UnsupportedModel
from aiollama.formats.images import has_images, image_row, runs
from aiollama.native import Batch, Context, DecodeStatus, Model, Projector
from aiollama.sched.step import Slice


def images_for(config: EngineConfig, model: Model, embeds_only: bool) -> Projector:
    """The projector ``config.mmproj`` names, for ``model``; UnsupportedModel where images cannot
    go with what else the engine was asked for."""
    assert config.mmproj is not None
    if embeds_only:
        raise UnsupportedModel(f"{model.path} is an embedding model: it takes no images")
    if config.draft_model is not None:
        raise UnsupportedModel("a draft model cannot read images: give no mmproj with draft_model")
    if config.mtp:
        raise UnsupportedModel("MTP drafts do not follow image rows: give no mmproj with mtp")
    return Projector(model, config.mmproj, n_threads=config.n_threads, use_gpu=model.n_gpu_layers != 0)


class ImageRows:
    """Decodes the runs of a step's slices that come before their last text run. ``non_causal``:
    the projector's pictures are decoded with attention over all their rows (Gemma 3): each run
    then goes in a decode of its own with causal attention off, and the scheduler never cuts a
    picture before its last row (see :func:`aiollama.sched.images.whole`)."""

    def __init__(self, ctx: Context, n_embd: int, non_causal: bool = False) -> None:
        self.ctx = ctx
        self.non_causal = non_causal
        self.text = Batch(ctx.n_batch)
        self.rows = Batch(ctx.n_batch, n_embd=n_embd)

    def close(self) -> None:
        self.text.close()
        self.rows.close()

    def run(self, slices: Sequence[Slice], images: Mapping[int, Any],
            before: Callable[[], None] | None) -> tuple[DecodeStatus, list[Slice], bool]:
        """Decode every run but the last text run of each slice. Returns the status of the last
        decode, the slices left for the step's last decode (the last text runs, and the slices
        without images), and whether ``before`` was called."""
        rest: list[Slice] = []
        early: list[tuple[Slice, list[tuple[int, int, bool]]]] = []
        for s in slices:
            if not has_images(s.tokens):
                rest.append(s)
                continue
            cut = list(runs(s.tokens))
            if not cut[-1][2]:
                start = cut.pop()[0]
                rest.append(dataclasses.replace(s, pos=s.pos + start, tokens=s.tokens[start:]))
            elif s.logits:
                raise DecodeError(f"a slice that asks for logits ends with an image row: {s}")
            early.append((s, cut))
        depth = max((len(cut) for _, cut in early), default=0)
        self._before: Callable[[], None] | None = before
        for phase in range(depth):
            self.text.clear()
            pictures = []
            for s, cut in early:
                j = phase - (depth - len(cut))
                if j < 0:
                    continue
                a, b, image = cut[j]
                if image:
                    pictures.append((gather(images, s.tokens[a:b]), s.pos + a, s.seq_id))
                else:
                    self.text.add_tokens(s.tokens[a:b], s.pos + a, s.seq_id)
            status = self._decode(self.text) if len(self.text) else DecodeStatus.OK
            for group in [pictures[i:i + 1] for i in range(len(pictures))] if self.non_causal else [pictures]:
                if status is not DecodeStatus.OK or not group:
                    break
                self.rows.clear()
                for rows, pos, seq_id in group:
                    self.rows.add_embeddings(rows, pos, seq_id)
                status = self._decode(self.rows, causal=not self.non_causal)
            if status is not DecodeStatus.OK:
                return status, rest, self._before is None
        return DecodeStatus.OK, rest, self._before is None

    def _decode(self, batch: Batch, causal: bool = True) -> DecodeStatus:
        before, self._before = self._before, None
        if causal:
            return self.ctx.decode(batch, before)
        self.ctx.set_causal(False)
        try:
            return self.ctx.decode(batch, before)
        finally:
            self.ctx.set_causal(True)


def gather(images: Mapping[int, Any], tokens: Sequence[int]) -> np.ndarray:
    """The embedding rows the placeholders ``tokens`` stand for, in order."""
    parts = []
    i = 0
    while i < len(tokens):
        image, row = image_row(tokens[i])
        j = i + 1
        while j < len(tokens) and image_row(tokens[j]) == (image, row + j - i):
            j += 1
        rows = images.get(image)
        if rows is None or row + j - i > len(rows):
            raise DecodeError(f"no embedding rows for image {image} rows {row}..{row + j - i - 1}")
        parts.append(rows[row:row + j - i])
        i = j
    return np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts), dtype=np.float32)
