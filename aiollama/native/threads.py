"""How many CPUs this process may really use.

llama.cpp defaults to 4 threads whatever the machine, and ignores cgroup quotas. ggml's workers
spin on barriers, so oversubscribing a small machine slows decoding by orders of magnitude.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def _cgroup_quota() -> float | None:
    """CPUs allowed by a cgroup CPU quota, or None when there is none."""
    v2 = Path("/sys/fs/cgroup/cpu.max")
    try:
        quota, period = v2.read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if quota_us > 0 and period_us > 0:
            return quota_us / period_us
    except (OSError, ValueError):
        pass
    return None


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, capped by any cgroup quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        count = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    return max(1, count)
