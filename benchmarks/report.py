"""Writes the results: JSON (everything), a markdown table (the README's), a PNG plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _f(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def _contenders_table(section: dict[str, Any]) -> list[str]:
    rows = ["| streams | aiollama decode | batched-bench S_TG | llama-server decode | aiollama / S_TG | aiollama / server |",
            "|---:|---:|---:|---:|---:|---:|"]
    for n in section["levels"]:
        a = section["aiollama"].get(str(n), {}).get("decode_tps")
        b = section["batched_bench"].get(str(n), {}).get("s_tg")
        sv = section["llama_server"].get(str(n), {}).get("decode_tps")
        rows.append(f"| {n} | {_f(a)} | {_f(b)} | {_f(sv)} | {_f(a / b if a and b else None, 2)} "
                    f"| {_f(a / sv if a and sv else None, 2)} |")
    return rows


def markdown(r: dict[str, Any]) -> str:
    t = r["targets"]
    lines = [
        f"Measured {r['date']} on {r['machine']['cpu']} ({r['machine']['cpus']} CPUs), llama.cpp {r['llama_cpp']}, "
        f"model {r['model']}, {r['threads']} threads for every contender.",
        "",
        f"**1. Throughput** (generated tokens/s, 64-token prompts, 128 new tokens each, EOG ignored; "
        f"decode phase = after every stream has its first token; best of {r.get('repeats', 1)} runs each)",
        "",
        "| streams | aiollama decode | aiollama end-to-end | batched-bench S_TG | llama-server decode "
        "| llama-server end-to-end | aiollama / S_TG | aiollama / server |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in r["levels"]:
        a = r["throughput"]["aiollama"].get(str(n), {})
        b = r["throughput"]["batched_bench"].get(str(n), {})
        s = r["throughput"]["llama_server"].get(str(n), {})
        ratio_b = a.get("decode_tps", math.nan) / b["s_tg"] if b else math.nan
        ratio_s = a.get("decode_tps", math.nan) / s["decode_tps"] if s else math.nan
        lines.append(f"| {n} | {_f(a.get('decode_tps'))} | {_f(a.get('end_to_end_tps'))} | {_f(b.get('s_tg'))} "
                     f"| {_f(s.get('decode_tps'))} | {_f(s.get('end_to_end_tps'))} | {_f(ratio_b, 2)} | {_f(ratio_s, 2)} |")
    f = r["fairness"]
    lines += [
        "",
        f"**2. Fairness** (7 streams running, a {f['long_prompt']}-token prompt joins; gaps between tokens of "
        "the 7 while it is processed)",
        "",
        "| | prompt time (s) | median gap (ms) | p99 gap (ms) | max gap (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("aiollama", "llama_server"):
        g = f[name]
        d = g["gaps_during_prompt"]
        lines.append(f"| {name} | {_f(g['prompt_seconds'], 2)} | {_f(d['median_ms'])} | {_f(d['p99_ms'])} "
                     f"| {_f(d['max_ms'])} |")
    k = r["fork"]
    lines += [
        "",
        "**3. Fork** (8 continuations of 32 tokens from one 1,000-token prefix)",
        "",
        "| | prompt tokens evaluated | time to all 8 first tokens (s) | peak KV cells |",
        "|---|---:|---:|---:|",
    ]
    for mode, row in k.items():
        lines.append(f"| {mode.replace('_', ' ')} | {row['prompt_tokens_evaluated']} "
                     f"| {_f(row['seconds_to_all_first_tokens'], 2)} | {row['peak_kv_cells']} |")
    lines += [
        "",
        "**4. Python overhead** (share of step time outside `llama_decode`): "
        + ", ".join(f"{n} streams {_f(100 * v, 1)}%" for n, v in r["overhead"].items()),
        "",
    ]
    if r.get("profile"):
        lines.append("Hottest decode-thread frames outside `llama_decode` (share of samples): "
                     + "; ".join(f"`{h['frame']}` {_f(100 * h['share'], 1)}%" for h in r["profile"][:8]))
        lines.append("")
    s5 = r["serialized"]
    lines += [
        f"**5. Serialized baseline** ({s5['n']} requests one at a time, as behind a global lock): "
        f"{_f(s5['serialized_tps'])} tokens/s, against {_f(s5['batched_tps'])} batched: "
        f"batching buys {_f(s5['speedup'], 2)}×.",
        "",
    ]
    fast = r.get("fast")
    if fast:
        shape = fast["shape"]
        lines += [
            f"**6. A fast model** (random weights, width {shape['n_embd']}, {shape['n_layer']} layers, SmolLM2's "
            "vocabulary: short steps, where per-step overhead shows as on a GPU; same prompts and tokens as 1)",
            "",
            *_contenders_table(fast),
            "",
        ]
    spec = r.get("speculation")
    if spec:
        lines += [
            "**7. Speculation** (greedy chat copying a 90-word text back, at most 192 tokens; decode tokens/s; "
            "aiollama's n-gram drafts of up to 8 tokens against llama-server's `--spec-type ngram-simple "
            "--spec-draft-n-max 8`)",
            "",
            "| streams | aiollama | aiollama, drafts | gain | steps | same text | llama-server | llama-server, ngram "
            "| gain |",
            "|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        ]
        for n, row in spec.items():
            a, s_ = row["aiollama"], row["llama_server"]
            plain, drafted = a["draft_0"], a[[k for k in a if k.startswith("draft_") and k != "draft_0"][0]]
            lines.append(
                f"| {n} | {_f(plain['decode_tps'])} | {_f(drafted['decode_tps'])} "
                f"| {_f(drafted['decode_tps'] / plain['decode_tps'], 2)}× | {plain['decode_steps']} → "
                f"{drafted['decode_steps']} | {'yes' if a['identical'] else 'no'} | {_f(s_['none']['decode_tps'])} "
                f"| {_f(s_['ngram']['decode_tps'])} | {_f(s_['ngram']['decode_tps'] / s_['none']['decode_tps'], 2)}× |")
        lines.append("")
    for section in r.get("split", []):
        lines += [
            f"**8. A split cache, {section['model']}** (each stream its share of the KV cache: aiollama "
            "`kv_unified=False`, batched-bench and llama-server without `-kvu`, the server's default; same "
            "prompts and tokens as 1)",
            "",
            *_contenders_table(section),
            "",
        ]
    lines += [
        "**Targets**",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    for row in t:
        lines.append(f"| {row['target']} | {row['measured']} | {'yes' if row['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = r["levels"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    series = [
        ("aiollama (decode phase)", [r["throughput"]["aiollama"].get(str(n), {}).get("decode_tps") for n in levels], "o-"),
        ("llama-batched-bench S_TG", [r["throughput"]["batched_bench"].get(str(n), {}).get("s_tg") for n in levels], "s--"),
        ("llama-server -kvu (decode phase)",
         [r["throughput"]["llama_server"].get(str(n), {}).get("decode_tps") for n in levels], "^:"),
    ]
    for label, ys, style in series:
        pts = [(n, y) for n, y in zip(levels, ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels)
    ax.set_xticklabels([str(n) for n in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{r['model']} on {r['machine']['cpus']} CPUs, {r['threads']} threads each")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(r: dict[str, Any], out_dir: Path, stem: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md", "png": out_dir / f"{stem}.png"}
    paths["json"].write_text(json.dumps(r, indent=2, sort_keys=True) + "\n")
    paths["md"].write_text(markdown(r))
    plot(r, paths["png"])
    return paths
