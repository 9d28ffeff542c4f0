"""Each generating stream's sampling: its sampler chain and what reads its logits row first (a
constraint's mask, logits processors, classifier-free guidance, log-probabilities), every row of a
step sampled in one C call, and backend sampling (a stream's chain run inside the decode graph where
nothing needs its row). Used by the executor on the decode thread."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiollama.errors import LogitsProcessorError
from aiollama.formats import reasoning
from aiollama.formats.constraints import Masks
from aiollama.formats.toolcalls import PRESERVED
from aiollama.native import Context, SamplerChain, Vocab, available_cpus, sample_rows
from aiollama.native.sampler_chain import DEFAULT_SEED, attach
from aiollama.sampling import LogitsProcessor, SamplingParams
from aiollama.sched.step import Sampled, Scored, Slice


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
            if params.grammar_prefill:
                chain.prefill_grammar(prefill_tokens(vocab, params.grammar_prefill))
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


def prefill_tokens(vocab: Vocab, text: str) -> list[int]:
    """The tokens of a generation prompt a grammar takes as already generated, as llama.cpp's
    sampler feeds them: special tokens parsed, and a first token that is only the space some
    tokenizers put before a special token left out."""
    tokens = vocab.tokenize(text, parse_special=True)
    if tokens and text[:1] and not text[0].isspace() and vocab.token_to_piece(tokens[0], special=True)[:1].isspace():
        tokens = tokens[1:]
    return tokens


def single_tokens(vocab: Vocab, texts: Sequence[str]) -> frozenset[int]:
    """The tokens of those texts that are one token each (special tokens parsed)."""
    return frozenset(ids[0] for ids in (vocab.tokenize(text, parse_special=True) for text in texts) if len(ids) == 1)


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
    budget: reasoning.Budget | None = None  # the thinking budget, which may force tokens
    score_top: int = 0  # the alternatives each scored prompt token comes with
    preserved: frozenset[int] = frozenset()  # marker tokens its text shows (its chat format's)

    @property
    def reads_row(self) -> bool:
        return self.matcher is not None or self.top_logprobs >= 0 or bool(self.processors) or self.guide is not None \
            or (self.budget is not None and self.budget.forcing is not None)

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



class Sampling:
    """The sampling of every generating conversation of one context.

    ``guide_rows`` holds, during a step, the logits row of each sequence that guides another one's
    generation (the executor fills it as it fills the batch)."""

    def __init__(self, ctx: Context, vocab: Vocab, *, backend: bool, gpu_decodes: bool) -> None:
        self.ctx = ctx
        self.vocab = vocab
        self.guide_rows: dict[int, int] = {}  # conv -> the logits row of a guiding sequence in this step
        self._streams: dict[int, _Sampler] = {}
        self._masks: Masks | None = None
        # (token, shown as text) -> (piece, is end of generation)
        self._tokens: dict[tuple[int, bool], tuple[bytes, bool]] = {}
        # the markers of thinking and tool calls show in a plain prompt's text even where they are
        # control tokens; a chat turn's stream shows its format's own (llama-server's preserved
        # tokens), where its parser reads them
        self._preserved = single_tokens(vocab, PRESERVED)
        self._backend = backend
        self._gpu_decodes = gpu_decodes
        # backend sampling: seq id -> the conversation whose chain runs in the decode graph for it
        self._attached: dict[int, int] = {}
        # chains of streams that ended, left in the graph until their seq id has a row again:
        # taking a chain out re-reserves the whole graph, while an idle sequence's chain costs
        # nothing there (llama.cpp leaves it out of the computation)
        self._idle: dict[int, SamplerChain] = {}

    def __contains__(self, conv: int) -> bool:
        return conv in self._streams

    @property
    def backend(self) -> bool:
        return self._backend

    def start(self, conv: int, params: SamplingParams, history: Sequence[int],
                       matcher: Any = None, guidance: tuple[int, float] | None = None) -> None:
        top = params.top_logprobs if params.logprobs else -1
        processors = params.logits_processors
        guide, scale = guidance if guidance is not None else (None, 1.0)
        preserved = single_tokens(self.vocab, params.preserved_tokens)
        self._streams[conv] = _Sampler(build_chain(self.vocab, params, history), matcher, top, processors,
                                        list(history) if processors else None, guide, scale,
                                        budget=self._budget(params, history), score_top=params.prompt_logprobs or 0,
                                        preserved=preserved or self._preserved)

    def _budget(self, params: SamplingParams, history: Sequence[int]) -> reasoning.Budget | None:
        if params.reasoning_budget is None:
            return None
        tail = b"".join(self.vocab.token_to_piece(t, special=True) for t in history[-8:]).decode("utf-8", "replace")
        message = params.reasoning_budget_message
        if params.thinking_tags:  # a chat format's own block: closed as llama-server closes it
            start, end = params.thinking_tags[0], params.thinking_tags[1]
            return reasoning.Budget(params.reasoning_budget, self.vocab.tokenize(message + end, parse_special=True),
                                    inside=reasoning.opened(tail, start), start=start, end=end)
        closing = self.vocab.tokenize(message + "\n" + reasoning.END + "\n\n", parse_special=True)
        harmony_closing = self.vocab.tokenize(message + "<|end|><|start|>assistant<|channel|>final<|message|>",
                                              parse_special=True)
        return reasoning.Budget(params.reasoning_budget, closing, inside=reasoning.opened(tail),
                                harmony_closing=harmony_closing)

    def stop(self, conv: int) -> None:
        sampler = self._streams.pop(conv, None)
        if sampler is None:
            return
        # a chain is in the graph for one seq id at most: attach() takes it out of another first
        seq_id = next((i for i, c in self._attached.items() if c == conv), None)
        if seq_id is None:
            sampler.chain.close()
        else:  # it stays in the graph, idle, until its seq id has a row again
            del self._attached[seq_id]
            self._idle[seq_id] = sampler.chain

    def _detach(self, conv: int, *, keep: bool = False) -> None:
        """Take ``conv``'s chain out of the graph. With ``keep`` (the stream goes on), a chain that
        was in a graph is replaced by a copy, state and all: llama.cpp sets a chain up for the graph
        once, and such a chain no longer samples from logits."""
        for seq_id in [i for i, c in self._attached.items() if c == conv]:
            attach(self.ctx, seq_id, None)
            del self._attached[seq_id]
        sampler = self._streams.get(conv)
        if keep and sampler is not None and sampler.in_graph:
            old, sampler.chain = sampler.chain, sampler.chain.clone()
            old.close()
            sampler.in_graph = False

    def attach(self, slices: Sequence[Slice]) -> None:
        """Backend sampling: each row to sample gets its stream's chain in the graph when the chain
        can run there and nothing needs the row itself (log-probabilities, processors, guidance, a
        constraint) and it has one output (no draft); otherwise the row is sampled from its logits.
        Chains move only when a sequence's stream changes (each move rebuilds the graph)."""
        for s in slices:
            if not s.logits:
                continue
            sampler = self._streams.get(s.conv)
            eligible = sampler is not None and not s.draft and not s.score and not sampler.reads_row \
                and sampler.chain.backend_capable
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
            idle = self._idle.pop(s.seq_id, None)
            if idle is not None:  # an ended stream's chain, replaced above or taken out now
                if s.seq_id not in self._attached:
                    attach(self.ctx, s.seq_id, None)
                idle.close()

    def sample(self, outputs: list[tuple[int, int]], failed: dict[int, BaseException]) -> list[list[Sampled]]:
        """Choose every row's token in one call: for each output, ``[Sampled]``, or ``[]`` when its
        sampler failed (the reason goes into ``failed``). Rows that need their logits first
        (guidance, logits processors, log-probabilities, a constraint's mask) are read before; the
        masks of all constrained rows are filled at once."""
        samplers = [self._streams[conv] for conv, _ in outputs]
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

    def score(self, s: Slice, last: int) -> tuple[Scored, ...]:
        """Each row of a slice that scores its prompt: the log-probability of the token after it,
        and the most likely alternatives. The row of the history's last token is sampled, not scored."""
        sampler = self._streams.get(s.conv)
        k = sampler.score_top if sampler is not None else 0
        first = last - len(s.tokens) + 1
        out: list[Scored] = []
        for i in range(min(len(s.tokens), len(s.history) - 1 - s.pos)):
            following = s.history[s.pos + i + 1]
            logits = np.frombuffer(self.ctx.logits_buffer(first + i), dtype=np.float32)
            lse, top = logprobs_of(logits, k)
            rank = int(np.count_nonzero(logits > logits[following])) + 1
            out.append((s.pos + i, following, float(logits[following]) - lse, tuple(top), rank))
        return tuple(out)

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
            guide = np.frombuffer(self.ctx.logits_buffer(self.guide_rows[sampler.guide]), dtype=np.float32)
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
        forced = sampler.budget.forcing if sampler.budget is not None else None
        if forced is not None:  # the thinking budget is spent: the closing tokens, one a step
            kept = float(logits[forced])
            logits.fill(-np.inf)
            logits[forced] = kept if np.isfinite(kept) else 0.0
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
        shown = token in sampler.preserved
        known = self._tokens.get((token, shown))
        if known is None:  # a token's piece and end-of-generation flag, asked of llama.cpp once
            known = self._tokens[token, shown] = (self.vocab.token_to_piece(token, special=shown),
                                                  self.vocab.is_eog(token))
        if sampler.budget is not None:
            sampler.budget.took(known[0])
        return Sampled(conv, token, known[0], known[1], final, logprob, top)

    def close(self) -> None:
        for seq_id in [*self._attached, *self._idle]:
            attach(self.ctx, seq_id, None)
        self._attached.clear()
        for chain in self._idle.values():
            chain.close()
        self._idle.clear()
        for sampler in self._streams.values():
            sampler.chain.close()
        self._streams.clear()


def verify(sampling: Sampling, remove: Callable[[int, int, int], None], chosen: list[list[Sampled]],
           outputs: list[tuple[int, int]], drafts: list[tuple[int, Slice]],
           failed: dict[int, BaseException]) -> list[list[Sampled]]:
    """Continue the drafted rows: while the token chosen equals the next draft token, choose the
    next one from that token's row. The cells of the draft tokens not taken are removed."""
    for i, s in drafts:
        row = outputs[i][1]
        draft = s.tokens[1:]
        got = chosen[i]
        k = 0
        while got and k < len(draft) and got[-1].token == draft[k] and not got[-1].eog:
            k += 1
            more = sampling.sample([(s.conv, row + k)], failed)[0]
            if not more:
                break
            got += more
        # the pending token and each draft token followed by a chosen token keep their cells
        # (what the scheduler counts); after a failed row the last draft token taken waits
        kept = max(1, len(got))
        if kept < len(s.tokens):
            remove(s.seq_id, s.pos + kept, -1)
    return chosen
