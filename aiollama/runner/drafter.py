"""Speculative decoding with a draft model: a smaller model that shares the target's vocabulary
guesses the next tokens greedily, and the step verifies them like n-gram drafts (see
:mod:`aiollama.sched.speculation`): the stream's own sampler chooses token after token from the target's
logits while it agrees with the draft, so the text is the text without drafts.

The draft model has its own context, with the target context's seq ids. What each seq id holds
there is remembered as a token list; before drafting, a sequence is brought up to its conversation's
history (the common prefix is kept, the rest removed and evaluated again), so rewinds, forks,
preemptions, context shifts and a seq id passing to another conversation need no bookkeeping here.
When the draft context is full it is emptied, and that step drafts nothing. Runs on the decode
thread, inside the executor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from aiollama.errors import InvalidRequestError, UnsupportedModel
from aiollama.native import Batch, Context, DecodeStatus, Model, Vocab
from aiollama.sched.kvtree import common_prefix
from aiollama.sched.step import Slice

VOCAB_SAMPLES = 64  # token pieces compared between the two vocabularies


class _Full(Exception):
    """The draft context has no room (or its decode failed): start it afresh."""


def check_vocabularies(draft: Vocab, target: Vocab, name: str) -> None:
    """A draft model must give its token ids the target's meaning; InvalidRequestError if not."""
    if draft.n_tokens != target.n_tokens:
        raise InvalidRequestError(f"the draft model {name} has {draft.n_tokens} tokens, the model {target.n_tokens}: "
                                  "a draft model must share the model's vocabulary")
    step = max(1, draft.n_tokens // VOCAB_SAMPLES)
    for token in range(0, draft.n_tokens, step):
        if draft.token_to_piece(token) != target.token_to_piece(token):
            raise InvalidRequestError(f"the draft model {name} reads token {token} as {draft.token_to_piece(token)!r}, "
                                      f"the model as {target.token_to_piece(token)!r}: a draft model must share the "
                                      "model's vocabulary")


class Drafter:
    """A draft model and its context. Build and use it on the decode thread.

    Raises (on creation): ModelLoadError and its subclasses (UnsupportedModel for a recurrent or
    hybrid model), ContextCreateError, and InvalidRequestError for a model whose vocabulary is not
    the target's.
    """

    def __init__(self, path: Path, target: Vocab, *, n_ctx: int, n_batch: int, n_seq_max: int,
                 n_threads: int | None, n_gpu_layers: int) -> None:
        with contextlib.ExitStack() as stack:
            self.model = stack.enter_context(Model(path, n_gpu_layers=n_gpu_layers))
            check_vocabularies(self.model.vocab, target, path.name)
            if self.model.is_recurrent:  # its state could not drop the drafts the target rejects
                raise UnsupportedModel(f"the draft model {path.name} is a recurrent or hybrid model: give a transformer")
            self.ctx = stack.enter_context(Context(self.model, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max,
                                                   n_threads=n_threads, kv_unified=True))
            self.batch = stack.enter_context(Batch(self.ctx.n_batch))
            self._handles = stack.pop_all()
        self.vocab = self.model.vocab
        self._held: dict[int, list[int]] = {}  # seq id -> the tokens the draft context holds for it
        self.resets = 0

    def draft(self, wants: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """For each ``(seq_id, history, limit)``: up to ``limit`` tokens the draft model chooses
        greedily after ``history`` (the conversation's tokens, the pending one last), stopping
        before an end-of-generation token."""
        try:
            first = self._catch_up(wants)
            return self._extend(wants, first)
        except _Full:
            self.ctx.memory_clear()
            self._held.clear()
            self.resets += 1
            return [() for _ in wants]

    def _decode(self) -> None:
        if self.ctx.decode(self.batch) is not DecodeStatus.OK:
            raise _Full

    def _choice(self, row: int) -> int:
        return int(np.frombuffer(self.ctx.logits_buffer(row), dtype=np.float32).argmax())

    def _catch_up(self, wants: Sequence[tuple[int, Sequence[int], int]]) -> dict[int, int]:
        """Evaluate what each sequence's history adds to what the draft context holds; return
        each one's first draft token."""
        todo: list[tuple[int, Sequence[int], int]] = []  # (seq id, history, next position)
        for seq_id, history, _ in wants:
            held = self._held.setdefault(seq_id, [])
            keep = min(common_prefix(held, history), len(history) - 1)  # the last one gives the logits
            if keep < len(held):
                self.ctx.seq_rm(seq_id, keep, -1)
                del held[keep:]
            todo.append((seq_id, history, keep))
        first: dict[int, int] = {}
        batch, room = self.batch, self.ctx.n_batch
        batch.clear()
        ends: list[tuple[int, int]] = []  # (seq id, row) of histories complete in this batch
        while todo:
            seq_id, history, pos = todo.pop()
            take = min(len(history) - pos, room - batch.n_tokens)
            done = pos + take == len(history)
            row = batch.add_tokens(history[pos:pos + take], pos, seq_id, output_last=done)
            self._held[seq_id].extend(history[pos:pos + take])
            if done:
                ends.append((seq_id, row))
            else:
                todo.append((seq_id, history, pos + take))
            if batch.n_tokens == room or not todo:
                self._decode()
                for s, r in ends:
                    first[s] = self._choice(r)
                batch.clear()
                ends.clear()
        return first

    def _extend(self, wants: Sequence[tuple[int, Sequence[int], int]], first: dict[int, int]) -> list[tuple[int, ...]]:
        drafts = {seq_id: [first[seq_id]] for seq_id, _, limit in wants
                  if limit > 0 and not self.vocab.is_eog(first[seq_id])}
        limits = {seq_id: limit for seq_id, _, limit in wants}
        growing = [s for s, d in drafts.items() if len(d) < limits[s]]
        while growing:
            self.batch.clear()
            rows = [(s, self.batch.add_tokens(drafts[s][-1:], len(self._held[s]), s, output_last=True))
                    for s in growing]
            self._decode()
            still: list[int] = []
            for s, row in rows:
                self._held[s].append(drafts[s][-1])
                token = self._choice(row)
                if self.vocab.is_eog(token):
                    continue
                drafts[s].append(token)
                if len(drafts[s]) < limits[s]:
                    still.append(s)
            growing = still
        return [tuple(drafts.get(seq_id, ())) for seq_id, _, _ in wants]

    def close(self) -> None:
        self._handles.close()


class Drafts(Protocol):
    """What drafts tokens for the executor: a :class:`Drafter`, or the model's own MTP layers."""

    def draft(self, wants: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]: ...


def with_drafts(drafter: Drafts, slices: Sequence[Slice]) -> tuple[tuple[Slice, ...], dict[int, int]]:
    """The slices with the draft model's tokens after their pending one, where it was asked for;
    and how many each got, by conversation."""
    asked = [s for s in slices if s.model_draft]
    got = drafter.draft([(s.seq_id, s.history, s.model_draft) for s in asked])  # pending token last
    tokens = {s.conv: d for s, d in zip(asked, got) if d}
    out = tuple(Slice(s.conv, s.seq_id, s.pos, s.tokens + tokens[s.conv], True, len(tokens[s.conv]))
                if s.conv in tokens else s for s in slices)
    return out, {conv: len(d) for conv, d in tokens.items()}
