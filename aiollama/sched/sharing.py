"""Prefix sharing, the scheduler's policy for a sequence it admits: share the longest prefix some
holder has cached (``seq_cp``: free in a unified cache, a copy in a split one), or get a parked state
back from host memory when that saves at least ``MIN_RESTORE_GAIN`` tokens and half the cells it
takes; and when another running sequence is still prefilling a longer common prefix, wait for it
(``follow``) instead of evaluating the same tokens twice."""

from __future__ import annotations

from collections.abc import Iterable

from aiollama.sched.hostcache import Parked
from aiollama.sched.kvcache import KVManager
from aiollama.sched.kvtree import common_prefix
from aiollama.sched.recurrent import RecurrentKV
from aiollama.sched.sequence import Phase, SeqState

# Sharing a prefix that is still being prefilled is worth waiting for only if it saves this much.
MIN_SHARED_WAIT = 32
# A parked state comes back only if it saves evaluating at least this many tokens.
MIN_RESTORE_GAIN = 16


def share_prefix(kv: KVManager, seq: SeqState, running: Iterable[SeqState]) -> None:
    """Share the longest cached prefix of ``seq``, restore a parked one, or arrange to follow a
    running sequence that is prefilling a longer one."""
    limit = len(seq.tokens) - 1  # at least one token must be evaluated for logits
    if isinstance(kv, RecurrentKV):
        share_state(kv, seq, limit)
        if kv.checkpoints.enabled and not seq.restoring:
            find_lead(seq, running, limit)
        return
    best, best_n = kv.find(seq.tokens, limit, seq.salt)
    best_n = max(best_n, seq.n_cached)
    parked, parked_n = kv.host.best(seq.tokens, limit, seq.salt)
    if parked is not None and parked_n - best_n >= max(MIN_RESTORE_GAIN, len(parked.tokens) // 2) \
            and kv.free_cells(len(parked.tokens) + 1):
        restore_parked(kv, seq, parked, parked_n)
        return
    if best is not None and best is not seq and best_n > seq.n_cached:
        kv.share(seq, best, best_n)
    find_lead(seq, running, limit)


def restore_parked(kv: KVManager, seq: SeqState, parked: Parked, n: int) -> None:
    """``seq`` drops what it holds and gets a parked state back, keeping its first ``n`` positions."""
    if seq.kv is not None:
        kv.truncate(seq, 0)
    kv.restore(seq, parked, n)


def find_lead(seq: SeqState, running: Iterable[SeqState], limit: int) -> None:
    """Follow the running sequence that is prefilling the longest common prefix with ``seq``, where
    that saves at least ``MIN_SHARED_WAIT`` tokens."""
    lead, lead_n = None, 0
    for other in running:
        if other is seq or other.follow is not None or other.salt != seq.salt:
            continue
        n = min(common_prefix(seq.tokens, other.tokens), limit)
        if n > other.n_cached and n > lead_n:
            lead, lead_n = other, n
    if lead is not None and lead_n >= seq.n_cached + MIN_SHARED_WAIT:
        seq.follow = (lead, lead_n)


def share_state(kv: RecurrentKV, seq: SeqState, limit: int) -> None:
    """Recurrent: start from the most of ``seq``'s first ``limit`` tokens that a whole holder, a
    checkpoint or a whole parked state gives (a parked state is put back whole or not at all)."""
    donor, n, saved = kv.find_state(seq.tokens, limit, seq.salt)
    best_n = max(n, seq.n_cached)
    parked, parked_n = kv.host.best(seq.tokens, limit, seq.salt)
    if parked is not None and parked_n == len(parked.tokens) and parked_n - best_n >= MIN_RESTORE_GAIN \
            and kv.free_cells(parked_n + 1):
        restore_parked(kv, seq, parked, parked_n)
        return
    if n > seq.n_cached and donor is not seq:
        kv.share_state(seq, donor, n, saved)


def follow(kv: KVManager, seq: SeqState) -> tuple[bool, int]:
    """Whether ``seq`` still waits for the leader it follows, and how many tokens it gained by
    sharing the leader's cells now that they are there."""
    if seq.follow is None:
        return False, 0
    lead, n = seq.follow
    if isinstance(kv, RecurrentKV) and lead.seq_id is not None and lead.n_cached > n:
        # the leader went past the common prefix (its slices stop there, see RecurrentKV.take, but
        # a preemption or a failed step may have moved it): whatever a checkpoint gives
        seq.follow = None
        before = seq.n_cached
        share_state(kv, seq, len(seq.tokens) - 1)
        return False, seq.n_cached - before
    if lead.seq_id is not None and lead.n_cached >= n and not lead.restoring:
        seq.follow = None
        if n > seq.n_cached:
            gained = n - seq.n_cached
            kv.share(seq, lead, n)
            return False, gained
        return False, 0
    if lead.phase is Phase.RUNNING and lead.seq_id is not None and lead.pending > 1:
        return True, 0
    seq.follow = None  # the leader went away before getting there
    return False, 0
