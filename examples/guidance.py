"""Classifier-free guidance between two conversations (negative prompting), after LLamaSharp's
BatchedExecutorGuidance example.

    python examples/guidance.py [MODEL.gguf] [--scale W]

The guided conversation holds the prompt to complete; the guidance conversation holds a negative
prompt before the same words. Both are decoded in the same batch at every step; the guided stream
samples from ``g + W * (l - g)`` (its own logits ``l``, the guidance's ``g``), and every token it
chooses is appended to both, so they stay in step. The unguided completion runs beside them, in the
same batches, for comparison. Scale 1 is the unguided stream.
"""

from __future__ import annotations

import argparse

import anyio

import aiollama

POSITIVE = "My favourite colour is"
NEGATIVE = "I hate the colour red. My favourite colour is"
TOKENS = 32


async def main(model: str | None, scale: float) -> None:
    async with aiollama.Engine(model, n_ctx=2048, n_seq_max=4) as engine:
        plain = engine.conversation(POSITIVE)
        guided = engine.conversation(POSITIVE)
        guidance = engine.conversation(NEGATIVE)
        params = dict(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        results: dict[str, aiollama.Completion] = {}

        async def run(name: str, stream: aiollama.Stream) -> None:
            results[name] = await stream

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "unguided", plain.stream(**params))
            tg.start_soon(run, "guided", guided.stream(guidance=guidance, guidance_scale=scale, **params))
        print(f"positive prompt: {POSITIVE!r}\nnegative prompt: {NEGATIVE!r}\nscale: {scale}\n")
        for name in ("unguided", "guided"):
            print(f"{name}: {POSITIVE}{results[name].text}\n")
        stats = results["guided"].stats
        assert stats is not None
        print(f"guided: {stats.decode_steps} steps, first token after {stats.time_to_first_token * 1000:.0f} ms, "
              f"{stats.total_seconds:.2f} s in all")
        same = list(guidance.tokens[-TOKENS:]) == results["guided"].tokens
        print(f"the guidance conversation holds the guided tokens too: {same}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--scale", type=float, default=3.0, help="guidance scale (1: no guidance)")
    args = parser.parse_args()
    anyio.run(main, args.model, args.scale)
