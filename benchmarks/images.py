"""What pictures cost the streams that run beside them: 8 SmolLM2 streams generate 128 tokens each
while 4 prompts arrive, one every half second, each holding a 576-row picture; the same with the
pictures replaced by text prompts of the same length; and the 8 streams alone. It reports the
running streams' tokens/s (over their own span) and the longest and median gap between their
tokens once they run (after their first 8), and the arrivals' time to first token.

    pip install ".[bench]" && python benchmarks/images.py               # about a minute

The projector is random (LLaVA's "mlp" layout, a 96x96 input in 4x4 patches, projected to
SmolLM2's width), written with ``gguf``: what it sees is noise, but its rows cost the text model
what real ones do. Results go to benchmarks/results/<date>-<machine>-<cpus>cpu-images.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import anyio  # noqa: E402
from common import machine, prompts, save_results  # noqa: E402
from tiny_projector import png, write_projector  # noqa: E402

import aiollama  # noqa: E402
from aiollama.native import math_cpus  # noqa: E402

STREAMS, NEW, ARRIVALS, EVERY, SIDE, PATCH = 8, 128, 4, 0.5, 96, 4
ROWS = (SIDE // PATCH) ** 2


async def scenario(engine: aiollama.Engine, kind: str, n_vocab: int, seed: int) -> dict[str, Any]:
    """The 8 streams, with arrivals of ``kind`` ("pictures", "text" or "none") beside them."""
    gaps: list[float] = []  # between a running stream's chunks, after its first 8 (the prompts' prefill)
    ttft: list[float] = []
    done, ended = 0, 0.0
    texts = prompts(STREAMS, 64, n_vocab, seed=seed)
    pictures = [aiollama.Image(png(SIDE, SIDE, seed=seed + i)) for i in range(ARRIVALS)]
    await engine.encode_images(pictures)  # encoded ahead, as the server does, off the event loop

    async def running(prompt: list[int]) -> None:
        nonlocal done, ended
        conv = engine.conversation(prompt)
        last, mine = None, 0
        async for chunk in conv.stream(max_tokens=NEW, ignore_eos=True, temperature=0.7, seed=seed):
            now = time.perf_counter()
            if last is not None and mine >= 8:
                gaps.append(now - last)
            last = now
            mine += len(chunk.tokens)
        done += mine
        ended = max(ended, time.perf_counter())

    async def arriving(i: int) -> None:
        await anyio.sleep(EVERY * (i + 1))
        conv = engine.conversation()
        head, tail = prompts(2, 16, n_vocab, seed=seed + 100 + i)
        if kind == "pictures":
            conv.prompt([engine.detokenize(head), pictures[i], engine.detokenize(tail)])
        else:
            conv.prompt(prompts(1, len(head) + ROWS + len(tail), n_vocab, seed=seed + 200 + i)[0])
        start = time.perf_counter()
        async for _ in conv.stream(max_tokens=8, ignore_eos=True, temperature=0.7, seed=seed):
            ttft.append(time.perf_counter() - start)
            break
        await conv.aclose()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for prompt in texts:
            tg.start_soon(running, prompt)
        if kind != "none":
            for i in range(ARRIVALS):
                tg.start_soon(arriving, i)
    seconds = ended - start  # the running streams' own span
    return {"arrivals": kind, "tokens_per_s": done / seconds, "max_gap_ms": 1000 * max(gaps),
            "median_gap_ms": 1000 * statistics.median(gaps),
            "ttft_ms": [round(1000 * t, 1) for t in sorted(ttft)]}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = aiollama.pull()
    with tempfile.TemporaryDirectory() as tmp:
        mmproj = Path(tmp) / "mmproj.gguf"
        write_projector(mmproj, 576, n_embd=64, n_ff=128, image_size=SIDE, patch_size=PATCH)
        rows = []
        async with aiollama.Engine(model, mmproj=mmproj, n_ctx=8192, n_seq_max=16) as engine:
            n_vocab = engine.n_vocab
            encoded = time.perf_counter()
            await engine.encode_images([aiollama.Image(png(SIDE, SIDE, seed=12345))])
            encode_ms = 1000 * (time.perf_counter() - encoded)
            for r in range(args.repeats):
                for kind in ("none", "pictures", "text"):
                    row = await scenario(engine, kind, n_vocab, seed=1000 * r + 7)
                    row["repeat"] = r
                    rows.append(row)
                    print(row, flush=True)
                    await engine.clear_cache()
    return {"date": datetime.date.today().isoformat(), "machine": machine(), "threads": math_cpus(),
            "picture_rows": ROWS, "encode_ms": encode_ms, "rows": rows}


def report(r: dict[str, Any]) -> str:
    lines = [f"# Pictures beside running streams ({r['date']}, {r['machine']['cpu']}, {r['threads']} threads)", "",
             f"SmolLM2, {STREAMS} streams x {NEW} tokens; {ARRIVALS} arrivals, one every {EVERY} s, each a "
             f"prompt of a {r['picture_rows']}-row picture between two 16-token texts (or text of the same "
             f"length), 8 tokens each. Encoding one picture: {r['encode_ms']:.0f} ms (ahead, on a worker thread).",
             "", "| repeat | arrivals | running streams, tokens/s | longest gap after 8 tokens, ms | median gap, ms "
                 "| arrivals' first token, ms |",
             "|---:|---|---:|---:|---:|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['repeat']} | {row['arrivals']} | {row['tokens_per_s']:.1f} | {row['max_gap_ms']:.0f} | "
                     f"{row['median_gap_ms']:.0f} | {', '.join(str(round(t)) for t in row['ttft_ms'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results = anyio.run(main_async, args)
    save_results(results, "images", report(results))


if __name__ == "__main__":
    main()
