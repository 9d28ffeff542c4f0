"""Speculation in a step: decode slices of drafting streams get an n-gram draft after their pending
token (:mod:`aiollama.sched.speculation`), or room for the draft model's, as many as pay for their
rows (:mod:`aiollama.sched.rowcost`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from aiollama.sched import speculation
from aiollama.sched.sequence import SeqState
from aiollama.sched.step import Slice

# While what a row costs is not known, draft tokens add at most this many rows to a step in all
# (the decode rows count too): drafts pay where steps are small, not where the batch is already full.
MAX_DRAFT_ROWS = 32
# ... and a step already that full still takes this many every other step, so that steps differ
# in rows and the cost can be fitted
PROBE_ROWS = 4


def add_drafts(slices: list[Slice], drafting: list[int], seqs: Mapping[int, SeqState], *, n_batch: int, n_ctx: int,
               draft_model: bool, share: Callable[[int], float] | None = None, probe: bool = True) -> int:
    """Extend the decode slices at ``drafting`` with drafts, in place; return the rows added.
    ``share(rows)``: the share of a step of that many rows that its rows take
    (:mod:`aiollama.sched.rowcost`), None while not known. Where it is known a stream drafts the
    tokens likely enough to be taken to pay for their rows, counted with the rows the drafts before
    it added (:meth:`~aiollama.sched.speculation.DraftLength.worth`), up to the batch: where a step's
    time hardly depends on its rows (a GPU) many streams draft; where each row costs its own compute
    (a CPU) few do. Where it is not, a step holds at most ``MAX_DRAFT_ROWS`` rows with its drafts,
    and a fuller one takes ``PROBE_ROWS`` draft rows if ``probe``."""
    spare = n_batch - len(slices)
    if share is None:
        spare = min(spare, max(MAX_DRAFT_ROWS - len(slices), PROBE_ROWS if probe else 0))
    added = 0
    for i in drafting:
        s = slices[i]
        seq = seqs[s.conv]
        assert seq.draft is not None
        limit = min(seq.draft.offer(), spare - added, n_ctx - 1 - s.pos)
        if seq.end_at is not None:  # a token after the pending one, one after each draft token taken: none past the end
            limit = min(limit, seq.end_at - len(seq.tokens) - 1)
        if limit > 0 and share is not None:
            limit = min(limit, seq.draft.worth(share(len(slices) + added + 1)))
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
