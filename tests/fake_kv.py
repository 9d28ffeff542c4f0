"""A fake of llama.cpp's unified KV cache, with its rules: positions continue each sequence, seq_cp
shares cells, a cell is freed with its last sequence, and a batch that does not fit is refused."""

from __future__ import annotations

from aiollama.scheduler import Copy, Plan, Remove


class FakeKV:
    def __init__(self, n_ctx: int, n_seq_max: int) -> None:
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.cells: list[tuple[int, set[int]]] = []  # (pos, seq ids) of used cells

    @property
    def used(self) -> int:
        return len(self.cells)

    def pos_max(self, seq_id: int) -> int:
        return max((p for p, ids in self.cells if seq_id in ids), default=-1)

    def positions(self, seq_id: int) -> list[int]:
        return sorted(p for p, ids in self.cells if seq_id in ids)

    def apply(self, plan: Plan) -> None:
        for op in plan.ops:
            if isinstance(op, Remove):
                self.cells = [(p, ids - {op.seq_id} if p >= op.p0 else ids) for p, ids in self.cells]
                self.cells = [(p, ids) for p, ids in self.cells if ids]
            else:
                assert isinstance(op, Copy)
                for p, ids in self.cells:
                    if op.src in ids and p < op.n:
                        ids.add(op.dst)

    def decode(self, plan: Plan) -> bool:
        """Store the plan's rows; False (memory untouched) when they do not fit."""
        if self.used + plan.n_tokens > self.n_ctx:
            return False
        for row in plan.rows:
            assert 0 <= row.seq_id < self.n_seq_max
            assert row.pos == self.pos_max(row.seq_id) + 1, (row, self.pos_max(row.seq_id))
            for i in range(len(row.tokens)):
                self.cells.append((row.pos + i, {row.seq_id}))
        return True
