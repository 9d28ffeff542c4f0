"""Classifier-free guidance in the plan: a guided generation samples only in a step where it and
the sequence that guides it both have logits. They are admitted, preempted and finished together;
a slice of one whose partner gives no logits in the step waits (a prompt chunk keeps its last token
back for a later step)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from aiollama.sched.sequence import SeqState
from aiollama.sched.step import Slice


def lockstep(slices: list[Slice], seqs: Mapping[int, SeqState]) -> list[Slice]:
    with_logits = {s.conv for s in slices if s.logits}
    kept: list[Slice] = []
    for s in slices:
        seq = seqs[s.conv]
        partner = seq.guide or seq.owner
        if partner is None or not s.logits or partner.conv in with_logits:
            kept.append(s)
        elif len(s.tokens) - s.draft > 1:
            kept.append(Slice(s.conv, s.seq_id, s.pos, s.tokens[:-1 - s.draft], False))
    return kept


def generations(running: Iterable[SeqState]) -> int:
    """How many generations run (a sequence that guides another is part of that one)."""
    return sum(s.owner is None for s in running)
