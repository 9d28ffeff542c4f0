"""The scheduler's layer, pure Python (neither llama.cpp nor an event loop): each step's plan and
result as plain data (``step``), the policy that makes the plan (``scheduler`` and the small
policies it calls), and the mechanism under it: seq ids, the cells of a unified cache as a radix
tree of cached prefixes, host memory (``kvcache``, ``kvtree``, ``hostcache``)."""
