"""Idle cells under load, in a unified cache. Every step's attention in a unified cache passes over
every used cell (llama.cpp's ``n_kv`` runs to the highest used cell), so cells that only idle
holders hold (idle conversations, cache entries) slow every running stream, more the more the cache
has served. Whenever generations start or end while others run, idle holders give back the cells
only they hold, least recently used first, down to ``IDLE_CELLS``: parked in host memory when it has
room (a later hit is then a copy, not an evaluation). With nothing running they stay."""

from __future__ import annotations

from collections.abc import Iterable

from aiollama.sched.kvcache import KVManager
from aiollama.sched.kvtree import Span
from aiollama.sched.sequence import Phase, SeqState, unique_cells

# the cells idle holders may keep while generations run (llama.cpp pads a step's span to 256 anyway)
IDLE_CELLS = 256


def trim_idle(kv: KVManager, running: Iterable[SeqState], budget: int | None = None) -> int:
    """Give back idle cells down to ``budget`` (``IDLE_CELLS``); return how many holders gave some."""
    budget = IDLE_CELLS if budget is None else budget
    live: set[Span] = set()
    n_live = 0
    for seq in running:
        span = seq.kv
        while span is not None and span not in live:
            live.add(span)
            n_live += span.length
            span = span.parent
    idle = kv.cells.used - n_live
    if idle <= budget:
        return 0
    # least recently used first: first the cells each holds alone, then, for cells several idle
    # holders share, whole holders
    order = sorted((h for h in kv.holders() if h.phase is not Phase.RUNNING and h.kv is not None),
                   key=lambda h: h.last_used)
    trimmed = 0
    for whole in (False, True):
        for victim in order:
            if idle <= budget:
                return trimmed
            if victim.seq_id is None or victim.kv is None or victim.kv in live \
                    or (not whole and unique_cells(victim) == 0):
                continue  # gone already, or all it holds is held by running ones
            used = kv.cells.used
            kv.evict(victim, victim.n_cached if whole else idle - budget, whole=whole)
            idle -= used - kv.cells.used
            trimmed += 1
    return trimmed
