"""Integration tests on the real SmolLM2-135M-Instruct model."""

from __future__ import annotations

import pytest

from aiollama.native import Batch, Context, DecodeStatus, Model, SamplerChain

pytestmark = pytest.mark.smollm2


def greedy_continuation(ctx: Context, prompt: str, n: int) -> str:
    vocab = ctx.vocab
    tokens = vocab.tokenize(prompt, add_special=True)
    out: list[int] = []
    with Batch(ctx.n_batch) as b, SamplerChain(vocab) as greedy:
        greedy.add_greedy()
        last = b.add_tokens(tokens, 0, 0, output_last=True)
        pos = len(tokens)
        for _ in range(n):
            assert ctx.decode(b) is DecodeStatus.OK
            token = greedy.sample(ctx, last)
            out.append(token)
            b.clear()
            last = b.add(token, pos, 0, output=True)
            pos += 1
    return vocab.detokenize(out)


def test_capital_of_france(smollm2: Model) -> None:
    with Context(smollm2, n_ctx=512, n_batch=64) as ctx:
        text = greedy_continuation(ctx, "The capital of France is", 4)
    assert text.startswith(" Paris")


def test_batched_first_tokens_match_solo(smollm2: Model) -> None:
    vocab = smollm2.vocab
    prompts = ["The capital of France is", "My favourite colour is", "1, 2, 3, 4,"]
    encoded = [vocab.tokenize(p, add_special=True) for p in prompts]

    def first_tokens(together: bool) -> list[int]:
        with Context(smollm2, n_ctx=512, n_batch=64, n_seq_max=3) as ctx, Batch(64) as b, \
                SamplerChain(vocab) as greedy:
            greedy.add_greedy()
            if together:
                rows = [b.add_tokens(t, 0, s, output_last=True) for s, t in enumerate(encoded)]
                assert ctx.decode(b) is DecodeStatus.OK
                return [greedy.sample(ctx, r) for r in rows]
            out = []
            for s, t in enumerate(encoded):
                b.clear()
                row = b.add_tokens(t, 0, s, output_last=True)
                assert ctx.decode(b) is DecodeStatus.OK
                out.append(greedy.sample(ctx, row))
            return out

    solo = first_tokens(together=False)
    assert first_tokens(together=True) == solo
    assert vocab.detokenize(solo[:1]) == " Paris"


def test_model_chat_template(smollm2: Model) -> None:
    template = smollm2.chat_template()
    assert template and "<|im_start|>" in template
    text = smollm2.vocab.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert text.endswith("<|im_start|>assistant\n")
