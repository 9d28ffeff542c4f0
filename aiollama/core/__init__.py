"""The decode thread: commands in (``commands``), one step at a time (``core``: schedule, execute,
update), deltas out (``generations``, ``outbox``, ``outputs``), and the thread itself (``loop``).
It reaches llama.cpp only through the Executor interface of ``aiollama.sched.step`` and imports no
event loop library."""
