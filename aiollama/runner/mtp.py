"""Speculative decoding with the model's own multi-token-prediction (MTP) layers: a NextN block
that reads a token and the model's hidden state at the position before it, and guesses the token
after it. llama.cpp runs it in a context of its own (``LLAMA_CONTEXT_TYPE_MTP``) beside the target
context, on the same weights; the step verifies its drafts like a draft model's (see
:mod:`aiollama.runner.drafter`), so the text is the text without drafts.

Each seq id of the MTP context holds, from a start position on, one entry per token the target has
evaluated and kept: the token at position p, paired with the target's hidden state at p - 1. After
each target decode, :meth:`MtpDrafter.feed` adds the entries of the tokens it kept (a slice's
rejected draft tokens are not kept) from the target's hidden states, and remembers the last one's
state, which the next draft starts from. The target's KV operations are mirrored (a removal cuts,
a copy shares the cells of a fork's prefix); a sequence whose positions the MTP context cannot
follow (a restored state, a context shift) starts afresh where its next tokens are (its earlier
entries lost, the drafts weaker, never wrong). Drafts of all streams are decoded together, one
entry per stream and draft token. Runs on the decode thread, inside the executor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence

import numpy as np

from aiollama.errors import InvalidRequestError
from aiollama.native import Context, DecodeStatus, Model
from aiollama.native.nextn import NextnBatch, hidden, hidden_row, logits_row, n_embd_out, output_hidden
from aiollama.sched.step import Copy, Op, Remove, Restore, Shift, Slice


class _Full(Exception):
    """The MTP context has no room (or its decode failed): start it afresh."""


class MtpDrafter:
    """The MTP context of ``target`` (whose model was loaded with ``load_mtp``). Build and use it
    on the decode thread.

    Raises (on creation): InvalidRequestError for a model without MTP layers, ContextCreateError.
    """

    def __init__(self, model: Model, target: Context, *, n_ctx: int, n_seq_max: int, n_threads: int | None) -> None:
        if model.n_layer_nextn == 0:
            raise InvalidRequestError(f"{model.path} has no multi-token-prediction layers: give mtp=False")
        with contextlib.ExitStack() as stack:
            self.ctx = stack.enter_context(Context(model, n_ctx=n_ctx, n_batch=target.n_batch, n_seq_max=n_seq_max,
                                                   n_threads=n_threads, kv_unified=True, mtp=True))
            self.batch = stack.enter_context(NextnBatch(self.ctx))
            self._handles = stack.pop_all()
        self.target = target
        output_hidden(target, masked=False)  # every entry's: each kept token becomes an MTP entry
        output_hidden(self.ctx, masked=True)  # a draft token's, for the next draft token
        self.width = n_embd_out(self.ctx)
        self.vocab = model.vocab
        self._start: dict[int, int] = {}  # seq id -> the position of its first entry
        self._held: dict[int, list[int]] = {}  # seq id -> the tokens of its entries, from the start on
        self._last: dict[int, np.ndarray] = {}  # seq id -> the target's hidden state after its last entry
        self.resets = 0

    def _end(self, seq_id: int) -> int:
        return self._start.get(seq_id, 0) + len(self._held.get(seq_id, ()))

    def _cut(self, seq_id: int, p0: int) -> None:
        """Drop the entries from ``p0`` on (all of them where ``p0`` is before the start)."""
        start = self._start.get(seq_id, 0)
        held = self._held.get(seq_id, [])
        if p0 <= start:
            self._forget(seq_id)
        elif p0 < start + len(held):
            self.ctx.seq_rm(seq_id, p0, -1)
            del held[p0 - start:]
            self._last.pop(seq_id, None)  # the state after the new last entry is not known

    def _forget(self, seq_id: int) -> None:
        self.ctx.seq_rm(seq_id, 0, -1)
        self._start.pop(seq_id, None)
        self._held.pop(seq_id, None)
        self._last.pop(seq_id, None)

    def mirror(self, ops: Sequence[Op]) -> None:
        """Follow the target's KV operations (before its decode)."""
        for op in ops:
            if isinstance(op, Remove):
                self._cut(op.seq_id, op.p0)
            elif isinstance(op, Copy):
                self._forget(op.dst)
                if self._start.get(op.src, 0) == 0 and op.n <= self._end(op.src):
                    self.ctx.seq_cp(op.src, op.dst, 0, op.n)
                    self._start[op.dst] = 0
                    self._held[op.dst] = self._held.get(op.src, [])[:op.n]
                    if op.n == self._end(op.src) and op.src in self._last:
                        self._last[op.dst] = self._last[op.src]
            elif isinstance(op, (Shift, Restore)):  # positions the entries do not follow
                self._forget(op.seq_id)

    def feed(self, kept: Sequence[tuple[int, int, Sequence[int], int]]) -> None:
        """After a target decode: for each ``(seq_id, pos, tokens, row)``, the tokens it kept at
        ``pos`` on, whose hidden states are the decode's entries from ``row`` on."""
        if not kept:
            return
        states = hidden(self.target, max(row + len(tokens) for _, _, tokens, row in kept))
        tokens: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        rows: list[np.ndarray] = []
        for seq_id, p, new, row in kept:
            if not new:
                continue
            if self._end(seq_id) != p:
                self._cut(seq_id, p)
                if self._end(seq_id) != p:  # a gap: start afresh at p
                    self._forget(seq_id)
                    self._start[seq_id] = p
            before = self._last.get(seq_id)
            rows.append(before[None, :] if before is not None else np.zeros((1, self.width), np.float32))
            rows.append(states[row:row + len(new) - 1])
            tokens.extend(new)
            pos.extend(range(p, p + len(new)))
            seqs.extend([seq_id] * len(new))
            self._held.setdefault(seq_id, []).extend(new)
            self._last[seq_id] = states[row + len(new) - 1].copy()
        try:
            self._process(tokens, pos, seqs, np.concatenate(rows) if rows else np.zeros((0, self.width), np.float32))
        except _Full:
            self._reset()

    def _process(self, tokens: list[int], pos: list[int], seqs: list[int], rows: np.ndarray,
                 outputs: list[bool] | None = None) -> None:
        room = self.batch.capacity
        for i in range(0, len(tokens), room):
            j = i + room
            status = self.batch.process(tokens[i:j], pos[i:j], seqs[i:j], rows[i:j],
                                        outputs[i:j] if outputs is not None else [False] * len(tokens[i:j]))
            if status is not DecodeStatus.OK:
                raise _Full

    def _reset(self) -> None:
        self.ctx.memory_clear()
        self._start.clear()
        self._held.clear()
        self._last.clear()
        self.resets += 1

    def draft(self, wants: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """For each ``(seq_id, history, limit)``: up to ``limit`` tokens the MTP layers choose
        greedily after ``history`` (the conversation's tokens, the pending one last), stopping
        before an end-of-generation token. A sequence whose entries do not reach its pending token
        drafts nothing."""
        drafts: dict[int, list[int]] = {}
        growing: list[tuple[int, int, np.ndarray, int]] = []  # (seq id, position, state, token)
        for seq_id, history, limit in wants:
            n = len(history) - 1
            if limit > 0 and self._end(seq_id) == n and seq_id in self._last:
                drafts[seq_id] = []
                growing.append((seq_id, n, self._last[seq_id], history[n]))
        limits = {seq_id: limit for seq_id, _, limit in wants}
        try:
            while growing:
                self._process([t for _, _, _, t in growing], [p for _, p, _, _ in growing],
                              [s for s, _, _, _ in growing], np.stack([h for _, _, h, _ in growing]),
                              [True] * len(growing))
                still: list[tuple[int, int, np.ndarray, int]] = []
                for i, (seq_id, p, _, _) in enumerate(growing):
                    token = int(logits_row(self.ctx, i).argmax())
                    if self.vocab.is_eog(token):
                        continue
                    drafts[seq_id].append(token)
                    if len(drafts[seq_id]) < limits[seq_id]:
                        still.append((seq_id, p + 1, hidden_row(self.ctx, i, self.width).copy(), token))
                growing = still
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
