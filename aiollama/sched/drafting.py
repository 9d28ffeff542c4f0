"""Speculation in a step: decode slices of drafting streams get an n-gram draft after their pending
token (:mod:`aiollama.sched.speculation`), or room for the draft model's, within ``MAX_DRAFT_ROWS``
rows a step in all: drafts pay where steps are small, not where the batch is already full."""

from __future__ import annotations

from collections.abc import Mapping

from aiollama.sched import speculation
from aiollama.sched.sequence import SeqState
from aiollama.sched.step import Slice

# Draft tokens add at most this many rows to a step in all (the decode rows count too).
MAX_DRAFT_ROWS = 32


def add_drafts(slices: list[Slice], drafting: list[int], seqs: Mapping[int, SeqState], *, n_batch: int, n_ctx: int,
               draft_model: bool, share: float = 0.0) -> int:
    """Extend the decode slices at ``drafting`` with drafts, in place; return the rows added.
    ``share``: the share of the step's time its rows take; a stream drafts the tokens likely
    enough to be taken to pay for their rows (:meth:`~aiollama.sched.speculation.DraftLength.worth`)."""
    spare = min(n_batch, MAX_DRAFT_ROWS) - len(slices)
    added = 0
    for i in drafting:
        s = slices[i]
        seq = seqs[s.conv]
        assert seq.draft is not None
        limit = min(seq.draft.offer(), spare - added, n_ctx - 1 - s.pos)
        if seq.end_at is not None:  # a token after the pending one, one after each draft token taken: none past the end
            limit = min(limit, seq.end_at - len(seq.tokens) - 1)
        if limit > 0:
            limit = min(limit, seq.draft.worth(share))
        if draft_model:
            if limit > 0:
                slices[i] = Slice(s.conv, s.seq_id, s.pos, s.tokens, True, model_draft=limit, history=seq.tokens)
                added += limit
            continue
        tokens = speculation.draft(seq.tokens, limit)
        if tokens:
            slices[i] = Slice(s.conv, s.seq_id, s.pos, s.tokens + tokens, True, len(tokens))
            added += len(tokens)
    return added
