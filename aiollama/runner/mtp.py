"""Speculative decoding with the model's own multi-token-prediction (MTP) layers: a NextN block
that reads a token and the model's hidden state at the position before it, and guesses the token
after it. llama.cpp runs it in a context of its own (``LLAMA_CONTEXT_TYPE_MTP``) beside the target
context, on the same weights; the step verifies its drafts like a draft model's (see
:mod:`aiollama.runner.drafter`), so the text is the text without drafts.

Each seq id of the MTP context holds, from a start position on, one entry per token the target has
evaluated and kept: the token at position p, paired with the target's hidden state at p - 1. After
each target decode, :meth:`MtpDrafter.feed` queues the entries of the tokens it kept (a slice's
rejected draft tokens are not kept), with the target's hidden states, and remembers the last one's
state, which the next draft starts from; a sequence's queued entries are decoded with its first
draft entry, so a stream that does not draft (paused by the adaptive draft length) costs a copy.
The target's KV operations are mirrored (a removal cuts, a copy shares the cells of a fork's
prefix); a sequence whose positions the MTP context cannot
follow (a restored state, a context shift) starts afresh where its next tokens are (its earlier
entries lost, the drafts weaker, never wrong). Drafts of all streams are decoded together, one
entry per stream and draft token. Runs on the decode thread, inside the executor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aiollama.config import EngineConfig
from aiollama.errors import InvalidRequestError, UnsupportedModel
from aiollama.native import Context, DecodeStatus, Model
from aiollama.native.nextn import NextnBatch, hidden, hidden_row, logits_row, n_embd_out, output_hidden
from aiollama.runner.drafter import Drafter
from aiollama.sched.step import Copy, Op, Remove, Restore, Shift, Slice

# The hybrid architectures (recurrent layers beside attention) whose MTP context llama.cpp gives a
# plain attention cache for the MTP block alone: the recurrent state stays in the target's context,
# which rolls a rejected draft back like any other (see aiollama.runner.removal) where llama.cpp
# keeps snapshots for the architecture (not Qwen3-Next's at the pinned tag: check_rollback refuses it).
# DeepSeek V4's memory counts as hybrid: its compressors keep a state per sequence.
MTP_HYBRIDS = frozenset({"qwen3next", "qwen35", "qwen35moe", "qwen4exp", "bailingmoe3", "nemotron_h_moe", "deepseek4"})

# The architectures whose MTP graph keeps the hidden states of the entries with logits only, whatever
# the context asks (llama.cpp at the pinned tag): there every entry asks for logits, so that every
# entry's state is kept (reading them all from a graph that kept fewer reads past its end, and
# llama.cpp aborts the process). The cost: the output projection for the queued entries too.
STATES_WITH_LOGITS = frozenset({"step35", "mimo2", "deepseek4", "qwen3next"})

# The architectures whose MTP graph at the pinned tag runs one block: llama.cpp aborts the process
# (an assertion) when such a model carries more. The others (Step 3.5, MiMo-V2, Hunyuan V3) run the
# first of several, as here.
ONE_BLOCK = frozenset({"glm4moe", "deepseek2", "deepseek32", "deepseek4", "glm-dsa", "cohere2moe", "bailingmoe3",
                       "nemotron_h_moe", "qwen35", "qwen35moe", "qwen3next", "qwen4exp"})

# A sequence's entries wait to be decoded until it drafts (with its first draft entry, in one
# decode), or until this many wait: a stream that does not draft costs a copy of its states only.
QUEUE_ROWS = 256


class _Full(Exception):
    """The MTP context has no room (or its decode failed): start it afresh."""


@dataclass
class _Entries:
    """A seq id's entries: from ``start`` on, ``held`` in the MTP context, then ``queued`` (with
    their states, in blocks); ``last``: the target's state after the last one, if known."""

    start: int
    held: list[int] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)
    states: list[np.ndarray] = field(default_factory=list)
    last: np.ndarray | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.held) + len(self.queued)


# (token, position, seq id, state, key): an entry of a decode; its logits and state are read under
# ``key`` where that is not None
Entry = tuple[int, int, int, np.ndarray, int | None]


def head_options(model: Model, target: Context, n_threads: int | None) -> dict[str, Any]:
    """The options of the MTP context of ``target`` (as many cells and seq ids, one cache).
    Raises InvalidRequestError for a model without MTP layers, UnsupportedModel for one whose MTP
    head llama.cpp would abort the process on (rather than run)."""
    if model.n_layer_nextn == 0:
        raise InvalidRequestError(f"{model.path} has no multi-token-prediction layers: give mtp=False")
    arch = model.metadata("general.architecture")
    if arch in ONE_BLOCK and model.n_layer_nextn > 1:
        raise UnsupportedModel(f"{Path(model.path).name} has {model.n_layer_nextn} MTP blocks, and llama.cpp runs "
                               f"the MTP head of {arch} with one only (give no mtp)")
    if arch == "deepseek2" and (not float(model.metadata(f"{arch}.attention.key_length_mla") or 0)
                                or float(model.metadata(f"{arch}.attention.temperature_scale") or 0)):
        raise UnsupportedModel(f"{Path(model.path).name}: llama.cpp runs the MTP head of {arch} with latent "
                               "attention and no attention temperature only (give no mtp)")
    return {"n_ctx": target.n_ctx, "n_batch": target.n_batch, "n_seq_max": target.n_seq_max, "n_threads": n_threads,
            "kv_unified": True, "mtp": True}


class MtpDrafter:
    """The MTP context of ``target`` (whose model was loaded with ``load_mtp``). Build and use it
    on the decode thread.

    Raises (on creation): InvalidRequestError for a model without MTP layers, ContextCreateError.
    """

    def __init__(self, model: Model, target: Context, *, n_threads: int | None) -> None:
        with contextlib.ExitStack() as stack:
            self.ctx = stack.enter_context(Context(model, **head_options(model, target, n_threads)))
            self.batch = stack.enter_context(NextnBatch(self.ctx))
            self._handles = stack.pop_all()
        self.target = target
        output_hidden(target, masked=False)  # every entry's: each kept token becomes an MTP entry
        # a draft token's, for the next draft token. Unmasked: a decode mixes queued entries (no
        # logits) with draft entries, and llama.cpp's MTP graphs keep the masked states of the first
        # entries, not of those with logits (they only ever decode one kind at a time)
        output_hidden(self.ctx, masked=False)
        self.width = n_embd_out(self.ctx)
        self.vocab = model.vocab
        self._every_row = model.metadata("general.architecture") in STATES_WITH_LOGITS
        self._seqs: dict[int, _Entries] = {}
        self.resets = 0

    def _end(self, seq_id: int) -> int:
        e = self._seqs.get(seq_id)
        return e.end if e is not None else 0

    def _cut(self, seq_id: int, p0: int) -> None:
        """Drop the entries from ``p0`` on (all of them where ``p0`` is at or before the start)."""
        e = self._seqs.get(seq_id)
        if e is None or p0 >= e.end:
            return
        if p0 <= e.start:
            self._forget(seq_id)
            return
        in_ctx = e.start + len(e.held)
        if p0 < in_ctx:
            self.ctx.seq_rm(seq_id, p0, -1)
            del e.held[p0 - e.start:]
            e.queued, e.states = [], []
        else:
            keep = p0 - in_ctx
            e.states = [np.concatenate(e.states)[:keep]] if keep else []
            del e.queued[keep:]
        e.last = None  # the state after the new last entry is not known

    def _forget(self, seq_id: int) -> None:
        self.ctx.seq_rm(seq_id, 0, -1)
        self._seqs.pop(seq_id, None)

    def mirror(self, ops: Sequence[Op]) -> None:
        """Follow the target's KV operations (before its decode)."""
        for op in ops:
            if isinstance(op, Remove):
                self._cut(op.seq_id, op.p0)
            elif isinstance(op, Copy):
                self._forget(op.dst)
                src = self._seqs.get(op.src)
                if src is not None and src.start == 0 and 0 < op.n <= src.end:
                    try:
                        self._flush([op.src])
                    except _Full:
                        self._reset()
                        continue
                    self.ctx.seq_cp(op.src, op.dst, 0, op.n)
                    self._seqs[op.dst] = _Entries(0, src.held[:op.n], last=src.last if op.n == src.end else None)
            elif isinstance(op, (Shift, Restore)):  # positions the entries do not follow
                self._forget(op.seq_id)

    def feed(self, kept: Sequence[tuple[int, int, Sequence[int], int]]) -> None:
        """After a target decode: for each ``(seq_id, pos, tokens, row)``, the tokens it kept at
        ``pos`` on, whose hidden states are the decode's entries from ``row`` on. Their entries
        are queued (the states copied)."""
        if not kept:
            return
        states = hidden(self.target, max(row + len(tokens) for _, _, tokens, row in kept))
        full: list[int] = []
        for seq_id, p, new, row in kept:
            if not new:
                continue
            self._cut(seq_id, p)
            e = self._seqs.get(seq_id)
            if e is None or e.end != p:  # none yet, or a gap: start afresh at p
                self._forget(seq_id)
                e = self._seqs[seq_id] = _Entries(p)
            before = e.last[None, :] if e.last is not None else np.zeros((1, self.width), np.float32)
            # one token (most steps): its entry pairs it with the last state, a copy already held
            e.states.append(before if len(new) == 1 else np.concatenate([before, states[row:row + len(new) - 1]]))
            e.queued.extend(new)
            e.last = states[row + len(new) - 1].copy()
            if len(e.queued) >= QUEUE_ROWS:
                full.append(seq_id)
        try:
            self._flush(full)
        except _Full:
            self._reset()

    def _flush(self, seq_ids: Sequence[int], extra: Sequence[Entry] = ()) -> dict[int, tuple[int, np.ndarray]]:
        """Decode the queued entries of ``seq_ids``, then ``extra``; return what the keyed entries
        chose (greedily) and their states. Raises _Full."""
        entries: list[Entry] = []
        for seq_id in seq_ids:
            e = self._seqs[seq_id]
            if e.queued:
                rows = np.concatenate(e.states)
                p0 = e.start + len(e.held)
                entries += [(t, p0 + i, seq_id, rows[i], None) for i, t in enumerate(e.queued)]
                e.held += e.queued
                e.queued, e.states = [], []
        return self._run(entries + list(extra))

    def _run(self, entries: list[Entry]) -> dict[int, tuple[int, np.ndarray]]:
        got: dict[int, tuple[int, np.ndarray]] = {}
        room = self.batch.capacity
        for i in range(0, len(entries), room):
            chunk = entries[i:i + room]
            status = self.batch.process([x[0] for x in chunk], [x[1] for x in chunk], [x[2] for x in chunk],
                                        np.stack([x[3] for x in chunk]),
                                        [self._every_row or x[4] is not None for x in chunk])
            if status is not DecodeStatus.OK:
                raise _Full
            for j, x in enumerate(chunk):
                if x[4] is not None:
                    got[x[4]] = (int(logits_row(self.ctx, j).argmax()), hidden_row(self.ctx, j, self.width).copy())
        return got

    def _reset(self) -> None:
        self.ctx.memory_clear()
        self._seqs.clear()
        self.resets += 1

    def draft(self, wants: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """For each ``(seq_id, history, limit)``: up to ``limit`` tokens the MTP layers choose
        greedily after ``history`` (the conversation's tokens, the pending one last), stopping
        before an end-of-generation token. A sequence whose entries do not reach its pending token
        drafts nothing. Its queued entries are decoded with its first draft entry."""
        drafts: dict[int, list[int]] = {}
        growing: list[Entry] = []
        for seq_id, history, limit in wants:
            e = self._seqs.get(seq_id)
            n = len(history) - 1
            if limit > 0 and e is not None and e.end == n and e.last is not None:
                drafts[seq_id] = []
                growing.append((history[n], n, seq_id, e.last, seq_id))
        limits = {seq_id: limit for seq_id, _, limit in wants}
        try:
            got = self._flush(list(drafts), growing)
            while growing:
                still: list[Entry] = []
                for _, p, seq_id, _, _ in growing:
                    token, state = got[seq_id]
                    if self.vocab.is_eog(token):
                        continue
                    drafts[seq_id].append(token)
                    if len(drafts[seq_id]) < limits[seq_id]:
                        still.append((token, p + 1, seq_id, state, seq_id))
                growing = still
                if growing:
                    got = self._run(growing)
        except _Full:
            self._reset()
            return [() for _ in wants]
        for seq_id in drafts:  # the draft's entries go: the kept tokens come back with the target's states
            self.ctx.seq_rm(seq_id, self._end(seq_id), -1)
        return [tuple(drafts.get(seq_id, ())) for seq_id, _, _ in wants]

    def close(self) -> None:
        self._handles.close()


def kept_tokens(slices: Sequence[Slice], starts: Sequence[int], kept: dict[int, int],
                skip: Collection[int]) -> list[tuple[int, int, Sequence[int], int]]:
    """What each decoded slice kept, for :meth:`MtpDrafter.feed`: all its tokens, or for a drafted
    slice the ``kept`` count its conversation has (the pending token and the draft tokens the
    sampler took); nothing of a slice in ``skip`` (thrown away, or whose sampling failed)."""
    return [(s.seq_id, s.pos, s.tokens[:kept.get(s.conv, len(s.tokens))], row)
            for s, row in zip(slices, starts) if s.conv not in skip]


def drafter_for(config: EngineConfig, model: Model, ctx: Context, embeds_only: bool) -> Drafter | MtpDrafter | None:
    """What drafts for speculation: the draft model, the model's own MTP layers, or nothing (n-grams
    are the scheduler's). UnsupportedModel for drafts asked of an embedding model."""
    if embeds_only:
        if config.mtp or config.draft_model is not None:
            raise UnsupportedModel(f"{Path(model.path).name} is an embedding model: it generates nothing to draft "
                                   f"(give no {'mtp' if config.mtp else 'draft_model'})")
        return None
    if config.mtp:
        return MtpDrafter(model, ctx, n_threads=config.n_threads)
    if config.draft_model is None:
        return None
    return Drafter(config.draft_model, model.vocab, n_ctx=config.n_ctx, n_batch=ctx.n_batch, n_seq_max=ctx.n_seq_max,
                   n_threads=config.n_threads, n_gpu_layers=-1 if model.n_gpu_layers != 0 else 0)
