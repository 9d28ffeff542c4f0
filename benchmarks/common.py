"""Shared pieces of the benchmarks: prompts, stream timings, percentiles, machine facts."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def prompts(n: int, length: int, n_vocab: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids; distinct after the first ``shared_prefix`` tokens.

    Random ids in the ordinary part of the vocabulary stand in for text: every contender sees
    the same ids, and prompts that differ from their first token share no cache.
    """
    rng = random.Random(seed)
    lo, hi = 300, min(n_vocab, 40000) - 1
    prefix = [rng.randint(lo, hi) for _ in range(shared_prefix)]
    return [prefix + [rng.randint(lo, hi) for _ in range(length - shared_prefix)] for _ in range(n)]


@dataclass
class StreamTiming:
    """When one stream started and when each of its tokens arrived (perf_counter seconds)."""

    start: float
    arrivals: list[float] = field(default_factory=list)

    @property
    def first(self) -> float:
        return self.arrivals[0]

    def gaps(self, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:]) if since <= b <= until]


Rate = Callable[[], Awaitable[tuple[float, float]]]  # a run: (tokens/s, the share of drafts taken)


async def back_to_back(rounds: int, base: Rate, variant: Rate) -> tuple[list[float], list[float], float]:
    """``rounds`` pairs run back to back, ``base`` just before ``variant``, so that the machine's
    drift falls on both alike: each pair's ratio of the variant's tokens/s to the base's, the base's
    tokens/s, and the last variant run's share of drafts taken."""
    ratios: list[float] = []
    bases: list[float] = []
    taken = 0.0
    for _ in range(rounds):
        before, _ = await base()
        after, taken = await variant()
        ratios.append(after / before)
        bases.append(before)
    return ratios, bases, taken


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user and system) each thread of process ``pid`` has used so far, by thread
    id; empty where /proc cannot tell (not Linux, or the process is gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def throughput(timings: list[StreamTiming]) -> dict[str, float]:
    """Aggregate tokens/s: end to end, and in the decode phase (after every stream's first token)."""
    start = min(t.start for t in timings)
    end = max(t.arrivals[-1] for t in timings)
    total = sum(len(t.arrivals) for t in timings)
    decode_from = max(t.first for t in timings)
    decode_tokens = sum(sum(1 for a in t.arrivals if a > decode_from) for t in timings)
    return {
        "tokens": total,
        "seconds": end - start,
        "end_to_end_tps": total / (end - start),
        "decode_tps": decode_tokens / (end - decode_from) if end > decode_from else float("nan"),
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def gap_summary(gaps: list[float]) -> dict[str, float]:
    return {
        "n": len(gaps),
        "median_ms": 1000 * statistics.median(gaps) if gaps else float("nan"),
        "p99_ms": 1000 * percentile(gaps, 0.99),
        "max_ms": 1000 * max(gaps) if gaps else float("nan"),
    }


def machine() -> dict[str, object]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = float("nan")
    gpu = ""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gb": round(mem_gb, 1),
        "gpu": gpu,
        "python": platform.python_version(),
    }


def save_results(r: dict[str, Any], scenario: str, text: str, stem: str | None = None) -> str:
    """Write ``r`` and its markdown ``text`` to results/<date>-<machine>-<cpus>cpu-<scenario>.{json,md}
    (with -2, -3, ... after it where a run of the day has those names: results are never
    overwritten) and print the text; return the stem written. ``stem``: the one an earlier call of
    the same run returned, whose partial results these replace."""
    if stem is None:
        base = f"{r['date']}-{platform.machine()}-{r['machine']['cpus']}cpu-{scenario}"
        stem, n = base, 1
        while (RESULTS / f"{stem}.json").exists() or (RESULTS / f"{stem}.md").exists():
            n += 1
            stem = f"{base}-{n}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(r, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(text)
    print(text)
    return stem
