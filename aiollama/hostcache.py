"""Sequence states parked in host memory: the tier below the KV cells. Pure Python.

When cells are needed, a cached prefix or a preempted stream is copied out of the context
(``llama_state_seq_get_data``) and kept here, within a byte budget, least recently used dropped
first. A later conversation that starts with the same tokens gets it back (``set_data``) instead of
evaluating them again. The bytes arrive one step after the decision to park (the executor copies
them out while applying the plan's KV operations), so an entry is pending until then.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class Parked:
    key: int
    tokens: list[int] = field(repr=False)
    data: bytes | None = field(default=None, repr=False)  # None while the copy is pending
    last_used: int = 0

    @property
    def n_bytes(self) -> int:
        return 0 if self.data is None else len(self.data)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists (of one type: a list never equals a tuple),
    comparing slices at C speed."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class HostCache:
    """Parked states keyed by an id, within ``budget`` bytes (0 turns the tier off)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used_bytes = 0
        self.dropped = 0  # entries dropped to stay within the budget
        self._entries: dict[int, Parked] = {}
        self._keys = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(self, tokens: Sequence[int], now: int) -> int:
        """A state of ``tokens`` is being copied out; returns its key."""
        key = next(self._keys)
        self._entries[key] = Parked(key, list(tokens), last_used=now)
        return key

    def fill(self, key: int, data: bytes) -> None:
        """The copy arrived. Older entries make room for it; one larger than the budget is dropped."""
        entry = self._entries.get(key)
        if entry is None:
            return
        if not data or len(data) > self.budget:
            self.discard(key)
            return
        entry.data = data
        self.used_bytes += len(data)
        while self.used_bytes > self.budget:
            victim = min((e for e in self._entries.values() if e.data is not None and e is not entry),
                         key=lambda e: e.last_used)
            self.discard(victim.key)
            self.dropped += 1

    def best(self, tokens: Sequence[int], limit: int) -> tuple[Parked | None, int]:
        """The parked state sharing the longest prefix with ``tokens`` (at most ``limit``)."""
        found, best_n = None, 0
        for entry in self._entries.values():
            if entry.data is None:
                continue
            n = min(common_prefix(tokens, entry.tokens), limit)
            if n > best_n:
                found, best_n = entry, n
        return found, best_n

    def take(self, key: int) -> Parked:
        """Remove an entry to restore it."""
        entry = self._entries.pop(key)
        self.used_bytes -= entry.n_bytes
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self.used_bytes = 0

    def discard(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.n_bytes
