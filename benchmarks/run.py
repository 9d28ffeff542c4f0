"""aiollama against llama.cpp's own tools, side by side, in one run.

    pip install ".[bench]" && python benchmarks/run.py            # about 20 minutes on 2 cores
    python benchmarks/run.py --quick                              # 1 and 8 streams only

Builds llama-batched-bench and llama-server from the pinned source (cached outside the repo), runs
every scenario on SmolLM2-135M-Instruct Q4_1 with the same explicit thread count for every
contender, and writes benchmarks/results/<date>-<machine>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fast_model  # noqa: E402
import report  # noqa: E402
import scenarios as sc  # noqa: E402
import tools  # noqa: E402
from common import machine  # noqa: E402

import aiollama  # noqa: E402
from aiollama.native import Model, math_cpus  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    rows = _ratio_targets(r["throughput"], "", (8, 16), 1.05)
    f = r["fairness"]
    ours, theirs = f["aiollama"], f.get("llama_server")
    p99 = ours["gaps_during_prompt"]["p99_ms"]
    if theirs:
        their_p99 = theirs["gaps_during_prompt"]["p99_ms"]
        rows.append({"target": "fairness: aiollama p99 gap <= 1/3 of llama-server's",
                     "measured": f"{p99:.0f} ms vs {their_p99:.0f} ms", "met": p99 <= their_p99 / 3})
    bound = 2 * ours["gaps_before"]["median_ms"] + ours["prefill_chunk_ms"]
    worst = ours["gaps_during_prompt"]["max_ms"]
    rows.append({"target": "fairness: no gap over 2 x median step + one prompt chunk",
                 "measured": f"max {worst:.0f} ms, bound {bound:.0f} ms", "met": worst <= bound})
    k = r["fork"]["fork"]
    rows.append({"target": "fork: the prefix is evaluated once",
                 "measured": f"{k['prompt_tokens_evaluated']} prompt tokens for a {sc.PREFIX}-token prefix",
                 "met": k["prompt_tokens_evaluated"] <= sc.PREFIX + sc.BRANCHES * 2})
    rows.append({"target": "fork: peak KV cells <= prefix + 8 x continuation + slack (64)",
                 "measured": f"{k['peak_kv_cells']} (bound {k['bound_kv_cells'] + 64})",
                 "met": k["peak_kv_cells"] <= k["bound_kv_cells"] + 64})
    o8 = r["overhead"].get("8")
    if o8 is not None:
        rows.append({"target": "overhead <= 5% at 8 streams", "measured": f"{100 * o8:.1f}%", "met": o8 <= 0.05})
    rows += _ratio_targets(r.get("fast"), "fast model", (8, 32), 1.25)
    split = r.get("split", [])
    rows += _ratio_targets(split[0] if split else None, "split cache", (8, 16), 1.05, s_tg=False)
    rows += _ratio_targets(split[1] if len(split) > 1 else None, "split cache, fast model", (8, 32), 1.25)
    spec = r.get("speculation", {}).get("1")
    if spec:
        ours = spec["aiollama"]
        gain = ours[f"draft_{sc.DRAFT_TOKENS}"]["decode_tps"] / ours["draft_0"]["decode_tps"]
        rows.append({"target": "speculation, 1 stream: >= 1.5 x tokens/s on the copying prompt, identical greedy text",
                     "measured": f"{gain:.2f} x, {'identical' if ours['identical'] else 'DIFFERENT'}",
                     "met": gain >= 1.5 and ours["identical"]})
    return rows


def _ratio_targets(section: dict[str, Any] | None, name: str, levels: tuple[int, ...], over_server: float,
                   s_tg: bool = True) -> list[dict[str, Any]]:
    """aiollama against batched-bench's S_TG (>= 0.95) and llama-server (>= ``over_server``)."""
    rows: list[dict[str, Any]] = []
    for n in levels:
        if not section or str(n) not in section["aiollama"]:
            continue
        label = f"{name}, {n} streams" if name else f"{n} streams"
        a = section["aiollama"][str(n)]["decode_tps"]
        b = section["batched_bench"].get(str(n), {}).get("s_tg")
        s = section["llama_server"].get(str(n), {}).get("decode_tps")
        if b and s_tg:
            rows.append({"target": f"{label}: aiollama >= 0.95 x batched-bench S_TG",
                         "measured": f"{a / b:.2f} x", "met": a / b >= 0.95})
        if s:
            rows.append({"target": f"{label}: aiollama >= {over_server} x llama-server",
                         "measured": f"{a / s:.2f} x", "met": a / s >= over_server})
    return rows


async def contenders(bins: dict[str, Path], model: Path, threads: int, levels: list[int], repeats: int,
                     unified: bool = True) -> dict[str, Any]:
    """The throughput scenario for the three contenders, each with a unified or a split KV cache.

    The contenders take turns, round after round, and each keeps its best round per level: on a
    shared machine a slow spell then slows one round of each, not every run of one contender."""
    with Model(model, vocab_only=True) as m:
        n_vocab = m.vocab.n_tokens
    runs: dict[str, list[dict[int, dict[str, float]]]] = {"batched_bench": [], "aiollama": [], "llama_server": []}
    for _ in range(repeats):
        runs["batched_bench"].append(sc.batched_bench(bins["llama-batched-bench"], model, threads, levels, unified))
        runs["aiollama"].append(await sc.throughput_aiollama(model, threads, levels, n_vocab, unified))
        runs["llama_server"].append(await sc.throughput_server(bins["llama-server"], model, threads, levels, n_vocab,
                                                               unified))
    out: dict[str, Any] = {"model": model.name, "levels": levels, "unified": unified}
    for name, key in (("batched_bench", "s_tg"), ("aiollama", "decode_tps"), ("llama_server", "decode_tps")):
        out[name] = {str(n): sc.best([r[n] for r in runs[name] if n in r], key)
                     for n in levels if any(n in r for r in runs[name])}
    return out


async def fast_scenario(bins: dict[str, Path], threads: int, levels: list[int], repeats: int) -> dict[str, Any]:
    """The throughput scenario on the fast random model, where per-step overhead shows."""
    return {"shape": fast_model.SHAPE, **await contenders(bins, fast_model.path(), threads, levels, repeats)}


async def main(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else aiollama.default_model()
    threads = args.threads or math_cpus()
    levels = [1, 8] if args.quick else [1, 2, 4, 8, 16, 32]
    bins = tools.build(quiet=True)
    with Model(model, vocab_only=True) as m:
        n_vocab = m.vocab.n_tokens
    r: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "llama_cpp": tools.TAG,
        "model": model.name,
        "threads": threads,
        "levels": levels,
        "repeats": args.repeats,
    }
    print(f"threads={threads} levels={levels}", flush=True)
    print("1. throughput: batched-bench, aiollama, llama-server in turn", flush=True)
    r["throughput"] = await contenders(bins, model, threads, levels, args.repeats)
    r["overhead"] = {str(n): r["throughput"]["aiollama"][str(n)]["python_overhead"] for n in levels if n in (1, 8, 32)}
    print("2. fairness", flush=True)
    r["fairness"] = {
        "long_prompt": sc.LONG_PROMPT,
        "aiollama": await sc.fairness_aiollama(model, threads, n_vocab, args.step_tokens),
        "llama_server": await sc.fairness_server(bins["llama-server"], model, threads, n_vocab),
    }
    print("3. fork", flush=True)
    r["fork"] = await sc.fork_scenario(model, threads, n_vocab)
    print("4. profile", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            r["profile"] = await sc.profile_decode_thread(model, threads, 8, n_vocab, Path(tmp) / "spy.txt")
        except (OSError, RuntimeError) as exc:
            print(f"   profile skipped: {exc}", flush=True)
            r["profile"] = []
    print("5. serialized baseline", flush=True)
    r["serialized"] = await sc.serialized_aiollama(model, threads, 8, n_vocab)
    if not args.no_fast:
        print("6. fast model", flush=True)
        r["fast"] = await fast_scenario(bins, threads, [1, 8] if args.quick else [1, 8, 32, 64], args.repeats)
    print("7. speculation", flush=True)
    r["speculation"] = {}
    for n in (1, 4):
        ours, batch = await sc.speculation_aiollama(model, threads, n, n_vocab)
        r["speculation"][str(n)] = {"aiollama": ours,
                                    "llama_server": await sc.speculation_server(bins["llama-server"], model, threads, n,
                                                                                batch)}
    print("8. split cache", flush=True)
    r["split"] = [await contenders(bins, model, threads, [8, 16] if args.quick else [8, 16, 32], args.repeats,
                                   unified=False)]
    if not args.no_fast:
        r["split"].append(await contenders(bins, fast_model.path(), threads, [8, 64] if args.quick else [8, 32, 64],
                                           args.repeats, unified=False))
    r["targets"] = targets(r)
    stem = f"{r['date']}-{platform.machine()}-{r['machine']['cpus']}cpu" + ("-quick" if args.quick else "")
    paths = report.write(r, Path(args.out), stem)
    print(report.markdown(r))
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0 if all(t["met"] for t in r["targets"]) or not args.strict else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF model (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--threads", type=int, help="threads for every contender (default: one per physical core)")
    parser.add_argument("--step-tokens", type=int, default=256, help="aiollama's per-step token budget")
    parser.add_argument("--quick", action="store_true", help="1 and 8 streams only")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per throughput measurement; the best counts (default 2)")
    parser.add_argument("--out", default=str(RESULTS), help="results folder")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--no-fast", action="store_true", help="skip the fast-model scenario")
    sys.exit(anyio.run(main, parser.parse_args()))
