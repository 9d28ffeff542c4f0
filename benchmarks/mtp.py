"""Speculation with a model's own MTP layers, at 1, 8 and 32 streams: tokens per second against no
speculation, in the same run, and the share of drafts taken.

    pip install ".[bench]" && python benchmarks/mtp.py            # a few minutes

The models are the tests' MTP models (tests/tiny_mtp.py: GLM-4.5's layout, random weights) made
deeper and wider, with the tests' small SentencePiece vocabulary, so that the head (one layer and
the output projection) weighs beside the trunk about what it does in a real model (Qwen3.5-4B:
one layer of 32, and a head of 248k rows beside a trunk of about 4B weights). "agrees": a head that
predicts what the model predicts, every draft taken; "never agrees": a random head.

``--device-ms D`` adds D ms to every decode of the model (the GIL released, as a GPU's decode
releases it), so that a step's time hardly depends on its rows, as on a GPU where a step reads the
weights once for all its rows: what the policy does where rows cost next to nothing. Use it with
``--shape tiny`` (the tests' 64-wide models), whose rows cost little on a CPU; the head's own
decodes are not slowed (on a GPU they cost about a layer's time).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from common import back_to_back, machine, save_results  # noqa: E402
from tiny_model import cached, spm_tokenizer  # noqa: E402
from tiny_mtp import write_mtp_model  # noqa: E402

import aiollama  # noqa: E402

TOKENS = 96
SHAPES: dict[str, dict[str, int]] = {
    "bench": dict(n_embd=512, n_head=8, n_head_kv=4, n_ff=1536, n_ff_exp=512, n_trunk=12),
    "tiny": {},  # the tests' models' own
}


def model(agree: bool, shape: str = "bench") -> Path:
    name = f"{'bench' if shape == 'bench' else 'tiny-spm'}-mtp-v1-{'agree' if agree else 'random'}.gguf"
    return cached(aiollama.cache_dir() / "test-models" / name,
                  lambda p: write_mtp_model(p, None, agree=agree, tokenizer=spm_tokenizer(), **SHAPES[shape]))


def device(path: Path, device_s: float) -> Any:
    """An executor factory: llama.cpp's executor whose every decode of the model takes ``device_s``
    longer, the GIL released."""
    from aiollama.runner.executor import NativeExecutor

    class Device(NativeExecutor):
        def _decode(self, batch: Any, on_decode: Any) -> Any:
            status = super()._decode(batch, on_decode)
            time.sleep(device_s)
            return status
    return lambda config: Device(config, path)


async def rate(path: Path, n: int, device_s: float = 0.0, **options: Any) -> tuple[float, float]:
    """Tokens per second of ``n`` greedy streams, and the share of draft tokens taken."""
    if device_s:
        options["executor"] = device(path, device_s)
    async with aiollama.Engine(path, n_ctx=8192, n_seq_max=max(n, 2), **options) as e:
        batch = [e.tokenize(f"Tell me a story about tokens {i}", add_special=True) for i in range(n)]
        await e.generate_parallel(batch[:1], max_tokens=4, temperature=0.0, ignore_eos=True)  # warm up
        await e.clear_cache()
        before = e.statistics()
        started = time.perf_counter()
        done = await e.generate_parallel(batch, max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        elapsed = time.perf_counter() - started
        after = e.statistics()
    drafted = after.drafted_tokens - before.drafted_tokens
    taken = after.accepted_tokens - before.accepted_tokens
    return sum(len(c.tokens) for c in done) / elapsed, (taken / drafted if drafted else 0.0)


async def main_async(streams: list[int], draft_tokens: int, rounds: int, shape: str,
                     device_s: float) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for n in streams:
        row: dict[str, Any] = {}
        for agree in (True, False):
            path = model(agree, shape)
            ratios, bases, taken = await back_to_back(
                rounds, lambda: rate(path, n, device_s),
                lambda: rate(path, n, device_s, mtp=True, draft_tokens=draft_tokens))
            kind = "agrees" if agree else "never"
            row.update({f"{kind}_none_tok_s": statistics.median(bases), f"{kind}_ratio": statistics.median(ratios),
                        f"{kind}_ratios": ratios, f"{kind}_taken": taken})
        rows[str(n)] = row
        print(n, row, flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--device-ms", type=float, default=0.0)
    args = parser.parse_args()
    rows = anyio.run(main_async, args.streams, args.draft_tokens, args.rounds, args.shape, args.device_ms / 1e3)
    r = {"date": datetime.date.today().isoformat(), "machine": machine(), "tokens": TOKENS,
         "shape": SHAPES[args.shape] or "tests", "device_ms": args.device_ms, "draft_tokens": args.draft_tokens,
         "rounds": args.rounds, "rows": rows}
    device_note = f"; every decode of the model {args.device_ms:g} ms longer (a simulated device)" \
        if args.device_ms else ""
    lines = [f"# MTP drafts ({r['date']}, {r['machine']['cpu']}, {r['machine']['cpus']} CPUs)", "",
             f"Tiny GLM-4.5-layout models ({r['shape']}{device_note}), greedy, {TOKENS} tokens a stream, drafts "
             f"of up to {args.draft_tokens} tokens; each ratio is tokens/s against no speculation, run just before "
             f"it, the median of {args.rounds} such pairs.", "",
             "| streams | no drafts (tok/s) | agreeing head | its drafts taken | random head | its drafts taken |",
             "|---|---|---|---|---|---|"]
    for n, row in rows.items():
        lines.append(f"| {n} | {row['agrees_none_tok_s']:.1f} | {row['agrees_ratio']:.2f}x | {row['agrees_taken']:.0%} | "
                     f"{row['never_ratio']:.2f}x | {row['never_taken']:.0%} |")
    save_results(r, "mtp" + ("-device" if args.device_ms else ""), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
