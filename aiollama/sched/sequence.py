"""The decode thread's state of one conversation (a *sequence*; the public word is conversation), or
of one cache entry: its tokens, its phase, the seq id it holds and the cells on its path of the
prefix tree, and what its current generation asked for and cost."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from aiollama.sched.kvtree import Span
from aiollama.sched.speculation import DraftLength


class Phase(enum.Enum):
    IDLE = "idle"  # no generation asked for; may hold a seq id and KV as a cache
    WAITING = "waiting"  # wants to generate, has no seq id yet
    RUNNING = "running"  # has a seq id and work in flight


@dataclass(eq=False)
class SeqState:
    """The decode thread's state of one conversation, or of one cache entry (``entry``)."""

    conv: int
    tokens: list[int]
    phase: Phase = Phase.IDLE
    seq_id: int | None = None
    kv: Span | None = None
    last_used: int = 0  # when it was last used: the least recently used idle one is evicted first
    started: int = 0  # admission order: the newest running one is preempted first
    follow: tuple[SeqState, int] | None = None  # (leader, prefix length) it waits to share
    entry: bool = False  # a cache entry: a closed conversation's prefix, no conversation behind it
    salt: str | None = None  # shares cells only with holders of the same salt
    score: bool = False  # its generation scores the prompt: evaluate it whole, every row's logits
    lora: tuple[tuple[str, float], ...] = ()  # LoRA adapters (name, scale): decoded only beside the same
    restoring: bool = False  # a parked state is being put back this step: no tokens for it yet
    checkpoint_at: int = 0  # recurrent: where its last checkpoint was taken (or it started from one)
    n_keep: int | None = None  # context shift: keep this many first tokens; None: no shift
    draft: DraftLength | None = None  # n-gram speculation for the current generation; None: none
    end_at: int | None = None  # the history's length once max_tokens are generated (drafts stop short of it)
    priority: int = 0  # of the current generation: lower values are admitted, evaluated and kept first
    queued_at: float = 0.0  # when it was submitted (its priority improves with the wait)
    preempted: bool = False  # waits after a preemption: first among its equals
    loading: str | None = None  # waits for the state of its prefix to be read from disk (the file's name)
    guide: SeqState | None = None  # classifier-free guidance: the sequence decoded in lockstep with it
    owner: SeqState | None = None  # this sequence guides ``owner``'s generation
    # what the current generation cost (reset when it is submitted)
    prompt_tokens: int = -1  # history at its first admission; -1 before
    cached_tokens: int = 0  # of those, not evaluated
    preemptions: int = 0
    restores: int = 0
    prompt_evaluated: int = 0  # history tokens evaluated (not sampled rows)

    @property
    def n_cached(self) -> int:
        kv = self.kv  # cached(self.kv), inline: read several times a stream and step
        return 0 if kv is None else kv.start + len(kv.tokens)

    @property
    def pending(self) -> int:
        kv = self.kv
        return len(self.tokens) - (0 if kv is None else kv.start + len(kv.tokens))


def unique_cells(seq: SeqState) -> int:
    """Cells only ``seq`` holds: the end of its path that nobody else's passes through."""
    n, span = 0, seq.kv
    while span is not None and span.refs == 1:
        n += span.length
        span = span.parent
    return n
