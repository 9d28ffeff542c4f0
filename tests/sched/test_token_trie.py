"""The radix trie over parked states, against a brute-force search."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aiollama.sched.hostcache import TokenTrie
from aiollama.sched.kvtree import common_prefix

sequences = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@given(st.lists(st.tuples(st.booleans(), sequences), max_size=40), st.lists(sequences, min_size=1, max_size=5))
@settings(max_examples=300, deadline=None)
def test_longest_prefix_matches_a_brute_force_search(ops: list[tuple[bool, list[int]]], probes: list[list[int]]) -> None:
    trie = TokenTrie()
    stored: dict[int, list[int]] = {}
    for key, (insert, tokens) in enumerate(ops):
        if insert or not stored:
            trie.insert(tokens, key)
            stored[key] = tokens
        else:
            gone = sorted(stored)[len(tokens) % len(stored)]
            trie.remove(stored.pop(gone), gone)
    for probe in probes:
        for limit in (len(probe), max(0, len(probe) - 2)):
            expected = max((min(common_prefix(probe, t), limit) for t in stored.values()), default=0)
            key, n = trie.longest(probe, limit)
            assert n == expected
            if n:
                assert key is not None and stored[key][:n] == probe[:n]
