"""The deterministic mode's cell order, on the decode thread: the executor's side of what
:mod:`aiollama.sched.kvcache` describes.

Flash attention's reference path sums a row's cells in cell order, and llama.cpp gives a new token
the lowest free cell, so a freed cell below a sequence would take its next token out of order.
Here a cell is never freed: what a removal drops goes to a tombstone sequence (the context's last
seq id) first; a :class:`~aiollama.sched.step.Compact` re-lays the cache from saved states, each prefix
restored once and shared again, and the tombstones' cells are free.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from aiollama.errors import DecodeError, StateRestoreError, UnsupportedModel
from aiollama.native import Batch, Context, DecodeStatus, Model, seqstate
from aiollama.sched.step import Relay


class OrderedCells:
    """Keeps every sequence's cells of ``ctx`` in position order, with ``tombstone`` the seq id
    that holds freed cells."""

    def __init__(self, ctx: Context, tombstone: int) -> None:
        self.ctx = ctx
        self.tombstone = tombstone

    def check(self, model: Model, batch: Batch) -> None:
        """The model's cache must be one this can re-lay: one plain KV cache (its saved states
        readable by :mod:`~aiollama.native.seqstate`), and no sliding window, which reuses a
        sequence's old cells. Raises UnsupportedModel."""
        name = Path(model.path).name
        if model.n_swa > 0:
            raise UnsupportedModel(f"{name} cannot run in deterministic mode: its sliding window "
                                   f"({model.n_swa} tokens) reuses a sequence's old cells, out of position order")
        try:
            batch.clear()
            batch.add_tokens((0,), 0, 0)
            if self.ctx.decode(batch) is not DecodeStatus.OK:
                raise DecodeError("the first decode failed")
            seqstate.layout(self.ctx.seq_state(0))
        except (seqstate.StateFormatError, DecodeError) as exc:
            raise UnsupportedModel(f"{name} cannot run in deterministic mode: its KV cache cannot be "
                                   f"kept in position order ({exc})") from exc
        finally:
            batch.clear()
            self.ctx.memory_clear()

    def hold(self, seq_id: int, p0: int, p1: int) -> None:
        """Before positions ``[p0, p1)`` of ``seq_id`` are removed: the tombstone keeps their cells."""
        self.ctx.seq_cp(seq_id, self.tombstone, p0, p1)

    def compact(self, relays: Sequence[Relay]) -> None:
        """Save every sequence, empty the cache, and put each back in order: with a donor, share
        its first positions and restore only the rest, so prefixes stay shared."""
        saved = [self.ctx.seq_state(r.seq_id) for r in relays]
        self.ctx.memory_clear()
        for relay, data in zip(relays, saved):
            part = seqstate.ordered(data, relay.shared) if data else b""
            if part:
                try:
                    self.ctx.set_seq_state(relay.seq_id, part)
                except StateRestoreError as exc:
                    raise DecodeError(f"re-laying the cache: {exc}") from exc
            if relay.donor is not None:
                self.ctx.seq_cp(relay.donor, relay.seq_id, 0, relay.shared)
