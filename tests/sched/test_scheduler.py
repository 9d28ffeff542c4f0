"""The scheduler with a fake KV cache and a fake decoder: no model, no cffi, no anyio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fake_kv import FakeKV

from aiollama.errors import ContextFull, InvalidRequestError
from aiollama.sched.kvcache import MIN_PARK_TOKENS
from aiollama.sched.scheduler import MIN_PREFILL_CHUNK, Scheduler, SchedulerConfig, common_prefix
from aiollama.sched.sequence import Phase
from aiollama.sched.step import Compact, Copy, Plan, Sampled, StepResult, StepStatus


class Harness:
    """Runs the scheduler against the fake KV; every sampled token is 1000 + step."""

    def __init__(self, n_ctx: int = 256, n_seq_max: int = 4, n_batch: int = 64, step_tokens: int = 32,
                 max_running: int | None = None, host_bytes: int = 0, ordered: bool = False,
                 kv_unified: bool = False) -> None:
        self.sched = Scheduler(SchedulerConfig(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch, step_tokens=step_tokens,
                                               max_running=max_running, host_bytes=host_bytes, ordered=ordered,
                                               kv_unified=kv_unified))
        self.kv = FakeKV(n_ctx, n_seq_max, ordered=ordered)
        self.generated: dict[int, list[int]] = {}
        self.limit: dict[int, int] = {}
        self.plans: list[Plan] = []

    def start(self, conv: int, tokens: list[int] | None, n_new: int) -> None:
        if tokens is not None:
            self.sched.add(conv, tokens)
        self.generated[conv] = []
        self.limit[conv] = n_new
        self.sched.submit(conv)

    def step(self) -> Plan:
        plan = self.sched.schedule()
        self.plans.append(plan)
        applied = self.kv.apply(plan.ops)
        assert plan.n_tokens <= self.sched.config.n_batch
        assert self.kv.decode(plan), "the plan did not fit the KV cache"
        token = 1000 + len(self.plans)
        sampled = tuple(Sampled(s.conv, token, b"", False) for s in plan.slices if s.logits)
        self.sched.update(plan, StepResult(StepStatus.OK, sampled, **applied))
        for s in sampled:
            self.generated[s.conv].append(token)
            if len(self.generated[s.conv]) >= self.limit[s.conv]:
                self.sched.finish(s.conv)
        self.check()
        return plan

    def check(self) -> None:
        assert self.kv.used == self.sched._kv.cells.used
        assert self.kv.tombstones == self.sched._kv.holes
        ids = [s.seq_id for s in self.sched.sequences() if s.seq_id is not None]
        assert len(ids) == len(set(ids))
        for seq in self.sched.sequences():
            if seq.seq_id is not None:
                assert self.kv.positions(seq.seq_id) == list(range(seq.n_cached))
                assert self.kv.tokens(seq.seq_id) == seq.tokens[:seq.n_cached]

    def run(self, max_steps: int = 1000) -> int:
        n = 0
        while self.sched.busy:
            self.step()
            n += 1
            assert n < max_steps, "the scheduler stopped making progress"
        return n


def test_decode_rows_go_first_and_prompts_are_chunked() -> None:
    h = Harness(step_tokens=16)
    h.start(1, list(range(1, 6)), 50)
    h.step()  # prompt of 5 fits in one chunk
    h.step()
    h.start(2, list(range(100, 200)), 5)  # a long prompt joins
    for _ in range(5):
        plan = h.step()
        assert plan.slices[0].conv == 1 and len(plan.slices[0].tokens) == 1  # the stream keeps going
        assert plan.n_tokens <= max(16, 1 + MIN_PREFILL_CHUNK)
    assert h.sched.get(2).n_cached > 0


def test_round_robin_between_prompts() -> None:
    h = Harness(step_tokens=16)
    h.start(1, list(range(1, 100)), 1)
    h.start(2, list(range(200, 300)), 1)
    first, second, third = h.step(), h.step(), h.step()
    # the whole budget goes to one prompt per step, taking turns
    assert [(s.conv, s.pos, len(s.tokens)) for s in first.slices] == [(1, 0, 16)]
    assert [(s.conv, s.pos, len(s.tokens)) for s in second.slices] == [(2, 0, 16)]
    assert [(s.conv, s.pos, len(s.tokens)) for s in third.slices] == [(1, 16, 16)]


def test_fork_shares_the_prefix() -> None:
    h = Harness(n_ctx=512)
    h.start(1, list(range(1, 101)), 1)
    h.run()
    used = h.sched._kv.cells.used
    for child in (2, 3, 4):
        h.sched.fork(1, child)
        h.start(child, None, 10)
    h.run()
    assert any(isinstance(op, Copy) for plan in h.plans for op in plan.ops)
    # three continuations of ~10 tokens; the 100-token prefix is not copied
    assert h.sched._kv.cells.used <= used + 3 * 11


def test_followers_wait_for_the_leader_instead_of_evaluating_twice() -> None:
    h = Harness(n_ctx=1024, n_batch=64, step_tokens=64)
    prefix = list(range(1, 301))
    for conv in range(4):
        h.start(conv, prefix + [5000 + conv], 3)
    h.run()
    evaluated = sum(p.n_tokens for p in h.plans)
    assert evaluated < len(prefix) + 4 * 10
    # what a follower took from its leader counts as cached for it, as the server's usage reports
    for conv in range(1, 4):
        seq = h.sched.get(conv)
        assert (seq.prompt_tokens, seq.cached_tokens) == (len(prefix) + 1, len(prefix))
    assert h.sched.statistics().cache_hit_tokens == 3 * len(prefix)


def test_idle_conversations_are_evicted_lru_for_seq_ids() -> None:
    h = Harness(n_seq_max=2)
    for conv in (1, 2):
        h.start(conv, [conv, conv + 10], 2)
    h.run()
    assert h.sched._kv.n_holders == 2  # both idle, both cached
    h.sched.append(1, [7])  # conversation 1 was used more recently
    h.start(3, [3, 30], 2)
    h.run()
    assert h.sched.get(2).seq_id is None and h.sched.get(1).seq_id is not None
    h.start(2, None, 2)  # evicted: re-evaluated transparently
    h.run()
    assert len(h.generated[2]) == 2


def test_preemption_when_the_cache_is_full() -> None:
    h = Harness(n_ctx=64, n_seq_max=4, step_tokens=64)
    for conv in range(4):
        h.start(conv, [conv * 100 + i for i in range(10)], 12)
    h.run()
    assert all(len(g) == 12 for g in h.generated.values())
    # four conversations of 22 tokens cannot all be cached in 64 cells at once
    assert any(s.phase is Phase.IDLE for s in h.sched.sequences())


def test_history_longer_than_the_context_is_refused() -> None:
    h = Harness(n_ctx=32)
    h.sched.add(1, list(range(40)))
    with pytest.raises(ContextFull):
        h.sched.submit(1)


def test_closed_conversations_leave_their_prefixes_in_the_cache() -> None:
    h = Harness()
    h.start(1, list(range(1, 30)), 3)
    h.sched.fork(1, 2)
    h.start(2, None, 3)
    h.run()
    used = h.sched._kv.cells.used
    history = list(h.sched.get(1).tokens)
    h.sched.remove(1)
    h.sched.remove(2)
    h.kv.apply(h.sched.take_ops())
    assert h.sched.statistics().live == 0 and h.sched._kv.n_entries == 2
    assert h.sched._kv.cells.used == h.kv.used == used  # nothing freed: it is cache now
    assert h.sched._kv.cells_cached() == used
    # a new conversation that starts with one of them evaluates only what is new
    before = sum(p.n_tokens for p in h.plans)
    h.start(3, history + [77, 78], 1)
    h.run()
    # the 2 new tokens, and the last one 1 sampled, which was never decoded
    assert sum(p.n_tokens for p in h.plans) - before == 3


def test_a_closed_prefix_another_holder_covers_is_not_kept_twice() -> None:
    h = Harness()
    h.start(1, list(range(1, 30)), 3)
    h.run()
    h.sched.fork(1, 2)
    h.start(2, None, 3)  # shares 1's 32 tokens and adds its own
    h.run()
    h.sched.remove(1)  # all of it is held by 2 as well
    h.kv.apply(h.sched.take_ops())
    assert h.sched._kv.n_entries == 0 and h.kv.used == h.sched._kv.cells.used


def test_the_cache_gives_cells_back_least_recently_used_first() -> None:
    h = Harness(n_ctx=128, n_seq_max=8)
    for conv in (1, 2, 3):
        h.start(conv, [conv * 100 + i for i in range(30)], 2)
        h.run()
        h.sched.remove(conv)
    assert h.sched._kv.n_entries == 3 and h.sched._kv.cells.used == 93  # 31 cached each
    h.start(4, [400 + i for i in range(60)], 2)  # needs 61 cells, 35 are free
    h.run()
    cached = {e.tokens[0] // 100: e.n_cached for e in h.sched._kv.holders() if e.entry}
    # the least recently used entry gave its tail first, and only as much as was needed
    assert cached.get(3) == 31 and cached.get(1, 0) < cached.get(2, 0) <= 31
    assert sum(31 - cached.get(k, 0) for k in (1, 2, 3)) == 61 - 35
    assert h.kv.used == h.sched._kv.cells.used


@pytest.mark.parametrize("host_bytes", [0, 1 << 20])
def test_preempted_streams_are_parked_and_restored(host_bytes: int) -> None:
    h = Harness(n_ctx=64, n_seq_max=4, step_tokens=64, host_bytes=host_bytes)
    for conv in range(4):
        h.start(conv, [conv * 100 + i for i in range(20)], 12)
    h.run()
    assert all(len(g) == 12 for g in h.generated.values())
    assert h.sched.statistics().preemptions > 0
    evaluated = sum(p.n_tokens for p in h.plans)
    if host_bytes:
        assert h.sched._kv.parks > 0 and h.sched._kv.restores > 0
        # only a stream preempted before it had MIN_PARK_TOKENS cached is evaluated again
        assert evaluated <= 4 * 20 + 4 * 11 + MIN_PARK_TOKENS
    else:
        assert evaluated > 4 * 20 + 4 * 11 + MIN_PARK_TOKENS


def test_rewind_drops_tokens_and_cells() -> None:
    h = Harness()
    h.start(1, list(range(1, 30)), 5)
    h.run()
    h.sched.rewind(1, 20)
    h.kv.apply(h.sched.take_ops())
    assert h.sched.get(1).tokens == list(range(1, 21)) and h.sched.get(1).n_cached == 20 == h.kv.used
    h.start(1, None, 2)
    h.run()
    assert h.sched.get(1).tokens[:20] == list(range(1, 21))


def test_context_shift_keeps_the_first_tokens_and_moves_the_rest() -> None:
    h = Harness(n_ctx=64, n_seq_max=2)
    h.sched.add(1, list(range(1, 41)))
    h.generated[1] = []
    h.limit[1] = 60
    h.sched.submit(1, n_keep=8)
    h.run()
    seq = h.sched.get(1)
    assert seq.tokens[:8] == list(range(1, 9)) and len(seq.tokens) < 64
    shifts = [s for p in h.plans for s in p.shifted]
    assert shifts and all(conv == 1 and keep == 8 for conv, keep, _ in shifts)
    assert h.kv.tokens(seq.seq_id) == seq.tokens[:seq.n_cached]  # the cells moved with the tokens


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix(list(range(1000)), list(range(999)) + [0]) == 999


def test_scheduler_imports_neither_cffi_nor_anyio(tmp_path: Path) -> None:
    code = ("import sys, aiollama.sched.scheduler, aiollama.sched.kvcache, aiollama.formats.text, aiollama.sampling;"
            "bad = [m for m in ('cffi', '_cffi_backend', 'anyio', 'aiollama._llama_cffi') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


# ordered cells (the deterministic mode)


@pytest.mark.parametrize("host_bytes", [0, 1 << 20])
def test_ordered_cells_are_reclaimed_by_compaction_and_keep_every_sequence(host_bytes: int) -> None:
    """Freed cells stay held until a compaction re-lays the cache; steps never need them before,
    and every sequence keeps its tokens (Harness.check) through evictions, preemptions, parking,
    forks sharing prefixes, closes and rewinds."""
    h = Harness(n_ctx=160, n_seq_max=6, step_tokens=48, host_bytes=host_bytes, ordered=True)
    conv = 0
    for round_ in range(6):
        base = [round_ * 1000 + i for i in range(30)]
        h.start(conv, base, 8)
        h.run()
        for child in (conv + 1, conv + 2):
            h.sched.fork(conv, child)
            h.start(child, None, 10 + child % 5)
        h.start(conv + 3, [round_ * 1000 + 500 + i for i in range(40)], 12)
        h.run()
        h.sched.rewind(conv + 1, 5)
        h.kv.apply(h.sched.take_ops())
        h.check()
        for gone in (conv, conv + 2):
            h.sched.remove(gone)
        h.kv.apply(h.sched.take_ops())
        h.check()
        conv += 4
    kv = h.sched._kv
    assert kv.compactions == h.kv.compactions > 0
    assert kv.evictions > 0
    assert all(len(g) == h.limit[c] for c, g in h.generated.items())


def test_ordered_compaction_shares_each_prefix_once() -> None:
    h = Harness(n_ctx=256, n_seq_max=6, ordered=True)
    h.start(1, list(range(1, 41)), 4)
    h.run()
    for child in (2, 3):
        h.sched.fork(1, child)
        h.start(child, None, 6)
    h.run()
    used = h.kv.used
    h.sched._kv.compact()
    ops = h.sched.take_ops()
    h.kv.apply(ops)
    h.check()
    assert h.kv.used == used  # nothing was copied twice
    (compact,) = ops
    assert isinstance(compact, Compact)
    ids = {h.sched.get(c).seq_id: c for c in (1, 2, 3)}
    donors = {ids[r.seq_id]: (None if r.donor is None else ids[r.donor], r.shared) for r in compact.relays}
    assert donors[1] == (None, 0)  # the first one restores the common prefix
    assert donors[2][0] == 1 and donors[3][0] in (1, 2) and donors[2][1] == donors[3][1] == h.sched.get(1).n_cached


def test_unordered_cells_are_freed_at_once() -> None:
    h = Harness(n_ctx=64, n_seq_max=4)
    h.start(1, list(range(1, 30)), 3)
    h.run()
    h.sched.rewind(1, 10)
    h.kv.apply(h.sched.take_ops())
    assert h.sched._kv.holes == 0 and h.kv.tombstones == 0
    h.sched._kv.room(60)
    assert h.sched._kv.compactions == 0


def test_ordered_cells_count_the_draft_tokens_the_executor_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiollama.sched.speculation as speculation

    monkeypatch.setattr(speculation, "START", 4)  # a first draft of the whole length
    sched = Scheduler(SchedulerConfig(n_ctx=64, n_seq_max=2, n_batch=64, step_tokens=64, ordered=True))
    sched.add(1, [1, 2, 3, 4, 5, 6, 1, 2, 3])
    sched.submit(1, draft=4)
    plan = sched.schedule()  # the prompt
    sched.update(plan, StepResult(StepStatus.OK, (Sampled(1, 4, b"", False),)))
    plan = sched.schedule()  # the pending 4, and a draft from the history: 5, 6, 1, 2
    (s,) = plan.slices
    assert s.tokens[1:] == (5, 6, 1, 2) and s.draft == 4
    # one draft token taken, then another token chosen: the executor removed 3 draft cells
    sched.update(plan, StepResult(StepStatus.OK, (Sampled(1, 5, b"", False), Sampled(1, 9, b"", False))))
    assert sched._kv.holes == 3 and sched.get(1).n_cached == 11


@pytest.mark.parametrize("host_bytes", [0, 1 << 20])
def test_idle_cells_of_a_unified_cache_are_given_back_while_others_run(monkeypatch: pytest.MonkeyPatch,
                                                                      host_bytes: int) -> None:
    import aiollama.sched.idle as idle

    monkeypatch.setattr(idle, "IDLE_CELLS", 8)
    h = Harness(n_ctx=1024, n_seq_max=8, n_batch=64, step_tokens=64, host_bytes=host_bytes, kv_unified=True)
    shared = list(range(1, 41))
    h.start(1, shared + list(range(100, 140)), 4)  # 83 cells, the first 40 a system prompt
    h.run()
    assert h.sched._kv.cells.used == 83  # nothing runs: the idle keep everything
    h.start(3, shared + list(range(300, 310)), 30)  # shares conversation 1's first 40 cells
    h.step()
    # while 3 runs, only what it holds and at most IDLE_CELLS more stay in the context
    assert h.sched._kv.cells.used <= 40 + 10 + 8
    assert h.sched.get(3).cached_tokens == 40
    assert len(h.sched._kv.host) == (1 if host_bytes else 0)  # parked: a later hit is a copy
    h.run()
    h.start(1, None, 2)  # conversation 1 again, alone
    h.run()
    assert h.sched.get(1).cached_tokens == (83 if host_bytes else 40 + 8)  # 8: the idle cells kept


def test_a_split_cache_keeps_its_idle_cells_under_load() -> None:
    h = Harness(n_ctx=1024, n_seq_max=8, n_batch=64, step_tokens=64, kv_unified=False)
    h.start(1, list(range(100, 140)), 4)
    h.run()
    h.start(3, list(range(300, 310)), 30)
    h.step()
    assert h.sched._kv.cells.used == 43 + 10  # each seq id's cells are its own: nobody's step reads them


@pytest.mark.parametrize(("memory", "rollback", "want"), [("kv", 0, 4), ("hybrid", 2, 2), ("hybrid", 0, 0)])
def test_drafts_stop_short_of_max_tokens_and_longer_than_a_state_rolls_back_are_refused(
        monkeypatch: pytest.MonkeyPatch, memory: str, rollback: int, want: int) -> None:
    import aiollama.sched.speculation as speculation

    monkeypatch.setattr(speculation, "START", 4)  # a first draft of the whole length
    sched = Scheduler(SchedulerConfig(n_ctx=64, n_seq_max=2, n_batch=64, step_tokens=64, memory=memory,
                                      rollback=rollback))
    sched.add(1, [1, 2, 3, 4, 5, 6, 1, 2, 3])
    if want < 4:  # a state's snapshots hold fewer tokens than the request drafts: refused, nothing changed
        with pytest.raises(InvalidRequestError, match=f"draft_tokens=4: .* at most {rollback} tokens"):
            sched.submit(1, draft=4, max_tokens=7)
        assert sched.get(1).phase is Phase.IDLE and sched.schedule().slices == ()
    sched.submit(1, draft=want, max_tokens=7)
    plan = sched.schedule()  # the prompt (a recurrent state's last token waits for a checkpoint)
    while plan.slices[0].pos + len(plan.slices[0].tokens) < 9:
        sched.update(plan, StepResult(StepStatus.OK))
        plan = sched.schedule()
    sched.update(plan, StepResult(StepStatus.OK, (Sampled(1, 4, b"", False),)))
    plan = sched.schedule()  # the pending 4, and a draft from the history: 5, 6, 1, 2
    (s,) = plan.slices
    assert s.draft == want and s.tokens[1:] == (5, 6, 1, 2)[:want]
    cycle = (5, 6, 1, 2, 3, 4)  # the history goes on repeating itself: an n-gram draft always has one
    taken = [Sampled(1, t, b"", False) for t in cycle[:want + 1]]
    sched.update(plan, StepResult(StepStatus.OK, tuple(taken)))
    (s,) = sched.schedule().slices
    left = 9 + 7 - len(sched.get(1).tokens)  # tokens still to generate, the pending one's successor first
    assert s.draft == min(want, left - 1)  # kv: 6 of 7 generated, no draft; hybrid: what a state rolls back
