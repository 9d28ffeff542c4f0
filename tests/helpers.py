"""Helpers shared by the native tests."""

from __future__ import annotations

from aiollama.native import Batch, Context, DecodeStatus, Model, SamplerChain


def first_greedy_tokens(model: Model, prompts: list[list[int]], *, together: bool) -> list[int]:
    """Each prompt's first greedy token: all in one llama_decode, or one decode per prompt."""
    with Context(model, n_ctx=512, n_batch=128, n_seq_max=len(prompts)) as ctx, Batch(128) as b, \
            SamplerChain(model.vocab) as greedy:
        greedy.add_greedy()
        if together:
            rows = [b.add_tokens(p, 0, s, output_last=True) for s, p in enumerate(prompts)]
            assert ctx.decode(b) is DecodeStatus.OK
            return [greedy.sample(ctx, r) for r in rows]
        out = []
        for s, p in enumerate(prompts):
            b.clear()
            row = b.add_tokens(p, 0, s, output_last=True)
            assert ctx.decode(b) is DecodeStatus.OK
            out.append(greedy.sample(ctx, row))
        return out
