"""Print a model's greedy continuation of a prompt, driving the native layer by hand.

    python examples/native_greedy.py                     # SmolLM2, "The capital of France is"
    python examples/native_greedy.py MODEL.gguf "Once upon a time"
"""

from __future__ import annotations

import sys
import time

import aiollama
from aiollama.native import Batch, Context, DecodeStatus, Model, SamplerChain


def main(argv: list[str]) -> int:
    path = argv[0] if argv else str(aiollama.default_model())
    prompt = argv[1] if len(argv) > 1 else "The capital of France is"
    n_new = 32
    with Model(path) as model, Context(model, n_ctx=1024, n_batch=256) as ctx, \
            Batch(ctx.n_batch) as batch, SamplerChain(model.vocab) as greedy:
        greedy.add_greedy()
        vocab = model.vocab
        tokens = vocab.tokenize(prompt, add_special=True)
        print(f"{model.description()} from {path}")
        print(prompt, end="", flush=True)
        pending = b""
        start = time.perf_counter()
        last = batch.add_tokens(tokens, 0, 0, output_last=True)
        pos, generated = len(tokens), 0
        while generated < n_new:
            if ctx.decode(batch) is not DecodeStatus.OK:
                print("\ndecode failed", file=sys.stderr)
                return 1
            token = greedy.sample(ctx, last)
            if vocab.is_eog(token):
                break
            generated += 1
            pending += vocab.token_to_piece(token)
            try:  # print whole characters only: a piece may end inside one
                print(pending.decode("utf-8"), end="", flush=True)
                pending = b""
            except UnicodeDecodeError:
                pass
            batch.clear()
            last = batch.add(token, pos, 0, output=True)
            pos += 1
        elapsed = time.perf_counter() - start
        print(pending.decode("utf-8", "replace"))
        print(f"[{generated} tokens in {elapsed:.2f}s, {generated / elapsed:.1f} tokens/s]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
