"""Context shift: a history that has filled the context keeps its first ``n_keep`` tokens and drops
the older half of what follows, moving the cached rest down when it holds those cells alone."""

from __future__ import annotations

from aiollama.sched.kvcache import KVManager
from aiollama.sched.sequence import SeqState, unique_cells


def shift_size(n_ctx: int, length: int, keep: int) -> int:
    """How many tokens after the first ``keep`` a shift drops from a history of ``length``: the older
    ones, leaving about half of the room after ``keep`` filled."""
    return length - keep - (n_ctx - 1 - keep) // 2


def shift(kv: KVManager, seq: SeqState, n_ctx: int, can_shift: bool) -> tuple[int, int]:
    """Shift ``seq`` (its ``n_keep`` is set); return ``(n_keep, n_dropped)``. Cells shared with another
    holder cannot move: then the kept tail is evaluated again."""
    assert seq.n_keep is not None
    keep = seq.n_keep
    n = shift_size(n_ctx, len(seq.tokens), keep)
    if can_shift and seq.n_cached > keep + n and unique_cells(seq) >= seq.n_cached - keep:
        kv.shift(seq, keep, n)
    else:
        kv.truncate(seq, min(seq.n_cached, keep))
    del seq.tokens[keep:keep + n]
    return keep, n
