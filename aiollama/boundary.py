"""What crosses the thread boundary: the engine's settings, commands into the decode thread, what
comes out of it (deltas, acknowledgements, statistics), and the one counter both sides share.

Everything here is immutable, except :class:`Admission`, which is locked. Commands go through one
FIFO queue, so a conversation's commands take effect in the order its caller issued them.
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from aiollama._validate import MAX_SEQ, integer
from aiollama.errors import InvalidRequestError
from aiollama.sampling import MAX_DRAFT_TOKENS, SamplingParams


# a draft model's drafts, unless draft_tokens says otherwise
DRAFT_MODEL_TOKENS = 8

# the KV cache element types llama.cpp can use (llama-server's --cache-type-k/-v)
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")

# llama.cpp reserves an output row of n_vocab floats per seq id; the default spends this much on them.
OUTPUT_ROWS_BYTES = 64 * 2**20


@dataclass(frozen=True)
class EngineConfig:
    """An engine's settings, checked on creation; the only place their defaults are written.

    ``model_path`` None means the default model (fetched on first use). ``n_ctx`` is the KV cache
    shared by every conversation; ``n_seq_max`` how many generations share a batch; ``n_batch`` the
    most tokens one ``llama_decode`` takes; ``step_tokens`` the per-step token budget (decode rows of
    running streams first, prompt chunks share the rest); ``n_threads`` None takes the CPUs this
    process may use; ``max_queued`` bounds the generations waiting for a seq id.

    ``cache_seq_ids`` is how many seq ids the context holds beyond ``n_seq_max``, for idle
    conversations and cached prefixes to keep their cells under (the total is at most 256). Each id
    costs llama.cpp an output row of ``n_vocab`` floats, so None takes as many as fit in 64 MiB of
    them (all 256 for a 49k vocabulary, 64 for a 262k one), and at least 32.
    ``host_cache_bytes`` is the host memory that cached prefixes and preempted streams are parked in
    when the context needs their cells (0 turns it off: they are dropped and evaluated again when
    needed). ``context_shift`` is the default policy for a history that outgrows the context: False
    raises ``ContextFull`` (a generation that reaches the end finishes with ``length``); True keeps
    the first ``n_keep`` tokens and drops the older half of the rest. Streams may choose otherwise.
    ``draft_tokens`` > 0 turns on n-gram speculation: decode steps carry drafts of up to that many
    tokens taken from the conversation's own history (0: off; streams may choose otherwise).
    ``draft_model`` is a smaller model with the same vocabulary whose greedy guesses replace the
    n-gram drafts (``draft_tokens`` then defaults to ``DRAFT_MODEL_TOKENS``).
    ``backend_sampling`` runs each stream's sampler chain inside the decode graph where the chain
    allows it (greedy, top-k/p, min-p, temperature, penalties, logit bias; no log-probabilities,
    logits processors, guidance, constraints or drafts): no logits row is read. It pays where rows
    are costly to move (a GPU); each change of a sequence's stream rebuilds the graph.
    ``deterministic`` makes each conversation's logits independent of what runs beside it (see the
    README's numerics section for what is and is not promised): ggml-cpu's reference kernels, flash
    attention, no repacked weights, each sequence's cells in position order; CPU only.
    ``n_gpu_layers`` is how many layers go to the GPU: ``"auto"`` (the default) as many as fit
    (llama.cpp's own fitting, as ``llama-server -ngl auto``; none in a build or on a machine without
    a GPU), -1 all of them, 0 none. ``cache_type_k`` and ``cache_type_v`` are the KV cache's element
    types (f16, q8_0, q4_0...; a quantized V cache needs flash attention); ``flash_attn`` None lets
    llama.cpp choose.
    ``kv_unified`` False splits the cache: each seq id gets ``n_ctx`` / (its number of ids) cells of
    its own (``n_seq_max`` ids, plus ``cache_seq_ids``, which then defaults to 0). A step's attention
    then reads each sequence's own cells instead of passing over everyone's, which is faster with
    many streams; but a conversation holds at most that many tokens, and a fork or a cached prefix
    is copied instead of shared. Not with ``deterministic``.
    """

    model_path: Path | None = None
    n_ctx: int = 8192
    n_seq_max: int = 16
    n_batch: int = 512
    step_tokens: int = 256
    n_threads: int | None = None
    n_gpu_layers: int | str = "auto"
    max_queued: int = 1024
    cache_seq_ids: int | None = None
    host_cache_bytes: int = 2 * 2**30
    context_shift: bool = False
    n_keep: int = 0
    draft_tokens: int = 0
    draft_model: Path | None = None
    deterministic: bool = False
    backend_sampling: bool = False
    kv_unified: bool = True
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: bool | None = None

    def __post_init__(self) -> None:
        integer("n_ctx", self.n_ctx, low=1)
        integer("n_seq_max", self.n_seq_max, low=1, high=MAX_SEQ)
        integer("n_batch", self.n_batch, low=1)
        integer("step_tokens", self.step_tokens, low=1)
        if self.n_threads is not None:
            integer("n_threads", self.n_threads, low=1)
        if self.n_gpu_layers != "auto":
            integer("n_gpu_layers", self.n_gpu_layers, low=-1)
        for name in ("cache_type_k", "cache_type_v"):
            if getattr(self, name) not in CACHE_TYPES:
                raise InvalidRequestError(f"{name} must be one of {', '.join(CACHE_TYPES)}, got {getattr(self, name)!r}")
        if self.flash_attn is not None and not isinstance(self.flash_attn, bool):
            raise InvalidRequestError(f"flash_attn must be True, False or None, got {self.flash_attn!r}")
        if self.flash_attn is False and self.cache_type_v not in ("f32", "f16", "bf16"):
            raise InvalidRequestError(f"a {self.cache_type_v} V cache needs flash attention: give flash_attn=True or None")
        integer("max_queued", self.max_queued, low=0)
        if self.cache_seq_ids is not None:
            integer("cache_seq_ids", self.cache_seq_ids, low=0)
        integer("draft_tokens", self.draft_tokens, low=0, high=MAX_DRAFT_TOKENS)
        integer("host_cache_bytes", self.host_cache_bytes, low=0)
        integer("n_keep", self.n_keep, low=0)
        if not isinstance(self.context_shift, bool):
            raise InvalidRequestError(f"context_shift must be a bool, got {self.context_shift!r}")
        if not isinstance(self.deterministic, bool):
            raise InvalidRequestError(f"deterministic must be a bool, got {self.deterministic!r}")
        if not isinstance(self.backend_sampling, bool):
            raise InvalidRequestError(f"backend_sampling must be a bool, got {self.backend_sampling!r}")
        if not isinstance(self.kv_unified, bool):
            raise InvalidRequestError(f"kv_unified must be a bool, got {self.kv_unified!r}")
        if self.deterministic and not self.kv_unified:
            raise InvalidRequestError("deterministic mode keeps its cells in one unified cache: give kv_unified=True")
        if self.deterministic and self.n_gpu_layers not in (0, "auto"):
            raise InvalidRequestError("deterministic mode runs on the CPU: give n_gpu_layers=0")
        if self.deterministic and (self.cache_type_k, self.cache_type_v) != ("f16", "f16"):
            raise InvalidRequestError("deterministic mode keeps an f16 KV cache")
        if self.model_path is not None:
            object.__setattr__(self, "model_path", Path(self.model_path))
        if self.draft_model is not None:
            if not isinstance(self.draft_model, (str, os.PathLike)):
                raise InvalidRequestError(f"draft_model must be a path, got {self.draft_model!r}")
            object.__setattr__(self, "draft_model", Path(self.draft_model))
            if self.draft_tokens == 0:
                object.__setattr__(self, "draft_tokens", DRAFT_MODEL_TOKENS)

    def context_seq_ids(self, n_vocab: int) -> int:
        """The seq ids of the context: ``n_seq_max`` generating, the rest holding cached prefixes."""
        extra = self.cache_seq_ids
        if extra is None and not self.kv_unified:
            extra = 0  # every id splits the cache further
        elif extra is None:
            extra = max(32, OUTPUT_ROWS_BYTES // (4 * max(1, n_vocab)))
        return min(MAX_SEQ, self.n_seq_max + extra)

    @classmethod
    def from_options(cls, model_path: Any = None, **options: Any) -> EngineConfig:
        """Build from keyword options; an unknown name raises ``InvalidRequestError`` naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidRequestError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(model_path, **options)


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


@dataclass(frozen=True)
class Delta:
    """One step's output for one stream.

    ``text`` and ``tokens`` are what the stream shows; ``history`` is every token the step appended
    to the conversation (also an end-of-generation token, which the stream does not show).
    ``dropped`` is a context shift, ``(n_keep, n)``: tokens ``[n_keep, n_keep + n)`` left the
    history before ``history`` was appended. The last delta carries ``stats``.
    """

    text: str = ""
    tokens: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    error: BaseException | None = None
    history: tuple[int, ...] = ()
    dropped: tuple[int, int] | None = None
    stats: GenerationStats | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


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


@dataclass(frozen=True)
class Vectors:
    """The answer to an :class:`Embed`: one vector per text, in order."""

    vectors: list[list[float]] = field(repr=False)


Item = Delta | Ack | Snapshot | Vectors


class Portal(Protocol):
    """Runs a callback in the consumer's context (its event loop, or at once for threads).

    ``send`` never blocks the decode thread; it returns False when nobody can receive any more (the
    event loop is closed). ``owner`` is the event loop (or trio token) it delivers into. What was
    sent runs once ``wake`` is called (the decode thread does so as its next decode starts, or
    before it waits), through the event loop's own thread-safe channel; a portal for plain threads
    delivers in ``send`` and its ``wake`` does nothing.
    """

    @property
    def owner(self) -> Any: ...

    def send(self, callback: Callable[[], None]) -> bool: ...

    def wake(self) -> None: ...


class Sink(Protocol):
    """Where a stream's items go. ``deliver`` runs through ``portal``, in the consumer's context."""

    portal: Portal

    def deliver(self, item: Item) -> None: ...


@dataclass(frozen=True)
class NewConversation:
    conv: int
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class Prompt:
    """Append tokens; while the conversation generates, they wait until that generation ends."""

    conv: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Fork:
    """A new conversation ``child`` holding the first ``n_tokens`` tokens of ``parent``'s history."""

    parent: int
    child: int
    n_tokens: int


@dataclass(frozen=True)
class Generate:
    """Start generating; ``matcher`` is the compiled constraint (llguidance), if any; ``guide`` the
    conversation whose logits guide this one's (classifier-free guidance) with ``guidance_scale``;
    ``created``: when the caller asked (``time.perf_counter()``)."""

    conv: int
    params: SamplingParams
    sink: Sink
    matcher: Any = None
    guide: int | None = None
    guidance_scale: float = 1.0
    created: float = 0.0


@dataclass(frozen=True)
class Cancel:
    """End the conversation's generation, if any, with ``FinishReason.CANCELLED``."""

    conv: int


@dataclass(frozen=True)
class Close:
    """Cancel, then free the conversation's seq id and cells; ``ack`` gets an :class:`Ack`."""

    conv: int
    ack: Sink | None = None


@dataclass(frozen=True)
class Rewind:
    """Keep only the first ``n_tokens`` tokens of a conversation that does not generate."""

    conv: int
    n_tokens: int


@dataclass(frozen=True)
class Save:
    """Answer with a :class:`Snapshot` of the conversation."""

    conv: int
    sink: Sink


@dataclass(frozen=True)
class Load:
    """A new conversation ``conv`` holding ``tokens``, with the cells of the first ``n_cached``
    restored from ``state`` when they fit (evaluated again otherwise); answered with an Ack."""

    conv: int
    tokens: tuple[int, ...] = field(repr=False)
    n_cached: int
    state: bytes = field(repr=False)
    sink: Sink


@dataclass(frozen=True)
class Embed:
    """Embed token lists; answered with :class:`Vectors` (or a Delta carrying the error)."""

    texts: tuple[tuple[int, ...], ...] = field(repr=False)
    normalize: bool
    sink: Sink


@dataclass(frozen=True)
class ClearCache:
    """Drop every cache entry and every parked state; ``ack`` gets an :class:`Ack`."""

    ack: Sink


@dataclass(frozen=True)
class Shutdown:
    pass


Command = (NewConversation | Prompt | Fork | Generate | Cancel | Close | Rewind | Save | Load | ClearCache
           | Embed | Shutdown)


class Admission:
    """The count of generations waiting for a seq id, shared by callers and the decode thread.

    A caller enters before sending ``Generate`` (or gets ``False``: the engine is overloaded); the
    decode thread leaves once the generation is admitted or ended.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._count = 0
        self._lock = threading.Lock()

    def enter(self) -> bool:
        with self._lock:
            if self._count >= self.limit:
                return False
            self._count += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._count -= 1


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
    weights_device: str = "CPU"  # where the weights are: CPU, CUDA0, or "CUDA0 (20 of 31 layers), CPU"
    kv_device: str = "CPU"  # where the KV cache is (each layer's beside its weights)

    @property
    def python_overhead(self) -> float:
        """Share of step time spent outside ``llama_decode``."""
        return 0.0 if self.step_seconds <= 0 else 1.0 - self.decode_seconds / self.step_seconds
