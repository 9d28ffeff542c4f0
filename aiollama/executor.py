"""The executor: the only code on the decode thread that calls llama.cpp.

It owns the model, the context, the batch and one sampler chain per generating conversation, and
turns a :class:`~aiollama.step.Plan` into a :class:`~aiollama.step.StepResult`: apply the plan's KV
operations, fill the batch, run ``llama_decode`` (the GIL is released while it runs), sample each
slice that asks for logits, and read the chosen tokens' bytes. It decides nothing: what to decode
and what a token means for its stream are the scheduler's and the generations' business.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aiollama._validate import MAX_SEQ
from aiollama.boundary import EngineConfig
from aiollama.constraints import Masks
from aiollama.drafter import Drafter
from aiollama.embedder import Embedder, is_embedding_model
from aiollama.errors import DecodeError, InvalidRequestError, LogitsProcessorError, StateRestoreError, UnsupportedModel
from aiollama.native import Batch, Context, DecodeStatus, Model, SamplerChain, Vocab, available_cpus, sample_rows
from aiollama.native import seqstate
from aiollama.native.context import context_params
from aiollama.native.devices import fit, placement
from aiollama.native.sampler import DEFAULT_SEED, attach
from aiollama.ordered import OrderedCells
from aiollama.sampling import LogitsProcessor, SamplingParams
from aiollama.step import (Compact, Copy, Op, Park, Plan, Remove, Restore, Sampled, Shift, Slice, StepResult,
                           StepStatus, Tokenizer)
from aiollama.tokenizer import VocabTokenizer



def build_chain(vocab: Vocab, params: SamplingParams, history: Sequence[int]) -> SamplerChain:
    """A sampler chain for one stream; penalties see the conversation's recent history."""
    chain = SamplerChain(vocab)
    try:
        if params.uses_penalties:
            chain.add_penalties(params.penalty_last_n, params.repeat_penalty,
                                params.frequency_penalty, params.presence_penalty)
            recent = history if params.penalty_last_n < 0 else history[-params.penalty_last_n:]
            for token in recent:
                chain.accept(token)  # the chain holds only penalties yet: no grammar sees the prompt
        if params.logit_bias:
            chain.add_logit_bias(params.logit_bias)
        if params.grammar is not None:
            chain.add_grammar(params.grammar)
        if params.greedy:
            chain.add_greedy()
            return chain
        if params.top_k > 0:
            chain.add_top_k(params.top_k)
        if params.typical_p < 1.0:
            chain.add_typical(params.typical_p)
        if params.top_p < 1.0:
            chain.add_top_p(params.top_p)
        if params.min_p > 0.0:
            chain.add_min_p(params.min_p)
        chain.add_temp(params.temperature)
        chain.add_dist(DEFAULT_SEED if params.seed is None else params.seed)
        return chain
    except BaseException:
        chain.close()
        raise


def load_model(config: EngineConfig, path: Path) -> Model:
    """The model, its layers on the GPU as ``config.n_gpu_layers`` says: "auto" fits as many as
    leave room for a context of the configured shape (none without a GPU, and none in the
    deterministic mode, which runs on the CPU)."""
    if config.n_gpu_layers != "auto":
        return Model(path, n_gpu_layers=int(config.n_gpu_layers), repack=not config.deterministic)
    if config.deterministic:
        return Model(path, n_gpu_layers=0, repack=False)
    # the seq ids are known once the vocabulary is: their output rows weigh little beside the cache
    shape = context_params(n_ctx=config.n_ctx, n_batch=config.n_batch,
                           n_seq_max=min(MAX_SEQ, config.n_seq_max + (config.cache_seq_ids or 32)),
                           n_threads=config.n_threads, kv_unified=config.kv_unified, flash_attn=config.flash_attn,
                           cache_type_k=config.cache_type_k, cache_type_v=config.cache_type_v)
    return Model(path, fitted=fit(path, shape))


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


@dataclass(eq=False)
class _Sampler:
    """How one stream chooses its tokens: its chain, and what needs the logits row first."""

    chain: SamplerChain
    matcher: Any = None  # an llguidance matcher: the stream's constraint
    top_logprobs: int = -1  # -1: no log-probabilities wanted
    processors: tuple[LogitsProcessor, ...] = ()
    history: list[int] | None = None  # kept only for processors
    guide: int | None = None  # the conversation whose row guides this one's
    scale: float = 1.0
    in_graph: bool = False  # the chain was attached for backend sampling once (it cannot be again)

    @property
    def reads_row(self) -> bool:
        return self.matcher is not None or self.top_logprobs >= 0 or bool(self.processors) or self.guide is not None

    def process(self, logits: np.ndarray) -> None:
        """Run the stream's logits processors on its row, in order."""
        assert self.history is not None
        tokens = tuple(self.history)
        for fn in self.processors:
            try:
                out = fn(tokens, logits)
            except Exception as exc:
                raise _processor_error(fn, exc) from exc
            if out is not None and out is not logits:
                if not isinstance(out, np.ndarray) or out.shape != logits.shape:
                    raise LogitsProcessorError(f"logits processor {_name(fn)} returned {type(out).__name__}, "
                                               f"not None or an array of shape {logits.shape}")
                logits[:] = out


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _processor_error(fn: Any, exc: Exception) -> LogitsProcessorError:
    error = LogitsProcessorError(f"logits processor {_name(fn)} raised {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def logprobs_of(logits: np.ndarray, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The log of the row's partition function, and its ``k`` most likely tokens with their
    log-probabilities, most likely first."""
    peak = float(logits.max())
    lse = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
    if k <= 0:
        return lse, []
    top = np.argpartition(logits, -k)[-k:]
    top = top[np.argsort(-logits[top], kind="stable")]
    return lse, [(int(t), float(logits[t]) - lse) for t in top]


class NativeExecutor:
    """:class:`~aiollama.step.Executor` over llama.cpp. Build it on the thread that will use it.

    Raises:
        ModelLoadError (and its subclasses): the model cannot be loaded or served.
        ContextCreateError: llama.cpp could not create the context.
    """

    def __init__(self, config: EngineConfig, model_path: Path) -> None:
        with contextlib.ExitStack() as stack:
            self.model: Model = stack.enter_context(load_model(config, model_path))
            if self.model.is_recurrent:
                raise UnsupportedModel(
                    f"{model_path.name} is a recurrent or hybrid model; its memory cannot drop the end "
                    "of a sequence, which this engine needs to share prefixes, preempt and cancel")
            self.embeds_only = is_embedding_model(self.model)
            self._embedder: Embedder | None = None
            if self.embeds_only:  # no KV cache, no generation: the embeddings context is the context
                self._embedder = Embedder(self.model, n_threads=config.n_threads)
                stack.callback(self._embedder.close)
                self.ctx, self.batch = self._embedder.ctx, self._embedder.batch
            else:
                # deterministic: every row computed by the same kernels whatever the batch holds,
                # and attention summed cell by cell (flash attention's reference path), each
                # sequence's cells in position order (aiollama.ordered: one more seq id)
                ids = config.context_seq_ids(self.model.vocab.n_tokens)
                if config.deterministic:
                    ids = min(ids, MAX_SEQ - 1) + 1
                self.ctx = stack.enter_context(Context(
                    self.model, n_ctx=config.n_ctx, n_batch=config.n_batch, n_seq_max=ids,
                    n_threads=config.n_threads, kv_unified=config.kv_unified,
                    flash_attn=True if config.deterministic else config.flash_attn,
                    cache_type_k=config.cache_type_k, cache_type_v=config.cache_type_v,
                    reference_kernels=config.deterministic))
                self.batch = stack.enter_context(Batch(self.ctx.n_batch))
            self._drafter: Drafter | None = None
            if config.draft_model is not None and not self.embeds_only:
                self._drafter = Drafter(config.draft_model, self.model.vocab, n_ctx=config.n_ctx,
                                        n_batch=self.ctx.n_batch, n_seq_max=self.ctx.n_seq_max,
                                        n_threads=config.n_threads,
                                        n_gpu_layers=-1 if self.model.n_gpu_layers != 0 else 0)
                stack.callback(self._drafter.close)
            self._handles = stack.pop_all()
        self._threads = config.n_threads
        # where the weights are; the KV cache of each layer is where its weights are (offload_kqv)
        self.placement = placement(self.model.n_gpu_layers, self.model.n_layer)
        self._gpu_decodes = self.placement != "CPU"
        self.vocab = self.model.vocab
        self.tokenizer: Tokenizer = VocabTokenizer(self.vocab)
        self.n_ctx, self.n_seq_max, self.n_batch = self.ctx.n_ctx_seq, self.ctx.n_seq_max, self.ctx.n_batch
        # a split cache: each seq id's cells are its own, n_ctx_seq of them
        self.n_cells = self.ctx.n_ctx if self.ctx.kv_unified else self.ctx.n_ctx_seq * self.n_seq_max
        self.kv_unified = self.ctx.kv_unified
        self.can_shift = self.ctx.can_shift
        self.fingerprint: Mapping[str, str | int] = fingerprint(self.model, (config.cache_type_k, config.cache_type_v))
        self._samplers: dict[int, _Sampler] = {}
        self._masks: Masks | None = None
        self._rows: dict[int, int] = {}  # conv -> the logits row of a guiding sequence in this step
        self._tokens: dict[int, tuple[bytes, bool]] = {}  # token -> (piece, is end of generation)
        # backend sampling: seq id -> the conversation whose chain runs in the decode graph for it
        self._backend = config.backend_sampling and not self.embeds_only
        self._attached: dict[int, int] = {}
        self._order: OrderedCells | None = None
        if config.deterministic and not self.embeds_only:
            self.n_seq_max -= 1
            self._order = OrderedCells(self.ctx, self.n_seq_max)
            try:
                self._order.check(self.model, self.batch)
            except UnsupportedModel:
                self.close()
                raise

    def start_sampling(self, conv: int, params: SamplingParams, history: Sequence[int],
                       matcher: Any = None, guidance: tuple[int, float] | None = None) -> None:
        if self.embeds_only:
            raise InvalidRequestError(f"{self.model.path} is an embedding model: it embeds, it does not generate")
        top = params.top_logprobs if params.logprobs else -1
        processors = params.logits_processors
        guide, scale = guidance if guidance is not None else (None, 1.0)
        self._samplers[conv] = _Sampler(build_chain(self.vocab, params, history), matcher, top, processors,
                                        list(history) if processors else None, guide, scale)

    def stop_sampling(self, conv: int) -> None:
        sampler = self._samplers.pop(conv, None)
        if sampler is not None:
            self._detach(conv)
            sampler.chain.close()

    def _detach(self, conv: int, *, keep: bool = False) -> None:
        """Take ``conv``'s chain out of the graph. With ``keep`` (the stream goes on), a chain that
        was in a graph is replaced by a copy, state and all: llama.cpp sets a chain up for the graph
        once, and such a chain no longer samples from logits."""
        for seq_id in [i for i, c in self._attached.items() if c == conv]:
            attach(self.ctx, seq_id, None)
            del self._attached[seq_id]
        sampler = self._samplers.get(conv)
        if keep and sampler is not None and sampler.in_graph:
            old, sampler.chain = sampler.chain, sampler.chain.clone()
            old.close()
            sampler.in_graph = False

    def _attach(self, slices: Sequence[Slice]) -> None:
        """Backend sampling: each row to sample gets its stream's chain in the graph when the chain
        can run there and nothing needs the row itself (log-probabilities, processors, guidance, a
        constraint) and it has one output (no draft); otherwise the row is sampled from its logits.
        Chains move only when a sequence's stream changes (each move rebuilds the graph)."""
        for s in slices:
            if not s.logits:
                continue
            sampler = self._samplers.get(s.conv)
            eligible = sampler is not None and not s.draft and not sampler.reads_row and sampler.chain.backend_capable
            have = self._attached.get(s.seq_id)
            if eligible and have == s.conv:
                continue
            if have is not None:  # another stream's chain (it was preempted), or this one's leaving
                self._detach(have, keep=True)
            if sampler is not None and sampler.in_graph:  # this stream's chain, in the graph elsewhere or before
                self._detach(s.conv, keep=True)
            if eligible:
                assert sampler is not None
                sampler.in_graph = True
                if attach(self.ctx, s.seq_id, sampler.chain):
                    self._attached[s.seq_id] = s.conv

    def execute(self, plan: Plan, on_decode: Callable[[], None] | None = None) -> StepResult:
        parked, restored = self._apply(plan.ops)
        if not plan.slices:
            return StepResult(StepStatus.OK, parked=parked, restored=restored)
        slices: Sequence[Slice] = plan.slices
        if not self.ctx.kv_unified:
            # llama.cpp puts sequences of a split cache in one ubatch only while their seq ids
            # follow each other in the batch (0, 1, 2...): any other order is several computes
            slices = sorted(slices, key=lambda s: s.seq_id)
        drafted: dict[int, int] = {}
        if self._drafter is not None and any(s.model_draft for s in slices):
            slices, drafted = self._model_drafts(self._drafter, slices)
        if self._backend:
            self._attach(slices)
        batch = self.batch
        batch.clear()
        outputs: list[tuple[int, int]] = []
        drafts: list[tuple[int, Slice]] = []  # (index in outputs, slice)
        self._rows.clear()
        for s in slices:
            last = batch.add_tokens(s.tokens, s.pos, s.seq_id, output_last=s.logits, n_outputs=s.draft + s.logits)
            if s.logits:
                if s.conv not in self._samplers:
                    self._rows[s.conv] = last  # a guiding sequence's row, no draft
                    continue  # the row of a sequence that guides another: read with that one's
                if s.draft:
                    drafts.append((len(outputs), s))
                outputs.append((s.conv, last - s.draft))
        start = time.perf_counter()
        try:
            status = self._decode(batch, on_decode)
        finally:
            # Not cleared before the decode: a cancel that arrives between planning and decoding
            # must still interrupt it.
            self.ctx.clear_abort()
        elapsed = time.perf_counter() - start
        if status is DecodeStatus.OK:
            failed: dict[int, BaseException] = {}
            chosen = self._sample(outputs, failed)
            if drafts:
                chosen = self._verify(chosen, outputs, drafts, failed)
            sampled = tuple(x for got in chosen for x in got)
            return StepResult(StepStatus.OK, sampled, decode_seconds=elapsed, parked=parked, restored=restored,
                              failed=failed, drafted=drafted)
        if status is DecodeStatus.NO_KV_SLOT:
            return StepResult(StepStatus.NO_KV_SLOT, decode_seconds=elapsed, parked=parked, restored=restored)
        # ABORTED and failures keep the ubatches computed before them: say what the context holds
        n_cached = {s.conv: self.ctx.seq_pos_max(s.seq_id) + 1 for s in plan.slices}
        kind = StepStatus.ABORTED if status is DecodeStatus.ABORTED else StepStatus.FAILED
        return StepResult(kind, n_cached=n_cached, decode_seconds=elapsed, detail=f"llama_decode: {status.name}",
                          parked=parked, restored=restored)

    @staticmethod
    def _model_drafts(drafter: Drafter, slices: Sequence[Slice]) -> tuple[tuple[Slice, ...], dict[int, int]]:
        """The slices with the draft model's tokens after their pending one, where it was asked
        for; and how many each got, by conversation."""
        asked = [s for s in slices if s.model_draft]
        got = drafter.draft([(s.seq_id, s.history, s.model_draft) for s in asked])  # pending token last
        tokens = {s.conv: d for s, d in zip(asked, got) if d}
        out = tuple(Slice(s.conv, s.seq_id, s.pos, s.tokens + tokens[s.conv], True, len(tokens[s.conv]))
                    if s.conv in tokens else s for s in slices)
        return out, {conv: len(d) for conv, d in tokens.items()}

    def _decode(self, batch: Batch, on_decode: Callable[[], None] | None) -> DecodeStatus:
        return self.ctx.decode(batch, on_decode)

    def _apply(self, ops: Sequence[Op]) -> tuple[dict[int, bytes], dict[int, bool]]:
        parked: dict[int, bytes] = {}
        restored: dict[int, bool] = {}
        for op in ops:
            if isinstance(op, Remove):
                self._remove(op.seq_id, op.p0, -1)
            elif isinstance(op, Copy):
                if self.ctx.kv_unified:
                    self.ctx.seq_cp(op.src, op.dst, 0, op.n)
                else:  # across caches llama.cpp copies a whole sequence: cut the copy after n
                    self.ctx.seq_cp(op.src, op.dst)
                    self._remove(op.dst, op.n, -1)
            elif isinstance(op, Shift):
                self._remove(op.seq_id, op.p0, op.p0 + op.n)
                self.ctx.seq_add(op.seq_id, op.p0 + op.n, -1, -op.n)
            elif isinstance(op, Park):
                parked[op.key] = self.read_state(op.seq_id)
            elif isinstance(op, Restore):
                restored[op.seq_id] = self.write_state(op.seq_id, op.data)
            elif isinstance(op, Compact):
                assert self._order is not None
                self._order.compact(op.relays)
        return parked, restored

    def _remove(self, seq_id: int, p0: int, p1: int) -> None:
        if self._order is not None:
            self._order.hold(seq_id, p0, p1)
        if not self.ctx.seq_rm(seq_id, p0, p1):
            raise DecodeError(f"llama.cpp could not remove positions {p0}..{p1} of sequence {seq_id}")

    def read_state(self, seq_id: int) -> bytes:
        return self.ctx.seq_state(seq_id)

    def embed(self, texts: Sequence[Sequence[int]], normalize: bool = True) -> list[list[float]]:
        if self._embedder is None:
            self._embedder = Embedder(self.model, n_threads=self._threads)
        return self._embedder.embed(texts, normalize)

    def write_state(self, seq_id: int, data: bytes) -> bool:
        if self.embeds_only:
            return False
        try:
            # a state saved from a cache of another layout (unified, or split in another number of
            # seq ids) names another number of streams
            data = seqstate.restream(data, 1 if self.ctx.kv_unified else self.ctx.n_seq_max)
            if self._order is not None:
                data = seqstate.ordered(data)  # a state saved elsewhere may hold its cells out of order
                if not data:
                    return False
            self.ctx.set_seq_state(seq_id, data)
        except (StateRestoreError, seqstate.StateFormatError):
            return False  # llama.cpp left the sequence empty
        return True

    def _sample(self, outputs: list[tuple[int, int]], failed: dict[int, BaseException]) -> list[list[Sampled]]:
        """Choose every row's token in one call: for each output, ``[Sampled]``, or ``[]`` when its
        sampler failed (the reason goes into ``failed``). Rows that need their logits first
        (guidance, logits processors, log-probabilities, a constraint's mask) are read before; the
        masks of all constrained rows are filled at once."""
        samplers = [self._samplers[conv] for conv, _ in outputs]
        matchers = [s.matcher for s in samplers if s.matcher is not None]
        bits = None
        if matchers:
            if self._masks is None:
                self._masks = Masks(self.vocab.n_tokens, self._mask_threads())
            bits = iter(self._masks.fill(matchers))
        picked: list[tuple[int, _Sampler, int, tuple[Any, float, list[tuple[int, float]]] | None]] = []
        for i, (sampler, (conv, row)) in enumerate(zip(samplers, outputs)):
            if not sampler.reads_row:
                picked.append((i, sampler, row, None))
                continue
            mask = next(bits) if bits is not None and sampler.matcher is not None else None
            try:
                picked.append((i, sampler, row, self._read_row(sampler, row, mask)))
            except LogitsProcessorError as exc:
                failed[conv] = exc
        chosen: list[list[Sampled]] = [[] for _ in outputs]
        if not picked:
            return chosen
        tokens = sample_rows(self.ctx, [p[1].chain for p in picked], [p[2] for p in picked], self.ctx.n_threads[0],
                             [p[1].chain.fast_k for p in picked])
        for (i, sampler, _, read), token in zip(picked, tokens):
            chosen[i] = [self._sampled(outputs[i][0], sampler, token, read)]
        return chosen

    def _verify(self, chosen: list[list[Sampled]], outputs: list[tuple[int, int]],
                drafts: list[tuple[int, Slice]], failed: dict[int, BaseException]) -> list[list[Sampled]]:
        """Continue the drafted rows: while the token chosen equals the next draft token, choose the
        next one from that token's row. The cells of the draft tokens not taken are removed."""
        for i, s in drafts:
            row = outputs[i][1]
            draft = s.tokens[1:]
            got = chosen[i]
            k = 0
            while got and k < len(draft) and got[-1].token == draft[k] and not got[-1].eog:
                k += 1
                more = self._sample([(s.conv, row + k)], failed)[0]
                if not more:
                    break
                got += more
            # the pending token and each draft token followed by a chosen token keep their cells
            # (what the scheduler counts); after a failed row the last draft token taken waits
            kept = max(1, len(got))
            if kept < len(s.tokens):
                self._remove(s.seq_id, s.pos + kept, -1)
        return chosen

    def _mask_threads(self) -> int:
        """The CPUs the decode leaves free for computing masks (all of them when a GPU decodes)."""
        cpus = available_cpus()
        return cpus if self._gpu_decodes else cpus - self.ctx.n_threads[0]

    def _read_row(self, sampler: _Sampler, row: int, mask: Any) -> tuple[Any, float, list[tuple[int, float]]]:
        """The row as the chain sees it: guided, then processed; its log-probabilities (before the
        mask); then the mask applied. Raises LogitsProcessorError."""
        logits = np.frombuffer(self.ctx.logits_buffer(row), dtype=np.float32)
        if sampler.guide is not None and sampler.scale != 1.0:
            # g + w * (l - g): the guiding conversation's row is in this step (the scheduler keeps
            # the two in lockstep)
            guide = np.frombuffer(self.ctx.logits_buffer(self._rows[sampler.guide]), dtype=np.float32)
            logits -= guide
            logits *= np.float32(sampler.scale)
            logits += guide
        if sampler.processors:
            sampler.process(logits)
        lse, top = 0.0, list[tuple[int, float]]()
        if sampler.top_logprobs >= 0:
            lse, top = logprobs_of(logits, sampler.top_logprobs)
        if sampler.matcher is not None:
            assert self._masks is not None
            self._masks.apply(logits, mask)
        return logits, lse, top

    def _sampled(self, conv: int, sampler: _Sampler, token: int,
                 read: tuple[Any, float, list[tuple[int, float]]] | None) -> Sampled:
        final = False
        if sampler.matcher is not None:
            sampler.matcher.consume_token(token)
            final = sampler.matcher.is_stopped()
        if sampler.history is not None:
            sampler.history.append(token)
        logprob: float | None = None
        top: tuple[tuple[int, float], ...] = ()
        if read is not None and sampler.top_logprobs >= 0:
            logits, lse, found = read
            logprob, top = float(logits[token]) - lse, tuple(found)  # a token the mask allowed kept its logit
        known = self._tokens.get(token)
        if known is None:  # a token's piece and end-of-generation flag, asked of llama.cpp once
            known = self._tokens[token] = (self.vocab.token_to_piece(token), self.vocab.is_eog(token))
        return Sampled(conv, token, known[0], known[1], final, logprob, top)

    def request_abort(self) -> None:
        self.ctx.request_abort()

    def close(self) -> None:
        for seq_id in list(self._attached):
            attach(self.ctx, seq_id, None)
        self._attached.clear()
        for sampler in self._samplers.values():
            sampler.chain.close()
        self._samplers.clear()
        if self._embedder is not None and not self.embeds_only:
            self._embedder.close()  # the one of an embedding model goes with the handles
        self._handles.close()  # batch, context, model: the reverse of their creation
