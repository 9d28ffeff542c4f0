"""The executor: the only code on the decode thread that calls llama.cpp.

It owns the model, the context, the batch and one sampler chain per generating conversation, and
turns a :class:`~aiollama.sched.step.Plan` into a :class:`~aiollama.sched.step.StepResult`: apply the plan's KV
operations, fill the batch, run ``llama_decode`` (the GIL is released while it runs), sample each
slice that asks for logits, and read the chosen tokens' bytes. It decides nothing: what to decode
and what a token means for its stream are the scheduler's and the generations' business.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from aiollama._validate import MAX_SEQ
from aiollama.config import EngineConfig
from aiollama.errors import (
    InvalidRequestError,
    StateRestoreError,
    UnsupportedModel,
)
from aiollama.formats.tokens import Tokenizer
from aiollama.native import (
    Batch,
    Context,
    DecodeStatus,
    LoraAdapter,
    Model,
    Projector,
    seqstate,
)
from aiollama.native.devices import fit, placement
from aiollama.native.params import context_params
from aiollama.runner.drafter import with_drafts
from aiollama.runner.embedder import Embedder, is_embedding_model
from aiollama.runner.images import ImageRows, images_for
from aiollama.runner.mtp import MTP_HYBRIDS, MtpDrafter, drafter_for, kept_tokens
from aiollama.runner.ordered import OrderedCells
from aiollama.runner.removal import Removal
from aiollama.runner.shape import check_rollback, context_options, model_info
from aiollama.runner.token_choice import Sampling, verify
from aiollama.runner.tokenizer import VocabTokenizer
from aiollama.sampling import SamplingParams
from aiollama.sched.step import (
    Checkpoint,
    Compact,
    Copy,
    Op,
    Park,
    Plan,
    Remove,
    Restore,
    Shift,
    Slice,
    StepResult,
    StepStatus,
)


def load_model(config: EngineConfig, path: Path, *, no_alloc: bool = False) -> Model:
    """The model, its layers on the GPU as ``config.n_gpu_layers`` says: "auto" fits as many as
    leave room for a context of the configured shape (none without a GPU, and none in the
    deterministic mode, which runs on the CPU). ``no_alloc``: its metadata only, for a plan."""
    if config.n_gpu_layers != "auto":
        return Model(path, n_gpu_layers=int(config.n_gpu_layers), repack=not config.deterministic, no_alloc=no_alloc,
                     load_mtp=config.mtp)
    if config.deterministic:
        return Model(path, n_gpu_layers=0, repack=False, no_alloc=no_alloc, load_mtp=config.mtp)
    # the seq ids are known once the vocabulary is: their output rows weigh little beside the cache
    shape = context_params(n_ctx=config.n_ctx, n_batch=config.n_batch,
                           n_seq_max=min(MAX_SEQ, config.n_seq_max + (config.cache_seq_ids or 32)),
                           n_threads=config.n_threads, kv_unified=config.kv_unified, flash_attn=config.flash_attn,
                           cache_type_k=config.cache_type_k, cache_type_v=config.cache_type_v)
    return Model(path, fitted=fit(path, shape), no_alloc=no_alloc, load_mtp=config.mtp)


Applied = dict[str, Any]  # what a plan's KV operations gave: parked, restored and checkpoints (StepResult's fields)


def fingerprint(model: Model, cache_types: tuple[str, str] = ("f16", "f16")) -> dict[str, str | int]:
    """What a saved sequence state must match to be put back: the model (its description, sizes and
    vocabulary) and the layout of its cache (the element types of its keys and values)."""
    vocab = model.vocab
    texts = hashlib.sha256()
    for token in range(vocab.n_tokens):
        texts.update(vocab.token_text(token).encode() + b"\0")
    return {"model": model.description(), "n_params": model.n_params, "size": model.size,
            "n_vocab": vocab.n_tokens, "n_embd": model.n_embd, "n_layer": model.n_layer,
            "vocab_sha256": texts.hexdigest(),
            "kv": f"{'f16' if cache_types == ('f16', 'f16') else '/'.join(cache_types)},unified"}


def recurrent_config(config: EngineConfig, name: str, arch: str | None) -> EngineConfig:
    """The settings a recurrent or hybrid model runs with: checkpoints (see
    :mod:`aiollama.sched.checkpoints`) in a unified cache (a split cache copies a whole sequence
    where a prefix is shared and cuts the copy after it, which a recurrent state cannot follow).
    Raises UnsupportedModel for the modes that drop the tail of a sequence at any time (drafts drop
    theirs within the last decode: see :func:`~aiollama.runner.shape.check_rollback`), and for MTP
    drafts on an architecture (llama.cpp's name, ``arch``) whose MTP context llama.cpp does not run."""
    if config.deterministic:
        raise UnsupportedModel(f"{name} is a recurrent or hybrid model: the deterministic mode re-lays "
                               "KV cells in position order, which a recurrent state does not have")
    if config.mtp and arch not in MTP_HYBRIDS:
        raise UnsupportedModel(f"{name} is a recurrent or hybrid model whose MTP drafts llama.cpp does not run "
                               "(give no mtp; n-gram and draft-model drafts are, where llama.cpp can roll its state back)")
    # llama.cpp allocates a recurrent state for every seq id up front (megabytes each in a real
    # model): cached prefixes get as many ids as streams, not the hundreds an attention model gets
    ids = config.cache_seq_ids if config.cache_seq_ids is not None and config.kv_unified else config.n_seq_max
    return dataclasses.replace(config, kv_unified=True, cache_seq_ids=ids)


def failed_step(ctx: Context, plan: Plan, status: DecodeStatus, elapsed: float, applied: Applied,
                early: bool = True) -> StepResult:
    """The result of a step whose decode did not succeed (``early``: decodes of its image rows came
    before the one that failed)."""
    if status is DecodeStatus.NO_KV_SLOT and not early:
        return StepResult(StepStatus.NO_KV_SLOT, decode_seconds=elapsed, **applied)
    # ABORTED and failures keep the ubatches computed before them: say what the context holds
    # (so does a step whose image rows were decoded before its last decode found no slot)
    n_cached = {s.conv: ctx.seq_pos_max(s.seq_id) + 1 for s in plan.slices}
    kind = StepStatus.FAILED if status not in (DecodeStatus.ABORTED, DecodeStatus.NO_KV_SLOT) else StepStatus.ABORTED
    return StepResult(kind, n_cached=n_cached, decode_seconds=elapsed, detail=f"llama_decode: {status.name}",
                      **applied)


@dataclasses.dataclass
class _Decoded:
    """A step whose decode went through, waiting for :meth:`NativeExecutor.collect`."""

    slices: Sequence[Slice]
    rows: list[tuple[Slice, int, bool]]
    elapsed: float
    applied: Applied
    drafted: dict[int, int]
    starts: list[int]  # the batch entry of each slice's first token


class NativeExecutor:
    """:class:`~aiollama.sched.step.Executor` over llama.cpp. Build it on the thread that will use it.

    Raises:
        ModelLoadError (and its subclasses): the model cannot be loaded or served.
        ContextCreateError: llama.cpp could not create the context.
    """

    def __init__(self, config: EngineConfig, model_path: Path) -> None:
        with contextlib.ExitStack() as stack:
            self.model: Model = stack.enter_context(load_model(config, model_path))
            # "kv"; "hybrid": KV cells and a recurrent state per sequence; "recurrent": the state only
            self.memory = "hybrid" if self.model.is_hybrid else "recurrent" if self.model.is_recurrent else "kv"
            if self.memory != "kv":
                config = recurrent_config(config, model_path.name, self.model.metadata("general.architecture"))
            self.embeds_only = is_embedding_model(self.model)
            self._embedder: Embedder | None = None
            if self.embeds_only:  # no KV cache, no generation: the embeddings context is the context
                self._embedder = Embedder(self.model, n_threads=config.n_threads, pooling=config.pooling)
                stack.callback(self._embedder.close)
                self.ctx, self.batch = self._embedder.ctx, self._embedder.batch
            else:
                self.ctx = stack.enter_context(Context(self.model, **context_options(config, self.model)))
                check_rollback(config, self.ctx, model_path.name)
                self.batch = stack.enter_context(Batch(self.ctx.n_batch))
            self._loras = {name: stack.enter_context(LoraAdapter(self.model, path)) for name, path in config.lora.items()}
            if self._loras:
                stack.callback(self.ctx.set_adapters, [])  # before the adapters are freed
            self._lora_now: tuple[tuple[str, float], ...] = ()
            self.projector: Projector | None = None  # images: libmtmd's encoder, used from other threads
            self._images: ImageRows | None = None
            if config.mmproj is not None:
                self.projector = stack.enter_context(images_for(config, self.model, self.embeds_only))
                self._images = ImageRows(self.ctx, self.model.n_embd, self.projector.non_causal)
                self.whole_images = self.projector.non_causal  # a picture's rows in one step, one ubatch
                if self.whole_images:
                    self.projector.max_rows = self.ctx.n_ubatch
                stack.callback(self._images.close)
            self._drafter = drafter_for(config, self.model, self.ctx, self.embeds_only)
            if self._drafter is not None:
                stack.callback(self._drafter.close)
            self._mtp = self._drafter if isinstance(self._drafter, MtpDrafter) else None
            self._handles = stack.pop_all()
        self._threads = config.n_threads
        self._pooling = config.pooling
        # where the weights are; the KV cache of each layer is where its weights are (offload_kqv)
        self.placement = placement(self.model.n_gpu_layers, self.model.n_layer)
        self._gpu_decodes = self.placement != "CPU"
        self.vocab = self.model.vocab
        self.tokenizer: Tokenizer = VocabTokenizer(self.vocab)
        self.n_ctx, self.n_seq_max, self.n_batch = self.ctx.n_ctx_seq, self.ctx.n_seq_max, self.ctx.n_batch
        # a split cache: each seq id's cells are its own, n_ctx_seq of them
        self.n_cells = self.ctx.n_ctx if self.ctx.kv_unified else self.ctx.n_ctx_seq * self.n_seq_max
        self.kv_unified = self.ctx.kv_unified
        # a recurrent state cannot move positions: a full context is evaluated again instead
        self.can_shift = self.ctx.can_shift and self.memory == "kv"
        if self.memory == "recurrent":
            self.n_cells = self.ctx.n_ctx_seq * self.n_seq_max  # no KV cells: only seq ids are scarce
        self.fingerprint: Mapping[str, str | int] = fingerprint(self.model, (config.cache_type_k, config.cache_type_v))
        self.model_info = model_info(self.model, config, self.embeds_only, self.ctx,
                                     (self._mtp.ctx,) if self._mtp is not None else ())
        self.sampling = Sampling(self.ctx, self.vocab, backend=config.backend_sampling and not self.embeds_only,
                                 gpu_decodes=self._gpu_decodes)
        self._order: OrderedCells | None = None
        self._decoded: _Decoded | StepResult | None = None
        if config.deterministic and not self.embeds_only:
            self.n_seq_max -= 1
            self._order = OrderedCells(self.ctx, self.n_seq_max)
            try:
                self._order.check(self.model, self.batch)
            except UnsupportedModel:
                self.close()
                raise
        self._remove = Removal(self.ctx, self._order)
        self.rollback = self.ctx.rollback  # drafts on a recurrent state: see aiollama.runner.removal

    def start_sampling(self, conv: int, params: SamplingParams, history: Sequence[int],
                       matcher: Any = None, guidance: tuple[int, float] | None = None) -> None:
        if self.embeds_only:
            raise InvalidRequestError(f"{self.model.path} is an embedding model: it embeds, it does not generate")
        self.sampling.start(conv, params, history, matcher, guidance)

    def stop_sampling(self, conv: int) -> None:
        self.sampling.stop(conv)

    def execute(self, plan: Plan, on_decode: Callable[[], None] | None = None) -> StepResult:
        self.submit(plan, on_decode)
        return self.collect()

    def submit(self, plan: Plan, on_decode: Callable[[], None] | None = None) -> None:
        """Apply the plan's KV operations and start its decode: on a GPU llama_decode returns once
        the graph is queued, and the logits are waited for by :meth:`collect`."""
        applied = self._apply(plan.ops)
        if self._mtp is not None:
            self._mtp.mirror(plan.ops)
        if not plan.slices:
            self._decoded = StepResult(StepStatus.OK, **applied)
            return
        if plan.lora != self._lora_now:
            self.ctx.set_adapters([(self._loras[name], scale) for name, scale in plan.lora])
            self._lora_now = plan.lora
        slices: Sequence[Slice] = plan.slices
        if not self.ctx.kv_unified:
            # llama.cpp puts sequences of a split cache in one ubatch only while their seq ids
            # follow each other in the batch (0, 1, 2...): any other order is several computes
            slices = sorted(slices, key=lambda s: s.seq_id)
        drafted: dict[int, int] = {}
        if self._drafter is not None and any(s.model_draft for s in slices):
            slices, drafted = with_drafts(self._drafter, slices)
        if self.sampling.backend:
            self.sampling.attach(slices)
        called = False
        if plan.images and self._images is not None:  # a prompt's image rows go first, in decodes of their own
            status, slices, called = self._images.run(slices, plan.images, on_decode)
            if status is not DecodeStatus.OK:
                self._decoded = failed_step(self.ctx, plan, status, 0.0, applied)
                return
        batch = self.batch
        batch.clear()
        rows: list[tuple[Slice, int, bool]] = []  # (a slice, the row of its last token, whether it samples)
        starts: list[int] = []
        self.sampling.guide_rows.clear()
        for s in slices:
            starts.append(batch.n_tokens)
            n_outputs = len(s.tokens) if s.score else s.draft + s.logits
            last = batch.add_tokens(s.tokens, s.pos, s.seq_id, output_last=s.logits, n_outputs=n_outputs)
            if s.logits and s.conv not in self.sampling:
                self.sampling.guide_rows[s.conv] = last  # a guiding sequence's row: read with the one it guides
            if s.score or s.logits:
                rows.append((s, last, s.logits and s.conv in self.sampling))
        start = time.perf_counter()
        try:
            status = self._decode(batch, None if called else on_decode) if len(batch) else DecodeStatus.OK
            if self._remove.pending:  # drafts rolled back on a recurrent state: rare, never on a transformer
                self._remove.decoded(s.seq_id for s in slices)
        finally:
            # Not cleared before the decode: a cancel that arrives between planning and decoding
            # must still interrupt it.
            self.ctx.clear_abort()
        elapsed = time.perf_counter() - start
        self._decoded = _Decoded(slices, rows, elapsed, applied, drafted, starts) if status is DecodeStatus.OK \
            else failed_step(self.ctx, plan, status, elapsed, applied, called)

    def collect(self, discard: Collection[int] = ()) -> StepResult:
        """Sample the rows of the step submitted last, but those of ``discard``: theirs are not
        read, and their cells are removed where the memory can be cut (a recurrent state keeps them)."""
        d, self._decoded = self._decoded, None
        assert d is not None, "collect() without submit()"
        if isinstance(d, StepResult):
            return d
        gone = frozenset(s.conv for s in d.slices if s.conv in discard) if discard else frozenset()
        outputs: list[tuple[int, int]] = []
        drafts: list[tuple[int, Slice]] = []  # (index in outputs, slice)
        scoring: list[tuple[Slice, int]] = []  # (a slice scoring the prompt, the row of its last token)
        for s, last, samples in d.rows:
            if s.conv in gone:
                continue
            if s.score:
                scoring.append((s, last))
            if samples and s.draft:
                drafts.append((len(outputs), s))
            if samples:
                outputs.append((s.conv, last - s.draft))
        failed: dict[int, BaseException] = {}
        chosen = self.sampling.sample(outputs, failed)
        if drafts:
            chosen = verify(self.sampling, self._remove.draft, chosen, outputs, drafts, failed)
        if self._mtp is not None:  # the tokens kept: a drafted slice's pending one and the drafts taken
            kept = {s.conv: max(1, len(chosen[i])) for i, s in drafts}
            self._mtp.feed(kept_tokens(d.slices, d.starts, kept, gone | failed.keys()))
        sampled = tuple(x for got in chosen for x in got)
        scored = {s.conv: self.sampling.score(s, last) for s, last in scoring}
        for s in d.slices if gone and self.memory == "kv" else ():
            if s.conv in gone:  # after the reads (cell metadata only, which the next decode reads)
                self._remove(s.seq_id, s.pos, -1)
        return StepResult(StepStatus.OK, sampled, decode_seconds=d.elapsed, **d.applied,
                          failed=failed, drafted=d.drafted, scored=scored, discarded=gone)

    def _decode(self, batch: Batch, on_decode: Callable[[], None] | None) -> DecodeStatus:
        return self.ctx.decode(batch, on_decode)

    def _apply(self, ops: Sequence[Op]) -> Applied:
        parked: dict[int, bytes] = {}
        restored: dict[int, bool] = {}
        checkpoints: dict[int, bytes] = {}
        for op in ops:
            if isinstance(op, Remove):
                self._remove(op.seq_id, op.p0, -1)
            elif isinstance(op, Copy):
                self._remove.settle(op.src, op.dst)
                if self.ctx.whole_copies:
                    # the whole holder; sharing part of it, the checkpoint put back next replaces its
                    # window and compressor states (DeepSeek V4: tests/core/test_recurrent.py)
                    self.ctx.seq_cp(op.src, op.dst)
                elif self.ctx.kv_unified:
                    self.ctx.seq_cp(op.src, op.dst, 0, op.n)
                else:  # across caches llama.cpp copies a whole sequence: cut the copy after n
                    self.ctx.seq_cp(op.src, op.dst)
                    self._remove(op.dst, op.n, -1)
            elif isinstance(op, Shift):
                self._remove(op.seq_id, op.p0, op.p0 + op.n)
                self.ctx.seq_add(op.seq_id, op.p0 + op.n, -1, -op.n)
            elif isinstance(op, Park):
                parked[op.key] = self.read_state(op.seq_id)
            elif isinstance(op, Checkpoint):
                checkpoints[op.key] = self.ctx.seq_state(op.seq_id, partial=True)
            elif isinstance(op, Restore):
                restored[op.seq_id] = ok = self.write_state(op.seq_id, op.data, partial=op.partial)
                if op.partial and not ok:
                    self._remove(op.seq_id, 0, -1)  # cells without their state: nothing
            elif isinstance(op, Compact):
                assert self._order is not None
                self._order.compact(op.relays)
        return {"parked": parked, "restored": restored, "checkpoints": checkpoints}

    def read_state(self, seq_id: int) -> bytes:
        return self.ctx.seq_state(seq_id)

    def embed(self, texts: Sequence[Sequence[int]], normalize: bool = True) -> list[Any]:
        if self._embedder is None:
            self._embedder = Embedder(self.model, n_threads=self._threads, pooling=self._pooling)
        return self._embedder.embed(texts, normalize)

    def write_state(self, seq_id: int, data: bytes, *, partial: bool = False) -> bool:
        if self.embeds_only:
            return False
        try:
            if self.memory == "kv":
                # a state saved from a cache of another layout (unified, or split in another number
                # of seq ids) names another number of streams
                data = seqstate.restream(data, 1 if self.ctx.kv_unified else self.ctx.n_seq_max)
            if self._order is not None:
                data = seqstate.ordered(data)  # a state saved elsewhere may hold its cells out of order
                if not data:
                    return False
            self.ctx.set_seq_state(seq_id, data, partial=partial)
        except (StateRestoreError, seqstate.StateFormatError):
            return False  # llama.cpp left the sequence empty
        return True

    def request_abort(self) -> None:
        self.ctx.request_abort()

    def close(self) -> None:
        self.sampling.close()
        if self._embedder is not None and not self.embeds_only:
            self._embedder.close()  # the one of an embedding model goes with the handles
        self._handles.close()  # batch, context, model: the reverse of their creation

