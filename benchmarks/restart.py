"""What a restart costs a long shared prefix: the time to first token of the same request before and
after the server restarts, with the disk tier (``--cache-dir``), without it, and with llama-server
of the same llama.cpp tag saving and restoring its slot by hand (``--slot-save-path``,
``/slots/0?action=save|restore``).

    pip install ".[bench]" && python benchmarks/restart.py            # a few minutes on 2 CPUs

Each prefix length: round 1 sends a request (the prefix, then a question) to a fresh server, then
the same again (a hit in the in-memory prefix cache), and stops it; round 2 starts a new server
process and sends the same request. The run fails unless round 2's greedy tokens equal the
in-memory hit's with the disk tier, and round 1's fresh evaluation in the deterministic mode
(``--deterministic``: logits independent of batch shapes) and without the disk tier. By default
llama.cpp's CPU kernels are not batch-invariant: a hit evaluates the prompt's last token alone, not
inside its chunk, and at a near tie may continue otherwise than a fresh evaluation (llama-server's
slot restore alike). The disk's bytes per 1,000 tokens are a file's size over the tokens it holds
the state of.
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


def aiollama_rounds(model: Path, prompt: list[int], n_ctx: int, threads: int, disk: Path | None,
                    *flags: str) -> dict[str, Any]:
    """Round 1 asks twice (fresh, then a hit in the in-memory prefix cache); round 2 once, in a new process."""
    extra = flags if disk is None else (*flags, "--cache-dir", str(disk))
    asked = []
    for requests in (2, 1):
        # serve's --n-ctx is shared by its --n-seq-max streams, as llama-server's -c by its slots
        with AiollamaServer(model, n_seq_max=2, n_ctx=2 * n_ctx, threads=threads, extra=extra) as server:
            asked += [ask(server.url, prompt) for _ in range(requests)]
    (ttft1, fresh), (_, warm), (ttft2, again) = asked
    out: dict[str, Any] = {"ttft_round1_s": ttft1, "ttft_round2_s": ttft2, "tokens": fresh,
                           "round2_as_fresh": again == fresh, "round2_as_memory_hit": again == warm}
    if disk is not None:
        sizes = [p.stat().st_size for p in disk.iterdir()]
        out["disk_bytes"], out["disk_files"] = sum(sizes), len(sizes)  # two when round 2 answered otherwise
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
        with tempfile.TemporaryDirectory() as tmp:
            exact = aiollama_rounds(model, prompt, n_ctx, args.threads, Path(tmp), "--deterministic", "-kvu")
        plain = aiollama_rounds(model, prompt, n_ctx, args.threads, None)
        row: dict[str, Any] = {"prefix_tokens": length, "disk": disk, "disk_deterministic": exact, "no_disk": plain}
        if binary is not None:
            with tempfile.TemporaryDirectory() as tmp:
                row["llama_server"] = llama_server_rounds(binary, model, prompt, n_ctx, args.threads, Path(tmp))
        # what must hold: a state from disk continues as the same state in memory does, and in the
        # deterministic mode as a fresh evaluation does
        row["ok"] = disk["round2_as_memory_hit"] and exact["round2_as_fresh"] and plain["round2_as_fresh"]
        rows.append(row)
        print(json.dumps(row, default=str)[:600], flush=True)
    r = {"date": datetime.date.today().isoformat(), "machine": machine(), "model": model.name, "rows": rows}
    lines = [f"# Restart: a long prefix before and after the server restarts ({r['date']})", "",
             f"{model.name}, {args.threads} threads, {N_PREDICT} greedy tokens, {QUESTION} tokens after the prefix. "
             "Time to first token in seconds; round 2 is the same request to a new server process. Greedy "
             "tokens of round 2: as the in-memory prefix cache's hit in round 1 (default mode), as round 1's "
             "fresh evaluation (deterministic mode, and without a disk tier), and llama-server's after its "
             "slot restore as its round 1.", "",
             "| prefix | round 1 (fresh) | round 2, disk tier | round 2, no disk tier | disk / no disk "
             "| deterministic: round 1, round 2 | llama-server: round 1, restore + round 2 | disk MB per 1k tokens "
             "| tokens: disk as memory hit, as fresh; deterministic as fresh; llama-server as fresh |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        d, e, p, ls = row["disk"], row["disk_deterministic"], row["no_disk"], row.get("llama_server")
        held = row["prefix_tokens"] + QUESTION + N_PREDICT - 1
        lines.append(f"| {row['prefix_tokens']} | {d['ttft_round1_s']:.3f} | {d['ttft_round2_s']:.3f} | "
                     f"{p['ttft_round2_s']:.3f} | {d['ttft_round2_s'] / p['ttft_round2_s']:.3f}x | "
                     f"{e['ttft_round1_s']:.3f}, {e['ttft_round2_s']:.3f} | "
                     + (f"{ls['ttft_round1_s']:.3f}, {ls['restore_s']:.3f} + {ls['ttft_round2_s']:.3f} | " if ls else "- | ")
                     + f"{d['disk_bytes'] / d['disk_files'] / held * 1000 / 1e6:.2f} | "
                     f"{d['round2_as_memory_hit']}, {d['round2_as_fresh']}; "
                     f"{e['round2_as_fresh']}; {ls['same_tokens'] if ls else '-'} |")
    save_results(r, "restart", "\n".join(lines) + "\n")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
