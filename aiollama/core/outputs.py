"""What comes out of the decode thread: each stream's deltas and its generation's statistics, the
answers to other commands, and the engine's statistics. Immutable values, safe on any thread."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class FinishReason(str, enum.Enum):
    """How a generation ended. A ``str``: ``reason == "eog"`` and ``json.dumps`` keep working."""

    EOG = "eog"  # the model ended its turn (an end-of-generation token)
    STOP = "stop"  # a stop string appeared (it is not part of the text)
    LENGTH = "length"  # max_tokens, or the context is full
    CANCELLED = "cancelled"  # cancelled by the caller, or the engine closed under it
    ERROR = "error"  # the stream raised (only on Stream.finish_reason; never in a Delta)

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


@dataclass(frozen=True)
class GenerationStats:
    """What one generation cost and where its time went, on its last chunk and its completion.

    ``prompt_tokens``: the history it continued; ``cached_tokens``: how many of those were not
    evaluated (shared from the KV cache or restored from host memory); ``prompt_evaluated``: prompt
    tokens it evaluated (re-evaluations after a preemption included); ``decode_steps``: steps that
    gave it tokens; ``preemptions``: how often it was stopped to free cells; ``restores``: how often
    its state came back from host memory; ``drafted`` and ``accepted``: speculative draft tokens
    evaluated, and those the sampler took.

    Times, in seconds, measured on the decode thread from the ``stream()`` call:
    ``queue_seconds`` until it first got a sequence (admission), ``prefill_seconds`` from then to
    its first token, ``decode_seconds`` from its first token to its end; ``total_seconds`` is their
    sum, and ``time_to_first_token`` ``queue_seconds + prefill_seconds``. A generation that ends
    before its first token has ``decode_seconds`` 0.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    restores: int = 0
    drafted: int = 0
    accepted: int = 0
    prompt_evaluated: int = 0
    decode_steps: int = 0
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def time_to_first_token(self) -> float:
        return self.queue_seconds + self.prefill_seconds

    @property
    def total_seconds(self) -> float:
        return self.queue_seconds + self.prefill_seconds + self.decode_seconds


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability, and the ``top`` most likely tokens at its place, as
    (token, log-probability), most likely first (from the whole row, before any truncation)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # a scored prompt token's rank in its row (1: the most likely)


# Not frozen, though never changed after it is made: one is made per stream per step, and a frozen
# dataclass's __init__ costs about 1 us more (object.__setattr__ per field).
@dataclass(slots=True)
class Delta:
    """One step's output for one stream.

    ``text`` and ``tokens`` are what the stream shows; ``history`` is every token the step appended
    to the conversation (also an end-of-generation token, which the stream does not show).
    ``dropped`` is a context shift, ``(n_keep, n)``: tokens ``[n_keep, n_keep + n)`` left the
    history before ``history`` was appended. The last delta carries ``stats``, and ``stop`` the
    stop string that ended the generation (finish reason STOP). ``progress`` is a prompt's
    evaluation so far (its tokens, of those found cached, of those in the cache now), for a
    generation that asked for it.
    """

    text: str = ""
    tokens: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    error: BaseException | None = None
    history: tuple[int, ...] = ()
    dropped: tuple[int, int] | None = None
    stats: GenerationStats | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    stop: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # scored prompt tokens (the second on), in order
    progress: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Ack:
    """The answer to a :class:`Close` or a :class:`Load`: done."""


@dataclass(frozen=True)
class Snapshot:
    """The answer to a :class:`Save`: the history, and a copy of the cells holding its first
    ``n_cached`` tokens (empty when none are cached)."""

    tokens: tuple[int, ...] = field(repr=False)
    n_cached: int
    state: bytes = field(repr=False)
    images: Mapping[int, Any] = field(default_factory=dict, repr=False)  # the rows of its pictures, by number


@dataclass(frozen=True)
class Vectors:
    """The answer to an :class:`Embed`: one vector per text, in order (without pooling, a list of
    one vector per token)."""

    vectors: list[Any] = field(repr=False)


Item = Delta | Ack | Snapshot | Vectors


STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # seconds


@dataclass(frozen=True)
class Statistics:
    """A snapshot of the engine, published by the decode thread after every step."""

    live: int = 0  # conversations not closed
    active: int = 0  # generating, holding a seq id
    queued: int = 0  # waiting for a seq id
    kv_cells_used: int = 0  # by conversations and by the prefix cache
    kv_cells_cached: int = 0  # of those, held only by the cache (prefixes of closed conversations)
    kv_cells_total: int = 0
    seq_ids_used: int = 0  # held by conversations and by cache entries
    cache_entries: int = 0
    n_seq_max: int = 0  # generations that may run at once
    tokens_evaluated: int = 0  # rows decoded: prompts, re-evaluations and sampled tokens
    tokens_generated: int = 0
    decode_steps: int = 0
    aborted_steps: int = 0  # decodes interrupted by a cancel (their partial KV is kept consistent)
    discarded_tokens: int = 0  # overlapped steps: rows decoded for streams that ended meanwhile, not counted above
    decode_seconds: float = 0.0  # inside llama_decode
    step_seconds: float = 0.0  # whole steps: planning, batch filling, decode, sampling, delivery
    step_histogram: tuple[int, ...] = ()  # steps per step_buckets interval, the last one unbounded
    step_buckets: tuple[float, ...] = field(default=STEP_BUCKETS)
    cache_hit_tokens: int = 0  # prompt tokens not evaluated: shared from the KV cache or restored
    parked: int = 0  # states parked in host memory now
    parked_bytes: int = 0
    parks: int = 0  # states copied out to host memory
    restores: int = 0  # states put back from host memory
    evictions: int = 0  # idle holders that gave cells back
    preemptions: int = 0  # running streams stopped to free cells
    compactions: int = 0  # deterministic mode: the cache re-laid to reclaim freed cells
    checkpoints: int = 0  # recurrent and hybrid models: checkpoints of recurrent states kept now
    checkpoint_bytes: int = 0
    checkpoints_used: int = 0  # states put back from a checkpoint (a rewind, a prefix hit, a failed step)
    drafted_tokens: int = 0  # speculative draft tokens verified (n-gram or draft model)
    accepted_tokens: int = 0  # of those, the tokens the sampler took (each saved a decode step)
    disk_loads: int = 0  # states read back from the disk tier (see EngineConfig.cache_dir)
    disk_entries: int = 0  # states of this model on disk now
    disk_bytes: int = 0
    weights_device: str = "CPU"  # where the weights are: CPU, CUDA0, or "CUDA0 (20 of 31 layers), CPU"
    kv_device: str = "CPU"  # where the KV cache is (each layer's beside its weights)

    @property
    def python_overhead(self) -> float:
        """Share of step time spent outside ``llama_decode``."""
        return 0.0 if self.step_seconds <= 0 else 1.0 - self.decode_seconds / self.step_seconds
