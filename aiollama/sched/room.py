"""Room for a step, when its slices need more KV cells than are free: drafts go first (they never
evict anything), then idle holders give theirs back (least recently used first, parked in host
memory when it has room), then prompt chunks shrink, then the newest stream of the lowest priority
is preempted (parked too, it resumes first among its equals when room returns)."""

from __future__ import annotations

from collections.abc import Callable

from aiollama.sched.images import whole
from aiollama.sched.kvcache import KVManager
from aiollama.sched.step import Slice

# preempt(only_if_several): stop the running generation that gives way first and return its
# conversations; nothing (an empty set) when none runs, or only one and only_if_several
Preempt = Callable[[bool], set[int]]


def fit(slices: list[Slice], kv: KVManager, preempt: Preempt, whole_images: bool = False) -> list[Slice]:
    """Drop or shrink ``slices`` until they fit in the free cells, evicting and preempting
    (``whole_images``: a shrunk slice cuts no picture, see :func:`aiollama.sched.images.whole`)."""
    def need() -> int:
        return sum(s.cells for s in slices)

    total = need()
    kv.free_cells(total - sum(s.draft + s.model_draft for s in slices))  # drafts never evict anything
    if total <= kv.cells.free:  # most steps
        return slices
    starved = False
    slices = [Slice(s.conv, s.seq_id, s.pos, s.tokens[:1], True) if s.draft or s.model_draft else s
              for s in slices]  # drafts go first
    while need() > kv.cells.free:
        prompt_slices = [i for i, s in enumerate(slices) if len(s.tokens) > 1 or not s.logits]
        if not prompt_slices:
            break
        i = prompt_slices[-1]
        s = slices[i]
        keep = len(s.tokens) - (need() - kv.cells.free)
        if whole_images and keep > 0:
            keep = whole(s.tokens, 0, keep)
        if keep <= 0:
            del slices[i]
            starved = True
        else:
            slices[i] = Slice(s.conv, s.seq_id, s.pos, s.tokens[:keep], False)
    while need() > kv.cells.free:
        gone = preempt(False)
        if not gone:
            break
        slices = [s for s in slices if s.conv not in gone]
    if starved and not slices:
        preempt(True)  # not even a prompt chunk fits: the newest stream gives way, so the others progress
    return slices
