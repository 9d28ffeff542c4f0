"""The scheduler's layer, pure Python (neither llama.cpp nor an event loop): each step's plan and
result as plain data (``step``), the policy that makes the plan (``scheduler``, ``planner`` and the
small policies they call), and the mechanism under it: seq ids, the cells of a unified cache as a
radix tree of cached prefixes, host memory (``kvcache``, ``kvtree``, ``hostcache``).

This package's namespace is the scheduler's face: the decode thread imports it and the step types
(``aiollama.sched.step``), nothing else of the layer."""

from aiollama.sched.hostcache import TokenTrie
from aiollama.sched.scheduler import Scheduler
from aiollama.sched.views import Held, Progress, SchedulerConfig, SchedulerStats

__all__ = ["Held", "Progress", "Scheduler", "SchedulerConfig", "SchedulerStats", "TokenTrie"]
