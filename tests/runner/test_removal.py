"""Drafts on a recurrent state, on llama.cpp itself (the tiny LFM2, whose short convolutions keep
snapshots): a state cut back within its last decode continues as if the cut tokens had never been
decoded, and a copy made before its next decode (a fork, a new turn sharing the whole state) gets
the rolled-back state once the rollback is applied (``Removal.settle``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tiny_model import lfm2_model, mamba_model

import aiollama
from aiollama.errors import DecodeError
from aiollama.native import Batch, Context, Model
from aiollama.runner.removal import Removal

PROMPT = [1, 504, 3426, 314, 3599, 284, 260, 2116]
DRAFT = [700, 701, 702]  # decoded after the prompt, then cut back: rejected draft tokens
NEXT = 555


@pytest.fixture(scope="module")
def lfm2(smollm2_path: Path) -> Iterator[Model]:
    with Model(lfm2_model(aiollama.cache_dir() / "test-models", smollm2_path)) as model:
        yield model


def decode(ctx: Context, batch: Batch, rows: list[tuple[int, list[int], int]]) -> list[np.ndarray]:
    """Decode ``(seq_id, tokens, pos)`` for each sequence; the logits of each one's last row."""
    batch.clear()
    last = [batch.add_tokens(tokens, pos, seq_id, output_last=True) for seq_id, tokens, pos in rows]
    assert ctx.decode(batch).name == "OK"
    return [np.array(ctx.logits(i)) for i in last]


def drafted(model: Model, rollback: int) -> tuple[Context, Batch, Removal]:
    """A context whose sequence 0 decoded the prompt and the draft in one step, the draft then cut."""
    ctx, batch = Context(model, n_ctx=256, n_seq_max=3, rollback=rollback), Batch(64)
    decode(ctx, batch, [(0, PROMPT, 0)])
    decode(ctx, batch, [(0, [PROMPT[-1] + 1, *DRAFT], len(PROMPT))])
    removal = Removal(ctx, None)
    removal.draft(0, len(PROMPT) + 1)  # the pending token stays (position 8), the draft goes
    return ctx, batch, removal


def test_a_state_rolled_back_within_its_last_decode_continues_without_the_draft(lfm2: Model) -> None:
    ctx, batch, removal = drafted(lfm2, rollback=4)
    try:
        assert ctx.rollback == 4 and removal.pending == {0}
        assert ctx.seq_pos_max(0) == len(PROMPT)
        got = decode(ctx, batch, [(0, [NEXT], len(PROMPT) + 1)])[0]
        removal.decoded([0])
        assert not removal.pending
    finally:
        batch.close()
        ctx.close()
    with Context(lfm2, n_ctx=256, n_seq_max=1) as ref, Batch(64) as rb:
        decode(ref, rb, [(0, PROMPT, 0)])
        want = decode(ref, rb, [(0, [PROMPT[-1] + 1, NEXT], len(PROMPT))])[0]
    assert np.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("settle", [True, False])
def test_a_copy_before_the_next_decode_gets_the_rolled_back_state_once_it_is_settled(lfm2: Model,
                                                                                    settle: bool) -> None:
    with Context(lfm2, n_ctx=256, n_seq_max=1) as ref, Batch(64) as rb:
        decode(ref, rb, [(0, PROMPT, 0)])
        want = decode(ref, rb, [(0, [PROMPT[-1] + 1, NEXT], len(PROMPT))])[0]
    ctx, batch, removal = drafted(lfm2, rollback=4)
    try:
        if settle:
            removal.settle(0, 1)
            assert not removal.pending
        ctx.seq_cp(0, 1, 0, len(PROMPT) + 1)
        parent, child = decode(ctx, batch, [(0, [NEXT], len(PROMPT) + 1), (1, [NEXT], len(PROMPT) + 1)])
    finally:
        batch.close()
        ctx.close()
    assert np.allclose(parent, want, atol=1e-4)
    # unsettled, the copy shares the state from before the rollback: the draft's tokens are in it
    assert np.allclose(child, want, atol=1e-4) is settle


def test_a_model_without_snapshots_cannot_roll_back(smollm2_path: Path) -> None:
    with Model(mamba_model(aiollama.cache_dir() / "test-models", smollm2_path)) as mamba:
        ctx, batch = Context(mamba, n_ctx=256, n_seq_max=1, rollback=4), Batch(64)
        try:
            assert ctx.rollback == 0  # llama.cpp keeps none for Mamba: asked for, not given
            decode(ctx, batch, [(0, PROMPT, 0)])
            with pytest.raises(DecodeError, match="could not remove"):
                Removal(ctx, None).draft(0, 4)
        finally:
            batch.close()
            ctx.close()
