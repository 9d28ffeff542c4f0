"""Integration tests on the real SmolLM2-135M-Instruct model."""

from __future__ import annotations

import pytest
from helpers import first_greedy_tokens

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

    solo = first_greedy_tokens(smollm2, encoded, together=False)
    assert first_greedy_tokens(smollm2, encoded, together=True) == solo
    assert vocab.detokenize(solo[:1]) == " Paris"


def test_model_chat_template(smollm2: Model) -> None:
    template = smollm2.chat_template()
    assert template and "<|im_start|>" in template
    text = smollm2.vocab.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.anyio
async def test_engine_greedy_paris(smollm2_path: object) -> None:
    import aiollama

    async with aiollama.Engine(smollm2_path, n_ctx=1024, n_seq_max=4) as engine:  # type: ignore[arg-type]
        others = [engine.conversation(p) for p in ("Once upon a time", "def main():", "Dear Sir,")]
        streams = [c.stream(max_tokens=16, temperature=0.8, seed=i) for i, c in enumerate(others)]
        async with engine.conversation("The capital of France is") as conv:
            completion = await conv.stream(max_tokens=8, temperature=0.0)
        for s in streams:
            await s
        for c in others:
            await c.aclose()
    assert completion.text.startswith(" Paris")
