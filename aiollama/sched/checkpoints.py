"""Checkpoints of recurrent states, for recurrent and hybrid models. Pure Python.

A recurrent layer (Mamba, a gated delta net, a short convolution) keeps one state per sequence: the
state after its last position. llama.cpp cannot drop the end of such a sequence, so a rewind, a
prefix hit that ends before a holder's end, or a decode that was cancelled halfway would have to
evaluate everything from position 0 again. A checkpoint is a copy of that state taken at a known
position (``llama_state_seq_get_data_ext`` with ``PARTIAL_ONLY``: the recurrent part only; a hybrid's
KV cells stay where they are and are shared as usual). Put back (``set_data_ext``), and the
positions after it removed, the sequence is as it was there.

Where they are taken (the scheduler decides, see :mod:`aiollama.sched.scheduler`):

- one token before the end of each prompt: a prompt's last token is decoded in a step of its own,
  so that the state before it exists. Regenerating a reply (a rewind to the prompt), forking before
  the reply and a later request with the same prompt all start there, evaluating one token;
- every ``CHECKPOINT_EVERY`` tokens of a long prefill, so that a prompt that leaves a long common
  prefix (an agent's growing context, a shared system prompt) loses at most that many tokens.

They are kept in host memory, within a byte budget and at most ``MAX_CHECKPOINTS`` of them, least
recently used dropped first. The bytes arrive one step after the decision (the executor copies the
state out while applying the next plan's KV operations, before its decode), so an entry is pending
until then and is not used before.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

# a long prefill leaves a checkpoint at least this often (in tokens)
CHECKPOINT_EVERY = 512
# checkpoints kept at most, whatever their size
MAX_CHECKPOINTS = 64


@dataclass(eq=False)
class Saved:
    """The recurrent state after ``tokens`` (of ``salt``)."""

    key: int
    tokens: list[int] = field(repr=False)
    salt: str | None = None
    data: bytes | None = field(default=None, repr=False)  # None while the copy is pending
    last_used: int = 0

    @property
    def n(self) -> int:
        return len(self.tokens)


class CheckpointStore:
    """Checkpoints by the tokens they follow, within ``max_bytes`` and ``MAX_CHECKPOINTS``."""

    def __init__(self, max_bytes: int, max_count: int = MAX_CHECKPOINTS) -> None:
        self.max_bytes = max_bytes
        self.max_count = max_count
        self.n_bytes = 0
        self.taken = self.used = self.dropped = 0
        self._entries: dict[int, Saved] = {}
        self._keys = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_count > 0

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(self, tokens: Sequence[int], tick: int, salt: str | None) -> int | None:
        """A key for the state after ``tokens``, or None when one is kept already (it is then
        refreshed) or none may be."""
        if not self.enabled or not tokens:
            return None
        n = len(tokens)
        for saved in self._entries.values():
            if saved.salt == salt and saved.n == n and saved.tokens == list(tokens):
                saved.last_used = tick
                return None
        key = next(self._keys)
        self._entries[key] = Saved(key, list(tokens), salt, last_used=tick)
        self.taken += 1
        return key

    def fill(self, key: int, data: bytes) -> None:
        """The bytes of a reserved checkpoint arrived (empty: the sequence held nothing)."""
        saved = self._entries.get(key)
        if saved is None:
            return
        if not data or len(data) > self.max_bytes:
            del self._entries[key]
            return
        saved.data = data
        self.n_bytes += len(data)
        self._fit()

    def _fit(self) -> None:
        while self.n_bytes > self.max_bytes or len(self._entries) > self.max_count:
            filled = [s for s in self._entries.values() if s.data is not None]
            if not filled:
                return
            self.drop(min(filled, key=lambda s: s.last_used))
            self.dropped += 1

    def drop(self, saved: Saved) -> None:
        if self._entries.pop(saved.key, None) is not None and saved.data is not None:
            self.n_bytes -= len(saved.data)

    def deepest(self, tokens: Sequence[int], limit: int, salt: str | None) -> Saved | None:
        """The checkpoint of ``salt`` after the most of ``tokens`` (at most ``limit`` of them), whose
        bytes have arrived; None if there is none."""
        best: Saved | None = None
        for saved in self._entries.values():
            if saved.data is None or saved.salt != salt or saved.n > limit or (best is not None and saved.n <= best.n):
                continue
            if list(tokens[:saved.n]) == saved.tokens:
                best = saved
        return best

    def touch(self, saved: Saved, tick: int) -> None:
        saved.last_used = tick
        self.used += 1

    def clear(self) -> None:
        self._entries.clear()
        self.n_bytes = 0
