"""What the scheduler is built from and what it tells the decode thread, as typed values: its
:class:`SchedulerConfig`, a generation's :class:`Progress`, a conversation's :class:`Held` state
for saving, and the cache's :class:`SchedulerStats`. Nothing outside ``sched/`` sees a sequence or
the KV manager; it sees these."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MEMORIES = ("kv", "hybrid", "recurrent")


@dataclass(frozen=True)
class SchedulerConfig:
    """How a scheduler is built. ``n_ctx`` is what one sequence can hold and ``n_cells`` the cells of
    all (``n_ctx`` when None); ``n_seq_max`` the context's seq ids (holders of cached prefixes
    included) and ``max_running`` how many sequences may generate at once (all when None).
    ``host_bytes``: the host memory that parked states may take. ``can_shift``: the memory can move
    positions (a context shift). ``ordered``: each sequence's cells stay in position order (the
    deterministic mode). ``draft_model``: drafts come from the executor's draft model, not n-grams.
    ``kv_unified``: one pool of cells for every seq id (idle cells are then given back under load).
    ``memory``: "kv", or "hybrid" and "recurrent" for models with recurrent states, checkpointed in
    ``checkpoint_bytes`` of host memory. ``whole_images``: a picture's rows go in one step.
    ``rollback``: the tokens of its last decode a recurrent state can drop (drafts on a recurrent or
    hybrid model are no longer)."""

    n_ctx: int
    n_seq_max: int
    n_batch: int
    step_tokens: int
    n_cells: int | None = None
    max_running: int | None = None
    host_bytes: int = 0
    can_shift: bool = True
    ordered: bool = False
    draft_model: bool = False
    kv_unified: bool = False
    memory: str = "kv"
    checkpoint_bytes: int = 0
    whole_images: bool = False
    rollback: int = 0

    def __post_init__(self) -> None:
        if self.step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {self.step_tokens}")
        if self.memory not in MEMORIES:
            raise ValueError(f"memory must be one of {MEMORIES}, got {self.memory!r}")


@dataclass(frozen=True)
class Progress:
    """Where one conversation's generation stands: its history's length and cached part, and what
    its prompt cost (``prompt_tokens`` is -1 until it is first admitted)."""

    n_tokens: int
    n_cached: int
    prompt_tokens: int
    cached_tokens: int
    prompt_evaluated: int
    preemptions: int
    restores: int
    drafted: int
    accepted: int


@dataclass(frozen=True)
class Held:
    """What a conversation holds, to be saved: its history, and the state of its first ``n_cached``
    positions, either in the context under ``seq_id`` (the executor reads it) or parked in host
    memory (``parked``); ``n_cached`` is 0 when neither holds it. ``images``: the embedding rows of
    the pictures in its history, by image number."""

    tokens: tuple[int, ...]
    seq_id: int | None
    n_cached: int
    parked: bytes | None = None
    images: Mapping[int, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's share of the engine's statistics (see :class:`aiollama.Statistics`)."""

    live: int = 0
    active: int = 0
    queued: int = 0
    kv_cells_used: int = 0
    kv_cells_cached: int = 0
    kv_cells_total: int = 0
    seq_ids_used: int = 0
    cache_entries: int = 0
    n_seq_max: int = 0
    cache_hit_tokens: int = 0
    parked: int = 0
    parked_bytes: int = 0
    parks: int = 0
    restores: int = 0
    evictions: int = 0
    preemptions: int = 0
    compactions: int = 0
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    checkpoints_used: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    disk_loads: int = 0
