"""A fake of llama.cpp's unified KV cache, with its rules: positions continue each sequence, seq_cp
shares cells, a cell is freed with its last sequence, and a batch that does not fit is refused.
Each cell keeps its token, so a fake model can read a sequence back.

``ordered`` fakes the deterministic mode's executor: a freed cell stays held (a tombstone) until a
``Compact`` re-lays the cache, so a batch fits only in the cells above them.

``recurrent`` fakes a hybrid model's memory: beside its cells each sequence has a recurrent state,
the tokens it has seen (None: half computed, after a failed decode). As in llama.cpp, ``seq_cp``
gives the destination the source's whole state whatever the range, a ``Remove`` that would cut into
a state fails (the fake asserts), a checkpoint copies the state out and a partial ``Restore`` puts
one back, and a decode asserts that the state is the one after the sequence's cells: a scheduler
that breaks a rule fails here, not in a model's nonsense. With ``rollback`` > 0 a state can also be
rolled back (``roll_back``) by up to that many of the tokens its last decode gave it, once between
decodes, as llama.cpp's ``n_rs_seq`` snapshots allow: how a rejected draft leaves it."""

from __future__ import annotations

import pickle
from collections.abc import Sequence

from aiollama.sched.step import (
    Checkpoint,
    Compact,
    Copy,
    Op,
    Park,
    Plan,
    Relay,
    Remove,
    Restore,
    Shift,
)


class FakeKV:
    def __init__(self, n_ctx: int, n_seq_max: int, *, ordered: bool = False, recurrent: bool = False,
                 rollback: int = 0) -> None:
        self.recurrent = recurrent
        self.rollback = rollback
        self.last: dict[int, int] = {}  # recurrent: seq id -> tokens its last decode gave it (0: rolled back since)
        self.states: dict[int, tuple[int, ...] | None] = {}  # recurrent: seq id -> the tokens its state saw
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.cells: list[tuple[int, set[int], int]] = []  # (pos, seq ids, token) of used cells
        self.ordered = ordered
        self.tombstones = 0  # ordered: freed cells still held
        self.compactions = 0

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

    def apply(self, ops: Sequence[Op]) -> dict[str, dict[int, bytes] | dict[int, bool]]:
        """Apply KV operations; return what was parked and checkpointed (by key) and restored (by
        seq id), as StepResult's fields."""
        parked: dict[int, bytes] = {}
        restored: dict[int, bool] = {}
        checkpoints: dict[int, bytes] = {}
        for op in ops:
            if isinstance(op, Remove):
                if self.recurrent:
                    state = self.states.get(op.seq_id, ())
                    assert op.p0 == 0 or state is not None and op.p0 >= len(state), \
                        f"seq_rm({op.seq_id}, {op.p0}) cuts into a recurrent state of " \
                        f"{None if state is None else len(state)}"
                    if op.p0 == 0:
                        self.states.pop(op.seq_id, None)
                self.remove(op.seq_id, op.p0)
            elif isinstance(op, Copy):
                self.last.pop(op.dst, None)
                for p, ids, _ in self.cells:
                    if op.src in ids and p < op.n:
                        ids.add(op.dst)
                if self.recurrent:
                    self.states[op.dst] = self.states.get(op.src, ())
            elif isinstance(op, Checkpoint):
                assert self.recurrent
                checkpoints[op.key] = pickle.dumps(self.states.get(op.seq_id, ()))
            elif isinstance(op, Shift):
                assert not self.recurrent, "a recurrent state cannot move positions"
                self.remove(op.seq_id, op.p0, op.p0 + op.n)
                for p, ids, _ in self.cells:
                    assert op.seq_id not in ids or len(ids) == 1 or p < op.p0, "a shared cell moved"
                self.cells = [(p - op.n if op.seq_id in ids and p >= op.p0 + op.n else p, ids, t)
                              for p, ids, t in self.cells]
            elif isinstance(op, Park):
                parked[op.key] = self.read(op.seq_id)
            elif isinstance(op, Compact):
                self.compact(op.relays)
            elif isinstance(op, Restore) and op.partial:
                assert self.recurrent
                self.last.pop(op.seq_id, None)  # a state put back has no snapshots
                self.states[op.seq_id] = pickle.loads(op.data)
                restored[op.seq_id] = True
            else:
                assert isinstance(op, Restore)
                self.last.pop(op.seq_id, None)
                restored[op.seq_id] = self.write(op.seq_id, op.data)
        return {"parked": parked, "restored": restored, "checkpoints": checkpoints}

    def remove(self, seq_id: int, p0: int = 0, p1: int | None = None) -> None:
        def gone(p: int) -> bool:
            return p >= p0 and (p1 is None or p < p1)
        self.cells = [(p, ids - {seq_id} if gone(p) else ids, t) for p, ids, t in self.cells]
        used = len(self.cells)
        self.cells = [(p, ids, t) for p, ids, t in self.cells if ids]
        if self.ordered:
            self.tombstones += used - len(self.cells)

    def roll_back(self, seq_id: int, p0: int) -> None:
        """A recurrent state goes back to position ``p0`` within its last decode (its cells after
        it go too); the fake asserts llama.cpp's bounds."""
        assert self.recurrent
        state = self.states.get(seq_id)
        assert state is not None
        n = len(state) - p0
        assert 1 <= n <= min(self.rollback, self.last.get(seq_id, 0)), \
            f"seq_rm({seq_id}, {p0}) rolls back {n} tokens: {self.rollback} snapshots, {self.last.get(seq_id, 0)} decoded"
        self.last[seq_id] = 0  # once between decodes
        self.states[seq_id] = state[:p0]
        self.remove(seq_id, p0)

    def compact(self, relays: Sequence[Relay]) -> None:
        """Save every sequence, empty the cache, put each back: a donor's first positions shared,
        the rest from the saved cells. A sequence left out of the relays loses its cells."""
        assert self.ordered
        saved = {r.seq_id: self.read(r.seq_id) for r in relays}
        self.cells, self.tombstones = [], 0
        self.compactions += 1
        for r in relays:
            held = pickle.loads(saved[r.seq_id]) if saved[r.seq_id] else []
            self.cells += [(p, {r.seq_id}, t) for p, t in held if p >= r.shared]
            if r.donor is not None:
                donated = [ids for p, ids, _ in self.cells if r.donor in ids and p < r.shared]
                assert len(donated) == r.shared, "the donor does not hold the shared positions"
                for ids in donated:
                    ids.add(r.seq_id)

    def read(self, seq_id: int) -> bytes:
        """A sequence's cells (and recurrent state) as bytes (as llama_state_seq_get_data gives them)."""
        held = sorted((p, t) for p, ids, t in self.cells if seq_id in ids)
        if self.recurrent:
            return pickle.dumps((held, self.states.get(seq_id, ()))) if held else b""
        return pickle.dumps(held) if held else b""

    def write(self, seq_id: int, data: bytes) -> bool:
        """Put cells back into an emptied sequence; False (and nothing) if they do not fit."""
        self.remove(seq_id)
        self.states.pop(seq_id, None)
        held = pickle.loads(data)
        if self.recurrent:
            held, state = held
        if self.used + self.tombstones + len(held) > self.n_ctx:
            return False
        self.cells += [(p, {seq_id}, t) for p, t in held]
        if self.recurrent:
            self.states[seq_id] = state
        return True

    def fits(self, plan: Plan) -> bool:
        return self.used + self.tombstones + plan.n_tokens <= self.n_ctx

    def decode(self, plan: Plan, limit: int | None = None) -> bool:
        """Store the plan's tokens (only the first ``limit`` of them: an interrupted decode);
        False (memory untouched) when they do not fit."""
        if not self.fits(plan):
            return False
        stored = 0
        for s in plan.slices:
            assert 0 <= s.seq_id < self.n_seq_max
            assert s.pos == self.pos_max(s.seq_id) + 1, (s, self.pos_max(s.seq_id))
            if self.recurrent:
                assert self.states.get(s.seq_id, ()) == tuple(self.tokens(s.seq_id)), \
                    f"seq {s.seq_id}: its recurrent state is not the one after its cells"
                if limit is not None:  # a failed decode leaves the state of its sequences half computed
                    self.states[s.seq_id] = None
                self.last[s.seq_id] = len(s.tokens) if limit is None else 0
        for s in plan.slices:
            for i, token in enumerate(s.tokens):
                if limit is not None and stored >= limit:
                    return True
                self.cells.append((s.pos + i, {s.seq_id}, token))
                if self.recurrent and limit is None:
                    self.states[s.seq_id] = (*(self.states.get(s.seq_id) or ()), token)
                stored += 1
        return True
