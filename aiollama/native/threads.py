"""How many CPUs this process may really use, and how many threads llama.cpp's compute gets.

llama.cpp defaults to 4 threads whatever the machine, and ignores cgroup quotas. ggml's workers
spin on barriers, so oversubscribing a small machine slows decoding by orders of magnitude.

The compute takes one thread per physical core, as llama.cpp's own tools do (``llama-server``'s
``--threads`` defaults to the count of distinct sets of thread siblings): two hardware threads of
one core share its arithmetic units, so the second adds little to a matrix product, and left free
it runs the event loop, the HTTP server and the constraint masks without stalling the decode's
threads at their barriers. On a CPU with performance and efficiency cores (Intel's hybrids), the
efficiency cores are left out too, as llama.cpp leaves them out: the threads of one decode advance
in lockstep, at the pace of the slowest.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection
from pathlib import Path

SYS = Path("/sys")


def _cgroup_quota(root: Path = SYS) -> float | None:
    """CPUs allowed by a cgroup CPU quota, or None when there is none."""
    try:
        quota, period = (root / "fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int((root / "fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if quota_us > 0 and period_us > 0:
            return quota_us / period_us
    except (OSError, ValueError):
        pass
    return None


def _allowed() -> Collection[int]:
    """The CPUs this process may run on (its affinity mask)."""
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # pragma: no cover - not on Linux
        return range(os.cpu_count() or 1)


def _capped(count: int, root: Path) -> int:
    quota = _cgroup_quota(root)
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    return max(1, count)


def available_cpus(root: Path = SYS, allowed: Collection[int] | None = None) -> int:
    """The CPUs this process may run on: its affinity mask, capped by any cgroup quota."""
    return _capped(len(_allowed() if allowed is None else allowed), root)


def _cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list (``0-3,8,10-11``)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _efficiency_cpus(root: Path) -> set[int]:
    """The efficiency cores of a hybrid CPU (none where the kernel shows no hybrid)."""
    if not (root / "devices/cpu_core/cpus").exists():
        return set()
    try:
        return _cpu_list((root / "devices/cpu_atom/cpus").read_text())
    except (OSError, ValueError):
        return set()


def math_cpus(root: Path = SYS, allowed: Collection[int] | None = None) -> int:
    """The default thread count of llama.cpp's compute: one per physical core among the CPUs this
    process may run on, efficiency cores left out unless there is nothing else (a CPU whose
    topology the kernel does not show counts as a core of its own), capped by any cgroup quota."""
    cpus = set(_allowed() if allowed is None else allowed)
    cpus = cpus - _efficiency_cpus(root) or cpus
    cores = set()
    for cpu in cpus:
        try:
            cores.add((root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(f"cpu{cpu}")
    return _capped(len(cores), root)
