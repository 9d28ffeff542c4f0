"""A fake of llama.cpp's unified KV cache, with its rules: positions continue each sequence, seq_cp
shares cells, a cell is freed with its last sequence, and a batch that does not fit is refused.
Each cell keeps its token, so a fake model can read a sequence back."""

from __future__ import annotations

from collections.abc import Sequence

from aiollama.step import Copy, Op, Plan, Remove


class FakeKV:
    def __init__(self, n_ctx: int, n_seq_max: int) -> None:
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.cells: list[tuple[int, set[int], int]] = []  # (pos, seq ids, token) of used cells

    @property
    def used(self) -> int:
        return len(self.cells)

    def pos_max(self, seq_id: int) -> int:
        return max((p for p, ids, _ in self.cells if seq_id in ids), default=-1)

    def positions(self, seq_id: int) -> list[int]:
        return sorted(p for p, ids, _ in self.cells if seq_id in ids)

    def tokens(self, seq_id: int) -> list[int]:
        """The tokens ``seq_id`` holds, in position order."""
        return [t for _, _, t in sorted((p, ids, t) for p, ids, t in self.cells if seq_id in ids)]

    def apply(self, ops: Sequence[Op]) -> None:
        for op in ops:
            if isinstance(op, Remove):
                self.cells = [(p, ids - {op.seq_id} if p >= op.p0 else ids, t) for p, ids, t in self.cells]
                self.cells = [(p, ids, t) for p, ids, t in self.cells if ids]
            else:
                assert isinstance(op, Copy)
                for p, ids, _ in self.cells:
                    if op.src in ids and p < op.n:
                        ids.add(op.dst)

    def fits(self, plan: Plan) -> bool:
        return self.used + plan.n_tokens <= self.n_ctx

    def decode(self, plan: Plan, limit: int | None = None) -> bool:
        """Store the plan's tokens (only the first ``limit`` of them: an interrupted decode);
        False (memory untouched) when they do not fit."""
        if not self.fits(plan):
            return False
        stored = 0
        for s in plan.slices:
            assert 0 <= s.seq_id < self.n_seq_max
            assert s.pos == self.pos_max(s.seq_id) + 1, (s, self.pos_max(s.seq_id))
            for i, token in enumerate(s.tokens):
                if limit is not None and stored >= limit:
                    return True
                self.cells.append((s.pos + i, {s.seq_id}, token))
                stored += 1
        return True
