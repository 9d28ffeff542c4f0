"""Sequence states parked in host memory: the tier below the KV cells. Pure Python.

When cells are needed, a cached prefix or a preempted stream is copied out of the context
(``llama_state_seq_get_data``) and kept here, within a byte budget, least recently used dropped
first. A later conversation that starts with the same tokens gets it back (``set_data``) instead of
evaluating them again. The bytes arrive one step after the decision to park (the executor copies
them out while applying the plan's KV operations), so an entry is pending until then.

With a disk tier (:class:`~aiollama.sched.step.DiskTier`) under it, what leaves host memory for room
is written to disk, and so is a copy reserved ``to_disk`` (a closed conversation's cached prefix);
a state read back from disk comes in by :meth:`HostCache.put`.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from aiollama.formats.images import has_images
from aiollama.sched.kvtree import common_prefix
from aiollama.sched.step import DiskTier

K = TypeVar("K", bound=Hashable)


@dataclass(eq=False)
class Parked:
    key: int
    tokens: list[int] = field(repr=False)
    data: bytes | None = field(default=None, repr=False)  # None while the copy is pending
    last_used: int = 0
    salt: str | None = None  # found only by sequences of the same salt
    to_disk: bool = False  # copied out for the disk tier only

    @property
    def n_bytes(self) -> int:
        return 0 if self.data is None else len(self.data)


class _Node(Generic[K]):
    __slots__ = ("edge", "children", "keys")

    def __init__(self, edge: list[int]) -> None:
        self.edge = edge  # the tokens from the parent to this node
        self.children: dict[int, _Node[K]] = {}
        self.keys: set[K] = set()  # entries whose tokens end here


class TokenTrie(Generic[K]):
    """Keys under token sequences (a radix tree), for the longest common prefix with any of them."""

    def __init__(self) -> None:
        self.root: _Node[K] = _Node([])

    def insert(self, tokens: Sequence[int], key: K) -> None:
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                child = node.children[tokens[pos]] = _Node[K](list(tokens[pos:]))
                node, pos = child, len(tokens)
                break
            m = common_prefix(child.edge, list(tokens[pos:pos + len(child.edge)]))
            if m < len(child.edge):  # split the edge where the new sequence leaves it
                mid = _Node[K](child.edge[:m])
                child.edge = child.edge[m:]
                mid.children[child.edge[0]] = child
                node.children[tokens[pos]] = child = mid
            node, pos = child, pos + m
        node.keys.add(key)

    def remove(self, tokens: Sequence[int], key: K) -> None:
        path, node, pos = [self.root], self.root, 0
        while pos < len(tokens):
            node = node.children[tokens[pos]]
            pos += len(node.edge)
            path.append(node)
        node.keys.discard(key)
        for parent, child in zip(reversed(path[:-1]), reversed(path[1:])):
            if child.keys or child.children:
                break
            del parent.children[child.edge[0]]

    def longest(self, tokens: Sequence[int], limit: int) -> tuple[K | None, int]:
        """A key whose sequence shares the longest prefix with ``tokens``, and that length (at most
        ``limit``)."""
        node, pos = self.root, 0
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            m = common_prefix(child.edge, list(tokens[pos:pos + len(child.edge)]))
            node, pos = child, pos + m
            if m < len(child.edge):
                break
        if node is self.root:
            return None, 0
        stack = [node]  # every key under the node reached shares those tokens
        while stack:
            below = stack.pop()
            if below.keys:
                return next(iter(below.keys)), min(pos, limit)
            stack.extend(below.children.values())
        return None, 0


class HostCache:
    """Parked states keyed by an id, within ``budget`` bytes (0 and no ``disk`` turns the tier off)."""

    def __init__(self, budget: int, disk: DiskTier | None = None) -> None:
        self.budget = budget
        self.disk = disk
        self.used_bytes = 0
        self.dropped = 0  # entries dropped to stay within the budget
        self._entries: dict[int, Parked] = {}
        self._tries: dict[str | None, TokenTrie[int]] = {}  # per salt: the entries whose copy arrived
        self._keys = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.budget > 0 or self.disk is not None

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(self, tokens: Sequence[int], now: int, salt: str | None = None, to_disk: bool = False) -> int:
        """A state of ``tokens`` is being copied out; returns its key."""
        key = next(self._keys)
        self._entries[key] = Parked(key, list(tokens), last_used=now, salt=salt, to_disk=to_disk)
        return key

    def fill(self, key: int, data: bytes) -> None:
        """The copy arrived. Older entries make room for it; one larger than the budget goes to disk
        (or is dropped), and so does one copied for the disk only."""
        entry = self._entries.get(key)
        if entry is None:
            return
        if not data or len(data) > self.budget or entry.to_disk:
            self.discard(key)
            if data:
                self._spill(entry.tokens, entry.salt, data)
            return
        self._add(entry, data)

    def put(self, tokens: Sequence[int], salt: str | None, data: bytes, now: int) -> None:
        """A state read from disk, kept (beyond the budget if need be) until it is put back or
        others push it out."""
        self._add(self._entries[self.reserve(tokens, now, salt)], data)

    def _add(self, entry: Parked, data: bytes) -> None:
        entry.data = data
        self.used_bytes += len(data)
        self._tries.setdefault(entry.salt, TokenTrie[int]()).insert(entry.tokens, entry.key)
        while self.used_bytes > self.budget:
            victims = [e for e in self._entries.values() if e.data is not None and e is not entry]
            if not victims:
                break
            victim = min(victims, key=lambda e: e.last_used)
            assert victim.data is not None
            self._spill(victim.tokens, victim.salt, victim.data)
            self.discard(victim.key)
            self.dropped += 1

    def _spill(self, tokens: Sequence[int], salt: str | None, data: bytes) -> None:
        if self.disk is not None and not has_images(tokens):  # placeholders of pictures are per process
            self.disk.write(tokens, salt, data)

    def best(self, tokens: Sequence[int], limit: int, salt: str | None = None) -> tuple[Parked | None, int]:
        """The parked state of ``salt`` sharing the longest prefix with ``tokens`` (at most ``limit``)."""
        trie = self._tries.get(salt)
        if trie is None:
            return None, 0
        key, n = trie.longest(tokens, limit)
        return (None, 0) if key is None else (self._entries[key], n)

    def take(self, key: int) -> Parked:
        """Remove an entry to restore it."""
        entry = self._entries[key]
        self.discard(key)
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self._tries.clear()
        self.used_bytes = 0

    def discard(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.n_bytes
            if entry.data is not None:
                self._tries[entry.salt].remove(entry.tokens, key)
