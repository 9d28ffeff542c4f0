"""What replicas would give, estimated from one replica's measured figures: a 2-core machine cannot
show scaling, so this simulates it.

    python benchmarks/replicas.py [--results benchmarks/results/<run>.json]     # seconds

A workload of multi-turn chats (64 conversations of 6 turns: a 400-token system prompt of their own,
40-token questions, 128-token replies) is routed over R replicas, each with room for ``--cache``
tokens of prefixes (least recently used go first), by two policies:

- affinity: :class:`aiollama.ray.PrefixAffinityRouter`'s rule (a conversation goes back to the
  replica that served its previous turn unless that one is ``imbalance`` requests busier than the
  least loaded; otherwise the least loaded);
- load only: Ray Serve's default (the less loaded of two random replicas), which knows no prefixes.

Each request evaluates what its replica's cache does not hold, then generates its reply. The time a
replica needs is its prompt tokens at the measured prompt rate plus its generated tokens at the
measured decode rate for the streams it runs at once (run.py's throughput table, interpolated);
each replica is taken to run on a machine of its own, like the one measured. Results go to
benchmarks/results/<date>-<machine>-replicas.{json,md}.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import random
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, machine, save_results  # noqa: E402

CONVERSATIONS, TURNS, SYSTEM, QUESTION, REPLY = 64, 6, 400, 40, 128
REPLICAS = (1, 2, 4, 8)


class Replica:
    def __init__(self, cache_tokens: int) -> None:
        self.cache: OrderedDict[int, int] = OrderedDict()  # conversation -> tokens of it held
        self.capacity = cache_tokens
        self.load = 0  # requests routed in the current round
        self.evaluated = self.generated = self.requests = 0

    def serve(self, conv: int, history: int, prompt: int) -> int:
        """Serve one turn; returns the prompt tokens found in the cache."""
        cached = min(self.cache.pop(conv, 0), prompt - 1)
        self.evaluated += prompt - cached
        self.generated += REPLY
        self.requests += 1
        self.cache[conv] = prompt + REPLY
        while sum(self.cache.values()) > self.capacity and len(self.cache) > 1:
            self.cache.popitem(last=False)
        return cached


def simulate(n_replicas: int, policy: str, cache_tokens: int, imbalance: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    replicas = [Replica(cache_tokens) for _ in range(n_replicas)]
    owner: dict[int, int] = {}
    history = dict.fromkeys(range(CONVERSATIONS), 0)
    prompt_total = cached_total = 0
    for _turn in range(TURNS):
        for r in replicas:
            r.load = 0
        order = list(range(CONVERSATIONS))
        rng.shuffle(order)  # the turns of one round arrive in any order, all at about the same time
        for conv in order:
            prompt = (history[conv] or SYSTEM) + QUESTION
            least = min(replicas, key=lambda r: (r.load, rng.random()))
            if policy == "affinity":
                mine = replicas[owner[conv]] if conv in owner else None
                chosen = mine if mine is not None and mine.load - least.load <= imbalance else least
            else:
                a, b = rng.sample(replicas, 2) if n_replicas > 1 else (replicas[0], replicas[0])
                chosen = a if a.load <= b.load else b
            chosen.load += 1
            owner[conv] = replicas.index(chosen)
            cached_total += chosen.serve(conv, history[conv], prompt)
            prompt_total += prompt
            history[conv] = prompt + REPLY
    return {"replicas": replicas, "hit_rate": cached_total / prompt_total, "prompt_tokens": prompt_total}


def decode_rate(table: dict[int, float], streams: float) -> float:
    """Aggregate decode tokens/s of one replica running ``streams`` at once (linear in between)."""
    levels = sorted(table)
    if streams <= levels[0]:
        return table[levels[0]] * streams / levels[0]
    if streams >= levels[-1]:
        return table[levels[-1]]
    i = bisect.bisect_left(levels, streams)
    lo, hi = levels[i - 1], levels[i]
    return table[lo] + (table[hi] - table[lo]) * (streams - lo) / (hi - lo)


def estimate(run: dict[str, Any], prompt_tps: float, cache_tokens: int, imbalance: int) -> list[dict[str, Any]]:
    table = {int(n): v["decode_tps"] for n, v in run["throughput"]["aiollama"].items()}
    rows = []
    for n in REPLICAS:
        row: dict[str, Any] = {"replicas": n}
        for policy in ("affinity", "load"):
            sim = simulate(n, policy, cache_tokens, imbalance, seed=n)
            per_replica = CONVERSATIONS / n
            seconds = max(r.evaluated / prompt_tps + r.generated / decode_rate(table, per_replica)
                          for r in sim["replicas"])
            generated = sum(r.generated for r in sim["replicas"])
            row[policy] = {"hit_rate": sim["hit_rate"], "tokens_per_s": generated / seconds,
                           "evaluated": sum(r.evaluated for r in sim["replicas"])}
        rows.append(row)
    return rows


def markdown(r: dict[str, Any]) -> str:
    lines = [f"Estimated {r['date']} from `{r['source']}` (decode rates by concurrency) and a prompt rate of "
             f"{r['prompt_tps']:.0f} tokens/s, one replica per machine like the one measured; {CONVERSATIONS} "
             f"conversations x {TURNS} turns, {SYSTEM}-token system prompts, {QUESTION}-token questions, "
             f"{REPLY}-token replies, {r['cache_tokens']} tokens of prefix cache per replica.\n",
             "| replicas | tokens/s, affinity | tokens/s, load only | cache hits, affinity | cache hits, load only | "
             "prompt tokens evaluated, affinity | load only |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        a, b = row["affinity"], row["load"]
        lines.append(f"| {row['replicas']} | {a['tokens_per_s']:.0f} | {b['tokens_per_s']:.0f} | {a['hit_rate']:.0%} | "
                     f"{b['hit_rate']:.0%} | {a['evaluated']} | {b['evaluated']} |")
    return "\n".join(lines) + "\n"


def latest_run() -> Path:
    runs = sorted(RESULTS.glob("20*cpu.json"))
    if not runs:
        raise SystemExit("no benchmarks/results/<date>-<machine>.json: run benchmarks/run.py first")
    return runs[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=None, help="a run.py results file (default: the latest)")
    parser.add_argument("--prompt-tps", type=float, default=None,
                        help="prompt evaluation tokens/s (default: from the results' fork scenario)")
    parser.add_argument("--cache", type=int, default=60_000, help="prefix-cache tokens per replica")
    parser.add_argument("--imbalance", type=int, default=8)
    args = parser.parse_args()
    source = args.results or latest_run()
    run = json.loads(source.read_text())
    prompt_tps = args.prompt_tps
    if prompt_tps is None:
        fork = run["fork"]["independent_distinct"]
        prompt_tps = fork["prompt_tokens_evaluated"] / fork["seconds_to_all_first_tokens"]
    r: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(), "source": source.name,
                         "prompt_tps": prompt_tps, "cache_tokens": args.cache,
                         "rows": estimate(run, prompt_tps, args.cache, args.imbalance)}
    save_results(r, "replicas", markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
