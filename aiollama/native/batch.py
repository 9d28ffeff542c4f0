"""Batch: the rows of one llama_decode call.

Each row is a token at a position in one or more sequences, and may ask for logits. The batch checks
what it can know on its own (capacity, seq ids per row, positions that continue within the batch);
:meth:`aiollama.native.Context.decode` checks the rest against the context (n_batch, vocabulary,
n_seq_max, positions that continue the cached sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiollama._validate import MAX_SEQ, integer
from aiollama.errors import InvalidBatchError, InvalidSeqIdError, InvalidTokenError
from aiollama.native.binding import ffi, lib
from aiollama.native.handle import Handle

__all__ = ["MAX_SEQ", "Batch"]


class Batch(Handle):
    """A reusable llama_batch of up to ``capacity`` rows, each in up to ``n_seq_max`` sequences.
    With ``n_embd`` > 0 its rows are embeddings of that width (an image's) instead of tokens."""

    _kind = "batch"

    def __init__(self, capacity: int, n_seq_max: int = 1, *, n_embd: int = 0) -> None:
        integer("capacity", capacity, low=1)
        integer("n_seq_max", n_seq_max, low=1, high=MAX_SEQ)
        integer("n_embd", n_embd, low=0)
        self.capacity = capacity
        self.n_seq_max = n_seq_max
        self.n_embd = n_embd
        self._own(lib.llama_batch_init(capacity, n_embd, n_seq_max))
        self.clear()

    def _free(self, ptr: Any) -> None:
        lib.llama_batch_free(ptr)

    def clear(self) -> None:
        """Drop every row; the memory is kept for the next step."""
        self.n_tokens = 0
        self.outputs: list[int] = []
        self.first_pos: dict[int, int] = {}  # seq id -> its first position in this batch
        self._next_pos: dict[int, int] = {}
        self.max_token = -1
        self.max_seq_id = -1
        self.shares_rows = False  # some row belongs to several sequences

    def _place(self, count: int, pos: int, seq_ids: Sequence[int]) -> None:
        """Check that ``count`` rows at ``pos..`` for ``seq_ids`` fit, and record the positions."""
        if self.n_tokens + count > self.capacity:
            raise InvalidBatchError(
                f"batch is full: {self.n_tokens} + {count} rows exceed its capacity of {self.capacity}")
        if pos < 0:
            raise InvalidBatchError(f"position must be >= 0, got {pos}")
        if not seq_ids:
            raise InvalidSeqIdError("a row needs at least one seq id")
        if len(seq_ids) > self.n_seq_max:
            raise InvalidSeqIdError(
                f"a row may belong to at most {self.n_seq_max} sequences in this batch, got {len(seq_ids)}")
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidSeqIdError(f"repeated seq id in one row: {list(seq_ids)}")
        for s in seq_ids:
            integer("seq_id", s)
            if s < 0:
                raise InvalidSeqIdError(f"seq id must be >= 0, got {s}")
            expected = self._next_pos.get(s)
            if expected is not None and pos != expected:
                raise InvalidBatchError(
                    f"position gap in sequence {s}: the batch holds it up to {expected - 1}, "
                    f"the next row is at {pos}")
        for s in seq_ids:
            self.first_pos.setdefault(s, pos)
            self._next_pos[s] = pos + count
        self.max_seq_id = max(self.max_seq_id, *seq_ids)
        if len(seq_ids) > 1:
            self.shares_rows = True

    def add(self, token: int, pos: int, seq_ids: int | Sequence[int], output: bool = False) -> int:
        """Append one row and return its index in the batch."""
        self._holds("tokens")
        integer("token", token)
        integer("pos", pos)
        if token < 0:
            raise InvalidTokenError(f"token id must be >= 0, got {token}")
        ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        self._place(1, pos, ids)
        c = self._get()
        i = self.n_tokens
        c.token[i] = token
        c.pos[i] = pos
        c.n_seq_id[i] = len(ids)
        row = c.seq_id[i]
        for j, s in enumerate(ids):
            row[j] = s
        c.logits[i] = 1 if output else 0
        if output:
            self.outputs.append(i)
        self.max_token = max(self.max_token, token)
        self.n_tokens = i + 1
        return i

    def add_tokens(self, tokens: Sequence[int], pos: int, seq_id: int, *, output_last: bool = False,
                   n_outputs: int = 0) -> int:
        """Append consecutive tokens of one sequence from ``pos`` on; return the index of the last row.
        ``output_last`` asks for the last row's logits, ``n_outputs`` for the last ``n_outputs`` rows'."""
        integer("pos", pos)
        self._holds("tokens")
        ids = list(tokens)
        if not ids:
            raise InvalidBatchError("add_tokens needs at least one token")
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise InvalidTokenError("token ids must be ints")
        if min(ids) < 0:
            raise InvalidTokenError(f"token id must be >= 0, got {min(ids)}")
        k = len(ids)
        c, n = self._rows(k, pos, seq_id)
        c.token[n:n + k] = ids
        last = n + k - 1
        n_out = max(int(output_last), integer("n_outputs", n_outputs, low=0, high=k))
        for row in range(last - n_out + 1, last + 1):
            c.logits[row] = 1
            self.outputs.append(row)
        self.max_token = max(self.max_token, max(ids))
        self.n_tokens = n + k
        return last

    def add_embeddings(self, rows: Any, pos: int, seq_id: int) -> None:
        """Append consecutive embedding rows (a float32 array of ``(n, n_embd)``) of one sequence
        from ``pos`` on; they ask for no logits."""
        integer("pos", pos)
        self._holds("embeddings")
        shape: tuple[int, ...] = tuple(getattr(rows, "shape", ()))
        if len(shape) != 2 or shape[1] != self.n_embd or shape[0] < 1 or str(getattr(rows, "dtype", "")) != "float32":
            raise InvalidBatchError(f"embedding rows must be a float32 array of shape (n, {self.n_embd}), got "
                                    f"{shape} {getattr(rows, 'dtype', type(rows).__name__)}")
        k = int(shape[0])
        c, n = self._rows(k, pos, seq_id)
        ffi.memmove(c.embd + n * self.n_embd, ffi.from_buffer(rows), k * self.n_embd * 4)
        self.n_tokens = n + k

    def _rows(self, k: int, pos: int, seq_id: int) -> tuple[Any, int]:
        """Check and place ``k`` rows of one sequence from ``pos`` on, asking no logits; the batch
        and the index of the first (the caller fills in their tokens or embeddings)."""
        self._place(k, pos, [seq_id])
        c = self._get()
        n = self.n_tokens
        c.pos[n:n + k] = list(range(pos, pos + k))
        c.n_seq_id[n:n + k] = [1] * k
        c.logits[n:n + k] = [0] * k
        seq_rows = c.seq_id
        for i in range(n, n + k):
            seq_rows[i][0] = seq_id
        return c, n

    def _holds(self, kind: str) -> None:
        if (kind == "embeddings") != (self.n_embd > 0):
            raise InvalidBatchError(f"this batch holds {'embeddings' if self.n_embd else 'tokens'}, not {kind}")

    def __len__(self) -> int:
        return self.n_tokens
