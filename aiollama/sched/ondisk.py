"""The scheduler's side of the disk tier (:class:`~aiollama.sched.step.DiskTier`): a generation whose
prefix is on disk, and longer than what the cells and host memory hold, waits unadmitted while a
thread reads it; the state then comes into host memory and the generation is admitted, and
:mod:`~aiollama.sched.sharing` puts it back like any parked state. A closed conversation's cached
prefix is copied out to disk once (the copy comes with the next step's result)."""

from __future__ import annotations

from collections.abc import Iterable

from aiollama.formats.images import has_images
from aiollama.sched.kvcache import MIN_PARK_TOKENS
from aiollama.sched.sequence import SeqState
from aiollama.sched.sharing import MIN_RESTORE_GAIN, Rules
from aiollama.sched.step import DiskTier


def load_before_admission(rules: Rules, disk: DiskTier | None, seq: SeqState) -> None:
    """Start reading the longest prefix of ``seq`` on disk when it saves more than the other tiers
    (by the rules a parked state comes back by); ``seq`` waits for it."""
    limit = len(seq.tokens) - 1  # at least one token must be evaluated for logits
    if disk is None or limit < MIN_RESTORE_GAIN or has_images(seq.tokens):
        return
    entry, n = disk.best(seq.tokens, limit, seq.salt)
    if entry is None or (rules.whole_states and n != len(entry.tokens)):
        return
    _, in_host = rules.kv.host.best(seq.tokens, limit, seq.salt)
    have = max(rules.cached_prefix(seq, limit), seq.n_cached, in_host)
    gain = MIN_RESTORE_GAIN if rules.whole_states else max(MIN_RESTORE_GAIN, len(entry.tokens) // 2)
    if n - have >= gain:
        disk.read(entry)
        seq.loading = entry.name


def take_arrivals(rules: Rules, disk: DiskTier | None, waiting: Iterable[SeqState]) -> int:
    """States read from disk go into host memory, and the generations that waited for them may be
    admitted. Returns how many came (a bad file gives none: its generation evaluates its prompt)."""
    if disk is None:
        return 0
    arrived = disk.arrivals()
    if not arrived:
        return 0
    kv, loaded = rules.kv, 0
    for name, tokens, salt, data in arrived:
        if data:
            kv.host.put(tokens, salt, data, kv.tick())
            loaded += 1
        for seq in waiting:
            if seq.loading == name:
                seq.loading = None
    return loaded


def keep_on_disk(rules: Rules, disk: DiskTier | None, seq: SeqState) -> None:
    """``seq`` is closing: copy its cached prefix out to disk unless it is there already."""
    if disk is None or seq.seq_id is None or seq.n_cached < MIN_PARK_TOKENS:
        return
    tokens = seq.tokens[:seq.n_cached]
    if not has_images(tokens) and not disk.has(tokens, seq.salt):
        rules.kv.park(seq, to_disk=True)
