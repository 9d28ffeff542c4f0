"""The disk tier's policy with a fake disk: a closed conversation's prefix is copied out to it; after
a restart a generation whose prefix is there waits unadmitted (while others run) until the read
arrives, then gets the state back; a bad read lets it evaluate its prompt."""

from __future__ import annotations

from collections.abc import Sequence

from test_scheduler import Harness

from aiollama.sched.kvtree import common_prefix
from aiollama.sched.scheduler import Scheduler
from aiollama.sched.step import DiskEntry, Restore

PROMPT = list(range(1, 41))


class FakeDisk:
    """States by (tokens, salt); reads arrive when the test says."""

    def __init__(self) -> None:
        self.files: dict[tuple[tuple[int, ...], str | None], bytes] = {}
        self.reads: list[DiskEntry] = []
        self._arrived: list[tuple[str, tuple[int, ...], str | None, bytes | None]] = []

    def has(self, tokens: Sequence[int], salt: str | None) -> bool:
        return (tuple(tokens), salt) in self.files

    def best(self, tokens: Sequence[int], limit: int, salt: str | None) -> tuple[DiskEntry | None, int]:
        found = [(min(common_prefix(list(t), list(tokens)), limit), t) for t, s in self.files if s == salt]
        n, best = max(found, default=(0, ()))
        return (None, 0) if not n else (DiskEntry(repr(best), best, salt, len(self.files[best, salt])), n)

    def write(self, tokens: Sequence[int], salt: str | None, data: bytes) -> None:
        self.files[tuple(tokens), salt] = data

    def read(self, entry: DiskEntry) -> None:
        self.reads.append(entry)

    def deliver(self, bad: bool = False) -> None:
        for e in self.reads:
            self._arrived.append((e.name, e.tokens, e.salt, None if bad else self.files[e.tokens, e.salt]))
        self.reads.clear()

    def arrivals(self) -> list[tuple[str, tuple[int, ...], str | None, bytes | None]]:
        arrived, self._arrived = self._arrived, []
        return arrived

    def clear(self) -> None:
        self.files.clear()


def harness(disk: FakeDisk) -> Harness:
    h = Harness(n_ctx=256, n_seq_max=4)
    h.sched = Scheduler(h.sched.config, disk=disk)
    return h


def closed_on_disk(disk: FakeDisk) -> Harness:
    """A conversation of ``PROMPT`` that generated 4 tokens and was closed: its prefix on ``disk``."""
    h = harness(disk)
    h.start(1, PROMPT, 4)
    h.run()
    h.sched.remove(1)
    h.step()  # the copy is made as the next step's operations run
    return h


def test_a_closed_prefix_is_copied_to_disk_once() -> None:
    disk = FakeDisk()
    h = closed_on_disk(disk)
    assert list(disk.files) == [(tuple(PROMPT + h.generated[1][:3]), None)]
    h.start(2, PROMPT + h.generated[1][:3], 2)  # the same history again: shared in memory, not read
    h.run()
    assert not disk.reads


def test_after_a_restart_the_prefix_comes_back_from_disk() -> None:
    disk = FakeDisk()
    closed_on_disk(disk)
    h = harness(disk)  # a new process: nothing in memory
    h.start(2, PROMPT + [77, 78], 3)
    h.start(3, [500 + i for i in range(10)], 3)
    plan = h.step()
    assert [e.tokens[:40] for e in disk.reads] == [tuple(PROMPT)]
    assert {s.conv for s in plan.slices} == {3}  # waits for the read; the other one runs
    h.step()
    disk.deliver()
    plan = h.step()
    assert any(isinstance(op, Restore) for op in plan.ops)
    h.run()
    assert h.sched.progress(2).cached_tokens >= len(PROMPT)
    assert h.sched.statistics().disk_loads == 1


def test_a_bad_read_evaluates_the_prompt() -> None:
    disk = FakeDisk()
    closed_on_disk(disk)
    h = harness(disk)
    h.start(2, PROMPT + [77], 2)
    h.step()
    disk.deliver(bad=True)
    h.run()
    assert h.sched.progress(2).cached_tokens == 0 and h.generated[2]
    assert h.sched.statistics().disk_loads == 0
