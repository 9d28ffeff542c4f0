"""One decode step as plain data: the plan the scheduler makes, the result the executor returns, and
the two interfaces that stand between the pure layers and llama.cpp.

The decode thread runs ``schedule() -> Plan``, ``Executor.execute(plan) -> StepResult``, then
``update(plan, result)``. The executor is the only code that calls C; everything else sees only
these values, so the engine can be driven by a fake executor with no model at all.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from aiollama.formats.tokens import Tokenizer
from aiollama.sampling import SamplingParams


@dataclass(frozen=True)
class Remove:
    """``seq_rm(seq_id, p0, -1)``: drop positions from p0 on."""

    seq_id: int
    p0: int = 0


@dataclass(frozen=True)
class Copy:
    """``seq_cp(src, dst, 0, n)``: dst shares src's first n positions."""

    src: int
    dst: int
    n: int


@dataclass(frozen=True)
class Shift:
    """Context shift: drop positions ``[p0, p0 + n)`` of ``seq_id`` and move the later ones down by
    ``n`` (``seq_rm`` then ``seq_add``); the sequence holds its cells alone."""

    seq_id: int
    p0: int
    n: int


@dataclass(frozen=True)
class Park:
    """Copy ``seq_id``'s cells out to host memory, under ``key`` (a ``Remove`` usually follows)."""

    seq_id: int
    key: int


@dataclass(frozen=True)
class Restore:
    """Put a parked state back into ``seq_id`` (which holds nothing); the result says if it fit.
    ``partial``: a checkpoint, only the recurrent state of a recurrent or hybrid model; the KV cells
    ``seq_id`` holds stay (a ``Remove`` from the checkpoint's position usually follows)."""

    seq_id: int
    data: bytes = field(repr=False)
    partial: bool = False


@dataclass(frozen=True)
class Checkpoint:
    """Copy the recurrent state of ``seq_id`` (a recurrent or hybrid model) out to host memory,
    under ``key``: the state after its last position, to put back when it rewinds there or a prefix
    hit ends there."""

    seq_id: int
    key: int


@dataclass(frozen=True)
class Relay:
    """One sequence of a :class:`Compact`: put back from its saved state; with ``donor``, its first
    ``shared`` positions are shared from that (already re-laid) sequence and only the rest is
    restored."""

    seq_id: int
    donor: int | None = None
    shared: int = 0


@dataclass(frozen=True)
class Compact:
    """Re-lay the whole cache (deterministic mode): save every sequence, empty the memory, and put
    them back in this order, so that each holds its cells in position order with no freed cell
    below any of them. Prefixes stay shared."""

    relays: tuple[Relay, ...]


Op = Remove | Copy | Shift | Park | Restore | Checkpoint | Compact


# Not frozen, though never changed after it is made: one is made per stream per step, and a frozen
# dataclass's __init__ costs about 1 us more (object.__setattr__ per field).
@dataclass(slots=True)
class Slice:
    """Consecutive tokens of one sequence in one step. Only a slice that completes the sequence's
    pending tokens asks for logits (of its last token), to sample the next one.

    With ``draft`` > 0 the last ``draft`` tokens are a speculative draft (n-gram, see
    :mod:`aiollama.sched.speculation`; or the draft model's, see :mod:`aiollama.runner.drafter`): logits come
    for the pending token and each draft token, the stream's sampler chooses token after token
    while it agrees with the draft, and the cells of the draft tokens it did not take are removed.
    """

    conv: int
    seq_id: int
    pos: int
    tokens: tuple[int, ...]
    logits: bool
    draft: int = 0
    # With a draft model: the executor drafts up to ``model_draft`` tokens after the pending one
    # (they become ``draft`` tokens of the slice it decodes) from ``history``, the conversation's
    # tokens ending with the pending one (the scheduler's own list, not copied: valid during the step)
    model_draft: int = 0
    history: Sequence[int] = field(default=(), compare=False, repr=False)
    # ``score``: logits for every token, to score the prompt (``history`` holds the tokens after it)
    score: bool = False

    @property
    def cells(self) -> int:
        """The cells this slice may take: its tokens and the draft the executor may add."""
        return len(self.tokens) + self.model_draft


@dataclass(frozen=True)
class Plan:
    """What one step does: KV operations first, then one decode of the slices.

    ``admitted`` lists the conversations that got a seq id in this plan; ``shifted`` the context
    shifts it made, as ``(conv, n_keep, n_dropped)``: tokens ``[n_keep, n_keep + n_dropped)`` left
    that conversation's history. ``lora``: llama.cpp applies adapters per context, so a step
    decodes the sequences of one adapter set.
    """

    ops: tuple[Op, ...] = ()
    slices: tuple[Slice, ...] = ()
    admitted: tuple[int, ...] = ()
    shifted: tuple[tuple[int, int, int], ...] = ()
    lora: tuple[tuple[str, float], ...] = ()  # the LoRA adapters (name, scale) every slice decodes with
    # image number -> its embedding rows, for the placeholders in the slices (aiollama.formats.images);
    # empty when no image is in the engine
    images: Mapping[int, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.slices)

    @property
    def prefilling(self) -> frozenset[int]:
        """Conversations with more than one token in this step: a cancel aborts their decode."""
        return frozenset(s.conv for s in self.slices if len(s.tokens) > 1)


class StepStatus(enum.Enum):
    OK = "ok"
    NO_KV_SLOT = "no_kv_slot"  # nothing was decoded; the KV memory is as it was
    ABORTED = "aborted"  # interrupted by a cancel; ``n_cached`` tells what the context holds
    FAILED = "failed"  # a fatal failure; ``n_cached`` tells what the context holds


# Not frozen, though never changed after it is made: one is made per stream per step, and a frozen
# dataclass's __init__ costs about 1 us more (object.__setattr__ per field).
@dataclass(slots=True)
class Sampled:
    """The token chosen for ``conv``, its bytes, and whether it ends generation (``eog``: an
    end-of-generation token; ``final``: the stream's constraint is complete, nothing may follow).
    With logprobs asked for: its log-probability and the most likely alternatives, as (token,
    log-probability), most likely first. A step with a draft gives a conversation several, in
    order: the accepted draft tokens, then the one chosen after them."""

    conv: int
    token: int
    piece: bytes
    eog: bool
    final: bool = False
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


Scored = tuple[int, int, float, tuple[tuple[int, float], ...], int]  # ..., and the token's rank


@dataclass(frozen=True)
class StepResult:
    status: StepStatus
    sampled: tuple[Sampled, ...] = ()
    n_cached: Mapping[int, int] = field(default_factory=dict)  # conv -> positions held, after a failure
    decode_seconds: float = 0.0
    detail: str = ""  # why a step failed
    parked: Mapping[int, bytes] = field(default_factory=dict)  # Park key -> the state copied out
    restored: Mapping[int, bool] = field(default_factory=dict)  # Restore seq id -> whether it fit
    failed: Mapping[int, BaseException] = field(default_factory=dict)  # conv -> why its row gave no token
    drafted: Mapping[int, int] = field(default_factory=dict)  # conv -> tokens the draft model offered
    # conv -> (position, the token after it, its log-probability, the top alternatives, its rank) of scored rows
    scored: Mapping[int, tuple[Scored, ...]] = field(default_factory=dict)
    checkpoints: Mapping[int, bytes] = field(default_factory=dict)  # Checkpoint key -> the state copied out
    # convs whose rows were decoded but not sampled: their generation ended while the step ran
    # (an overlapped step, planned before the last one's tokens were read): see Rules.discarded
    discarded: frozenset[int] = frozenset()


class Executor(Protocol):
    """Owns the model, the context and every sampler; lives on the decode thread.

    Built on the decode thread (by the factory the engine is given) and closed there.
    ``request_abort`` is the only method another thread may call: the running ``execute`` (or the
    next one) stops early with ``ABORTED``; the request is cleared when ``execute`` returns.
    """

    n_ctx: int  # the tokens one conversation can hold
    n_cells: int  # the KV cells of all seq ids together (n_ctx in a unified cache)
    kv_unified: bool  # one pool of cells for every seq id: each step's attention passes over all used ones
    # "kv"; "hybrid" (KV cells and a recurrent state per sequence) or "recurrent" (the state only): a
    # recurrent state is the state after a sequence's last position, so a sequence cannot drop a
    # tail (Remove from p0 > 0) unless a Checkpoint of the state there is put back first
    memory: str
    placement: str  # where the weights and the KV cache are: CPU, CUDA0, or "CUDA0 (20 of 31 layers), CPU"
    n_seq_max: int
    n_batch: int
    tokenizer: Tokenizer

    def start_sampling(self, conv: int, params: SamplingParams, history: Sequence[int],
                       matcher: Any = None, guidance: tuple[int, float] | None = None) -> None:
        """Prepare ``conv``'s sampler (with an llguidance matcher for a constraint; with
        ``guidance`` = (conv, scale), its logits become ``g + scale * (l - g)`` where ``g`` is the
        row of that conversation in the same step); raises an AiollamaError (GrammarError...) for
        bad params. A sampler that cannot choose (a logits processor raised) puts the conversation
        in ``StepResult.failed``."""
        ...

    def stop_sampling(self, conv: int) -> None: ...

    def execute(self, plan: Plan, on_decode: Callable[[], None] | None = None) -> StepResult:
        """Apply the plan's KV operations, decode its slices and sample. ``on_decode`` is called
        once, right before the decode starts (the consumers' event loops are woken then, so they
        run while it computes); not at all when nothing is decoded."""
        ...

    def request_abort(self) -> None: ...

    def close(self) -> None: ...

    # Between steps (saving and loading a conversation), with the plan's KV operations applied:

    fingerprint: Mapping[str, str | int]  # what a saved state must match: the model and the cache layout
    model_info: Mapping[str, str | int]  # the model: description, ftype, n_params, size, n_embd, n_ctx_train, n_vocab
    can_shift: bool  # the memory can move positions (context shift)

    def embed(self, texts: Sequence[Sequence[int]], normalize: bool) -> list[Any]:
        """A pooled embedding per token list, or without pooling a list of one per token (between
        steps; the KV cache is not touched)."""
        ...

    def read_state(self, seq_id: int) -> bytes:
        """A copy of ``seq_id``'s cells (empty if it holds none)."""
        ...

    def write_state(self, seq_id: int, data: bytes) -> bool:
        """Replace ``seq_id``'s cells with a copy; False (and ``seq_id`` empty) if it does not fit."""
        ...


@runtime_checkable
class Overlapped(Protocol):
    """An executor whose decode runs while the host works: ``submit`` returns once the decode is
    queued (llama_decode on a GPU returns before the device finishes; reading a row's logits or
    sampled token waits for it), and ``collect`` waits for it and samples. ``execute`` is the two
    in a row. Between them the decode thread delivers the last step's tokens."""

    def submit(self, plan: Plan) -> None: ...

    def collect(self, discard: Collection[int] = ()) -> StepResult:
        """The result of the plan submitted last. The rows of the convs in ``discard`` are not
        sampled (their generations ended meanwhile) and come back in ``StepResult.discarded``."""
        ...


@dataclass(frozen=True)
class DiskEntry:
    """A state on disk: its file's name, the tokens and salt it is the state of, its size."""

    name: str
    tokens: tuple[int, ...] = field(repr=False)
    salt: str | None
    n_bytes: int


class DiskTier(Protocol):
    """The prefix cache's tier under host memory (see :mod:`aiollama.core.diskcache`): looked up on
    the decode thread, read and written by a thread of its own."""

    def has(self, tokens: Sequence[int], salt: str | None) -> bool:
        """Whether the state of exactly ``tokens`` is on disk or being written."""
        ...

    def best(self, tokens: Sequence[int], limit: int, salt: str | None) -> tuple[DiskEntry | None, int]:
        """The entry of ``salt`` sharing the longest prefix with ``tokens``, and that length (at most ``limit``)."""
        ...

    def write(self, tokens: Sequence[int], salt: str | None, data: bytes) -> None: ...

    def read(self, entry: DiskEntry) -> None:
        """Start reading ``entry``: its bytes come with a later :meth:`arrivals`."""
        ...

    def arrivals(self) -> list[tuple[str, tuple[int, ...], str | None, bytes | None]]:
        """The reads done since the last call: name, tokens, salt and the state (None: it was bad)."""
        ...

    def clear(self) -> None: ...
