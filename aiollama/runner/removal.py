"""Cutting a sequence's cells (``seq_rm``), and the recurrent states cut back within their last decode.

A recurrent state is the state after a sequence's last position, so it cannot drop a tail, but for
one exception: with ``Context.rollback`` > 0 llama.cpp keeps snapshots of that many tokens of a
sequence's last decode, and ``seq_rm`` from a position among them rolls the state back. That is how
a drafted step's rejected tokens leave a hybrid or recurrent model's memory. The rollback is
pending until the sequence's next decode, which starts from the snapshot; until then ``seq_cp``
would share the state from before it (and a sequence copied into keeps its own pending index), so
a copy from or into such a sequence first has its state read out and written in again, which
applies the rollback (a read honours it, a write clears it).
"""

from __future__ import annotations

from collections.abc import Iterable

from aiollama.errors import DecodeError
from aiollama.native import Context
from aiollama.runner.ordered import OrderedCells


class Removal:
    """``seq_rm`` for the executor: DecodeError where llama.cpp cannot cut, the deterministic mode's
    cell order kept (``order``), and the rollbacks waiting for their sequence's next decode."""

    def __init__(self, ctx: Context, order: OrderedCells | None) -> None:
        self.ctx = ctx
        self.order = order
        self.pending: set[int] = set()  # seq ids whose state was rolled back since their last decode

    def __call__(self, seq_id: int, p0: int, p1: int) -> None:
        if self.order is not None:
            self.order.hold(seq_id, p0, p1)
        if not self.ctx.seq_rm(seq_id, p0, p1):
            raise DecodeError(f"llama.cpp could not remove positions {p0}..{p1} of sequence {seq_id}")
        if p0 == 0 and p1 < 0:
            self.pending.discard(seq_id)  # all of it: nothing is left to roll back

    def draft(self, seq_id: int, p0: int, p1: int = -1) -> None:
        """The rejected tail of a drafted step, from ``p0``: a recurrent state rolls back."""
        self(seq_id, p0, p1)
        if self.ctx.rollback:
            self.pending.add(seq_id)

    def decoded(self, seq_ids: Iterable[int]) -> None:
        """A decode went through these sequences: their rollbacks are applied (or, after a failed
        decode, undone by the state put back before they run again)."""
        self.pending.difference_update(seq_ids)

    def settle(self, *seq_ids: int) -> None:
        """Apply now the pending rollbacks of ``seq_ids`` (before a copy between sequences)."""
        for seq_id in seq_ids:
            if seq_id in self.pending:
                self.pending.discard(seq_id)
                self.ctx.set_seq_state(seq_id, self.ctx.seq_state(seq_id, partial=True), partial=True)
