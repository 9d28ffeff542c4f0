"""What speculation costs where its drafts do not agree, and what it gains where they do, at 1, 8
and 32 streams: tokens per second against no speculation, in the same run.

    pip install ".[bench]" && python benchmarks/speculation_cost.py            # about 15 minutes

SmolLM2-135M generates greedily. "never agrees": a draft model of random weights (the tests' tiny
model, SmolLM2's vocabulary), whose drafts the target rejects; run with the adaptive pauses (a
stream whose one-token drafts are rejected stops drafting for a while) and, for comparison, with
the draft length's old floor of one token ("no pauses"). "agrees": n-gram drafts on prompts that
ask for a text back, which the reply copies.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from common import back_to_back, machine, save_results  # noqa: E402
from scenarios import copy_prompts  # noqa: E402
from tiny_model import tiny_model  # noqa: E402

import aiollama  # noqa: E402
from aiollama.sched import speculation  # noqa: E402

TOKENS = 96
QUESTION = "Write a short story about a fox who learns to sail, with a surprising ending."


@contextlib.contextmanager
def no_pauses() -> Iterator[None]:
    """The draft length as it was before pauses: it halves to one token and stays there."""
    record = speculation.DraftLength.record

    def old(self: speculation.DraftLength, offered: int, taken: int) -> None:
        record(self, offered, taken)
        self.current, self.paused = max(1, self.current), 0
    speculation.DraftLength.record = old  # type: ignore[method-assign]
    try:
        yield
    finally:
        speculation.DraftLength.record = record  # type: ignore[method-assign]


async def rate(model: Path, n: int, copy: bool, **options: Any) -> tuple[float, float]:
    """Tokens per second of ``n`` greedy streams, and the share of draft tokens taken."""
    async with aiollama.Engine(model, n_ctx=4096, n_seq_max=max(n, 2), **options) as e:
        batch = copy_prompts(e, n) if copy else [e.tokenize(e.render_chat(f"{QUESTION} ({i})"), add_special=True,
                                                            special=True) for i in range(n)]
        await e.generate_parallel(batch[:1], max_tokens=4, temperature=0.0)  # warm up
        await e.clear_cache()
        before = e.statistics()
        started = time.perf_counter()
        done = await e.generate_parallel(batch, max_tokens=TOKENS, temperature=0.0)
        elapsed = time.perf_counter() - started
        after = e.statistics()
    drafted = after.drafted_tokens - before.drafted_tokens
    taken = after.accepted_tokens - before.accepted_tokens
    return sum(len(c.tokens) for c in done) / elapsed, (taken / drafted if drafted else 0.0)


async def pairs(rounds: int, target: Path, n: int, copy: bool, **options: Any) -> tuple[float, float, list[float]]:
    """The median over ``rounds`` back-to-back pairs (no speculation, then ``options``) of the
    pair's ratio; the last variant's share of drafts taken; the ratios."""
    ratios, _, taken = await back_to_back(rounds, lambda: rate(target, n, copy),
                                          lambda: rate(target, n, copy, **options))
    return statistics.median(ratios), taken, ratios


async def main_async(streams: list[int], rounds: int) -> dict[str, Any]:
    target = aiollama.pull()
    draft = tiny_model(aiollama.cache_dir() / "test-models", target)
    rows: dict[str, Any] = {}
    for n in streams:
        base, _ = await rate(target, n, copy=False)
        never, never_taken, never_all = await pairs(rounds, target, n, False, draft_model=draft, draft_tokens=8)
        with no_pauses():
            old, _, old_all = await pairs(rounds, target, n, False, draft_model=draft, draft_tokens=8)
        copy_base, _ = await rate(target, n, copy=True)
        copied, copy_taken, copy_all = await pairs(rounds, target, n, True, draft_tokens=8)
        rows[str(n)] = {"none_tok_s": base, "never_agrees_ratio": never, "never_agrees_taken": never_taken,
                        "never_agrees_ratios": never_all, "never_agrees_no_pauses_ratio": old,
                        "never_agrees_no_pauses_ratios": old_all, "copy_none_tok_s": copy_base,
                        "copy_ngram_ratio": copied, "copy_ngram_taken": copy_taken, "copy_ngram_ratios": copy_all}
        print(n, rows[str(n)], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = anyio.run(main_async, args.streams, args.rounds)
    r = {"date": datetime.date.today().isoformat(), "machine": machine(), "tokens": TOKENS, "rounds": args.rounds,
         "rows": rows}
    lines = [f"# Speculation where it misses and where it hits ({r['date']}, {r['machine']['cpu']}, "
             f"{r['machine']['cpus']} CPUs)", "",
             f"SmolLM2-135M, greedy, {TOKENS} tokens a stream; each ratio is tokens/s against no speculation run "
             f"just before it, the median of {args.rounds} such pairs.", "",
             "| streams | no drafts (tok/s) | random draft model | the same without pauses | its drafts taken "
             "| n-gram on copies | their drafts taken |", "|---|---|---|---|---|---|---|"]
    for n, row in rows.items():
        lines.append(f"| {n} | {row['none_tok_s']:.1f} | {row['never_agrees_ratio']:.2f}x | "
                     f"{row['never_agrees_no_pauses_ratio']:.2f}x | {row['never_agrees_taken']:.0%} | "
                     f"{row['copy_ngram_ratio']:.2f}x | {row['copy_ngram_taken']:.0%} |")
    save_results(r, "speculation-cost", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
