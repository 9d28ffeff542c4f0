"""What a restart costs a long shared prefix: the time to first token of the same request before and
after the server restarts, with the disk tier (``--cache-dir``), without it, and with llama-server
of the same llama.cpp tag saving and restoring its slot by hand (``--slot-save-path``,
``/slots/0?action=save|restore``).

    pip install ".[bench]" && python benchmarks/restart.py            # a few minutes on 2 CPUs

Each prefix length: round 1 sends a request (the prefix, then a question) to a fresh server and
stops it; round 2 starts a new server process and sends the same request. Greedy tokens of every
round 2 must equal round 1's (a fresh evaluation), or the run fails. The disk's bytes per 1,000
tokens are the directory's size over the tokens it holds the state of.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import machine, prompts, save_results  # noqa: E402
from server import AiollamaServer, LlamaServer  # noqa: E402
from tools import build  # noqa: E402

import aiollama  # noqa: E402

N_PREDICT = 16
QUESTION = 24  # tokens after the shared prefix


def ask(url: str, prompt: list[int], **extra: Any) -> tuple[float, list[int]]:
    """A streamed greedy /completion: the seconds to its first token, and its tokens."""
    body = {"prompt": prompt, "n_predict": N_PREDICT, "stream": True, "temperature": 0.0, "ignore_eos": True,
            "cache_prompt": True, "return_tokens": True, **extra}
    started, first, got = time.perf_counter(), None, []
    with httpx.stream("POST", url + "/completion", json=body, timeout=None) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("tokens") and first is None:
                first = time.perf_counter() - started
            got += event.get("tokens") or []
            if event.get("stop"):
                break
    assert first is not None
    return first, got


def aiollama_rounds(model: Path, prompt: list[int], n_ctx: int, threads: int, disk: Path | None) -> dict[str, Any]:
    extra = () if disk is None else ("--cache-dir", str(disk))
    rounds = []
    for _ in range(2):
        with AiollamaServer(model, n_seq_max=2, n_ctx=n_ctx, threads=threads, extra=extra) as server:
            rounds.append(ask(server.url, prompt))
    out: dict[str, Any] = {"ttft_round1_s": rounds[0][0], "ttft_round2_s": rounds[1][0],
                           "same_tokens": rounds[0][1] == rounds[1][1], "tokens": rounds[0][1]}
    if disk is not None:
        out["disk_bytes"] = sum(p.stat().st_size for p in disk.iterdir())
    return out


def llama_server_rounds(binary: Path, model: Path, prompt: list[int], n_ctx: int, threads: int,
                        slots: Path) -> dict[str, Any]:
    """Round 1, then the slot saved by hand; round 2 restores it by hand before the request."""
    def server() -> LlamaServer:
        s = LlamaServer(binary, model, n_parallel=1, n_ctx=n_ctx, threads=threads)
        s.cmd += ["--slot-save-path", str(slots) + "/"]
        return s

    with server() as s:
        ttft1, tokens1 = ask(s.url, prompt, id_slot=0)
        httpx.post(s.url + "/slots/0?action=save", json={"filename": "prefix.bin"}, timeout=120).raise_for_status()
    with server() as s:
        started = time.perf_counter()
        httpx.post(s.url + "/slots/0?action=restore", json={"filename": "prefix.bin"}, timeout=120).raise_for_status()
        restore = time.perf_counter() - started
        ttft2, tokens2 = ask(s.url, prompt, id_slot=0)
    return {"ttft_round1_s": ttft1, "restore_s": restore, "ttft_round2_s": ttft2,
            "ttft_round2_with_restore_s": restore + ttft2, "same_tokens": tokens1 == tokens2, "tokens": tokens1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2000,4000,8000", help="shared prefix lengths, tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llama-server", action="store_true")
    args = parser.parse_args()
    model = aiollama.pull()
    binary = None if args.no_llama_server else build()["llama-server"]
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        prompt = prompts(1, length + QUESTION, 49152, seed=length, shared_prefix=length)[0]
        n_ctx = length + QUESTION + N_PREDICT + 256
        with tempfile.TemporaryDirectory() as tmp:
            disk = aiollama_rounds(model, prompt, n_ctx, args.threads, Path(tmp))
        plain = aiollama_rounds(model, prompt, n_ctx, args.threads, None)
        row: dict[str, Any] = {"prefix_tokens": length, "disk": disk, "no_disk": plain}
        if binary is not None:
            with tempfile.TemporaryDirectory() as tmp:
                row["llama_server"] = llama_server_rounds(binary, model, prompt, n_ctx, args.threads, Path(tmp))
        same = [disk["tokens"] == plain["tokens"], disk["same_tokens"], plain["same_tokens"]]
        if "llama_server" in row:
            same.append(row["llama_server"]["same_tokens"])
        row["greedy_identical"] = all(same)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}, default=str)[:400], flush=True)
    r = {"date": datetime.date.today().isoformat(), "machine": machine(), "model": model.name, "rows": rows}
    lines = [f"# Restart: a long prefix before and after the server restarts ({r['date']})", "",
             f"{model.name}, {args.threads} threads, {N_PREDICT} greedy tokens, {QUESTION} tokens after the prefix. "
             "TTFT in seconds; round 2 is a new server process.", "",
             "| prefix | round 1 (fresh) | round 2, disk tier | round 2, no disk tier | disk / no disk "
             "| llama-server restore + TTFT | disk MB per 1k tokens | greedy identical |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        d, p, ls = row["disk"], row["no_disk"], row.get("llama_server")
        held = row["prefix_tokens"] + QUESTION + N_PREDICT - 1
        lines.append(f"| {row['prefix_tokens']} | {d['ttft_round1_s']:.3f} | {d['ttft_round2_s']:.3f} | "
                     f"{p['ttft_round2_s']:.3f} | {d['ttft_round2_s'] / p['ttft_round2_s']:.3f}x | "
                     + (f"{ls['restore_s']:.3f} + {ls['ttft_round2_s']:.3f} | " if ls else "- | ")
                     + f"{d['disk_bytes'] / held * 1000 / 1e6:.1f} | {row['greedy_identical']} |")
    save_results(r, "restart", "\n".join(lines) + "\n")
    return 0 if all(row["greedy_identical"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
