"""Prefix sharing, the scheduler's policy for a sequence it admits: share the longest prefix some
holder has cached (``seq_cp``: free in a unified cache, a copy in a split one), or get a parked state
back from host memory when that saves at least ``MIN_RESTORE_GAIN`` tokens and half the cells it
takes; and when another running sequence is still prefilling a longer common prefix, wait for it
(``follow``) instead of evaluating the same tokens twice.

What a cache can share differs with the model's memory, and so do a few rules of the step: those
are the methods of its *rules*, :class:`CellRules` for a transformer's cells and
:class:`StateRules` for a recurrent or hybrid model's states, chosen once when the scheduler is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from aiollama.sampling import MAX_DRAFT_TOKENS
from aiollama.sched.checkpoints import CHECKPOINT_EVERY
from aiollama.sched.hostcache import Parked
from aiollama.sched.kvcache import KVManager
from aiollama.sched.kvtree import common_prefix
from aiollama.sched.recurrent import RecurrentKV
from aiollama.sched.sequence import Phase, SeqState
from aiollama.sched.step import Plan, Slice

# Sharing a prefix that is still being prefilled is worth waiting for only if it saves this much.
MIN_SHARED_WAIT = 32
# A parked state comes back only if it saves evaluating at least this many tokens.
MIN_RESTORE_GAIN = 16


class CellRules:
    """A transformer's cache: cells are shared up to any position, and cut back anywhere."""

    max_draft = MAX_DRAFT_TOKENS  # cells past a rejected draft token can be removed, so steps may carry drafts
    whole_states = False  # a parked state may be put back and cut to any prefix of it

    def __init__(self, kv: KVManager) -> None:
        self.kv = kv

    def cached_prefix(self, seq: SeqState, limit: int) -> int:
        """The most of ``seq``'s first ``limit`` tokens a holder has cached."""
        return self.kv.find(seq.tokens, limit, seq.salt)[1]

    def share_cached(self, seq: SeqState, limit: int) -> bool:
        """``seq``, just admitted, starts with the longest prefix of its first ``limit`` tokens that
        a holder has cached, or gets a parked state back. Returns whether it may still follow a
        running sequence that is prefilling more of its prefix (not after a restore)."""
        kv = self.kv
        best, best_n = kv.find(seq.tokens, limit, seq.salt)
        best_n = max(best_n, seq.n_cached)
        parked, parked_n = kv.host.best(seq.tokens, limit, seq.salt)
        if parked is not None and parked_n - best_n >= max(MIN_RESTORE_GAIN, len(parked.tokens) // 2) \
                and kv.free_cells(len(parked.tokens) + 1):
            restore_parked(kv, seq, parked, parked_n)
            return False
        if best is not None and best is not seq and best_n > seq.n_cached:
            kv.share(seq, best, best_n)
        return True

    def overtaken(self, lead: SeqState, n: int) -> bool:
        """Whether a follower waiting for ``lead``'s first ``n`` tokens can no longer share them:
        never, cells are shared up to any position."""
        return False

    def prefill_take(self, seq: SeqState, take: int, running: Iterable[SeqState]) -> int:
        """How many of ``seq``'s pending tokens its prefill slice takes, of ``take``: all of them."""
        return take

    def after_step(self, plan: Plan, seqs: Mapping[int, SeqState]) -> None:
        """What a decoded step asks of the memory besides its cells: nothing."""

    def discarded(self, seq: SeqState, s: Slice) -> None:
        """``s`` was decoded but its generation ended while the step ran: the executor removed its
        cells, as if it had never been planned (its pending token waits, as after a plain step)."""


class StateRules:
    """A recurrent or hybrid model's memory (:class:`~aiollama.sched.recurrent.RecurrentKV`): a
    state is shared whole or from a checkpoint, and cut back only within its last decode, by up to
    ``rollback`` tokens (llama.cpp's snapshots, where the model has them): drafts are no longer."""

    whole_states = True  # a parked state is put back whole or not at all

    def __init__(self, kv: RecurrentKV, rollback: int = 0) -> None:
        self.kv = kv
        self.max_draft = rollback

    def cached_prefix(self, seq: SeqState, limit: int) -> int:
        """The most of ``seq``'s first ``limit`` tokens a whole holder or a checkpoint gives."""
        return self.kv.find_state(seq.tokens, limit, seq.salt)[1]

    def share_cached(self, seq: SeqState, limit: int) -> bool:
        """Start from the most of ``seq``'s first ``limit`` tokens that a whole holder, a checkpoint
        or a whole parked state gives (a parked state is put back whole or not at all). It may then
        follow a leader only where checkpoints can hold their common prefix."""
        kv = self.kv
        donor, n, saved = kv.find_state(seq.tokens, limit, seq.salt)
        best_n = max(n, seq.n_cached)
        parked, parked_n = kv.host.best(seq.tokens, limit, seq.salt)
        if parked is not None and parked_n == len(parked.tokens) and parked_n - best_n >= MIN_RESTORE_GAIN \
                and kv.free_cells(parked_n + 1):
            restore_parked(kv, seq, parked, parked_n)
        elif n > seq.n_cached and donor is not seq:
            kv.share_state(seq, donor, n, saved)
        return kv.checkpoints.enabled and not seq.restoring

    def overtaken(self, lead: SeqState, n: int) -> bool:
        """The leader went past the common prefix (its slices stop there, see :meth:`prefill_take`,
        but a preemption or a failed step may have moved it): a state cannot be cut back to it."""
        return lead.seq_id is not None and lead.n_cached > n

    def prefill_take(self, seq: SeqState, take: int, running: Iterable[SeqState]) -> int:
        """How many of ``seq``'s pending tokens its prefill slice takes, of ``take``: its last token
        waits for the next step, so that a checkpoint is taken before it, and a slice stops where a
        follower waits to share the whole state (the leader then holds exactly their common prefix)."""
        if seq.score:
            return take
        if take == seq.pending > 1 and self.kv.checkpoints.enabled:
            take -= 1
        for other in running:
            if other.follow is not None and other.follow[0] is seq and 0 < other.follow[1] - seq.n_cached < take:
                take = other.follow[1] - seq.n_cached
        return take

    def after_step(self, plan: Plan, seqs: Mapping[int, SeqState]) -> None:
        """Checkpoint each sequence whose prompt is evaluated but for its last token (the scheduler
        left that token for the next step), and each that went ``CHECKPOINT_EVERY`` tokens of a
        prefill or a generation without one (a reply that a chat client sends back re-tokenized
        differently then loses at most that many tokens)."""
        if not self.kv.checkpoints.enabled:
            return
        for s in plan.slices:
            seq = seqs.get(s.conv)
            if seq is None or seq.seq_id is None or seq.n_cached <= seq.checkpoint_at:
                continue
            if (not s.logits and seq.pending == 1) or seq.n_cached - seq.checkpoint_at >= CHECKPOINT_EVERY:
                self.kv.checkpoint(seq)

    def discarded(self, seq: SeqState, s: Slice) -> None:
        """``s`` was decoded but its generation ended while the step ran. A state cannot be cut back
        (only put back from a checkpoint, with the tokens after it evaluated again): while its tokens
        are the history's, the state after them is kept as evaluated."""
        end = s.pos + len(s.tokens)
        if seq.n_cached == s.pos and end <= len(seq.tokens) and tuple(seq.tokens[s.pos:end]) == s.tokens:
            self.kv.extend(seq, len(s.tokens))
        else:
            self.kv.resync(seq, end)


Rules = CellRules | StateRules


def share_prefix(rules: Rules, seq: SeqState, running: Iterable[SeqState]) -> None:
    """Share the longest cached prefix of ``seq``, restore a parked one, or arrange to follow a
    running sequence that is prefilling a longer one."""
    limit = len(seq.tokens) - 1  # at least one token must be evaluated for logits
    if rules.share_cached(seq, limit):
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


def follow(rules: Rules, seq: SeqState) -> tuple[bool, int]:
    """Whether ``seq`` still waits for the leader it follows, and how many tokens it gained by
    sharing the leader's cells now that they are there."""
    if seq.follow is None:
        return False, 0
    lead, n = seq.follow
    if rules.overtaken(lead, n):  # whatever else the cache gives
        seq.follow = None
        before = seq.n_cached
        rules.share_cached(seq, len(seq.tokens) - 1)
        return False, seq.n_cached - before
    if lead.seq_id is not None and lead.n_cached >= n and not lead.restoring:
        seq.follow = None
        if n > seq.n_cached:
            gained = n - seq.n_cached
            rules.kv.share(seq, lead, n)
            return False, gained
        return False, 0
    if lead.phase is Phase.RUNNING and lead.seq_id is not None and lead.pending > 1:
        return True, 0
    seq.follow = None  # the leader went away before getting there
    return False, 0
