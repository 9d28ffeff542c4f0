"""A hypothesis state machine over the scheduler with a fake KV cache: random prompts, forks,
streams, cancels, closes, forced evictions and steps keep every invariant."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiollama.errors import ContextFull
from aiollama.kvcache import Phase
from aiollama.scheduler import Scheduler
from aiollama.step import Sampled, StepResult, StepStatus
from fake_kv import FakeKV

N_CTX, N_SEQ_MAX, N_BATCH, STEP = 96, 3, 24, 12
tokens = st.lists(st.integers(1, 50), min_size=1, max_size=30)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.sched = Scheduler(n_ctx=N_CTX, n_seq_max=N_SEQ_MAX, n_batch=N_BATCH, step_tokens=STEP)
        self.kv = FakeKV(N_CTX, N_SEQ_MAX)
        self.next_id = 1
        self.limits: dict[int, int] = {}  # running generations: tokens still to generate
        self.cancelled: set[int] = set()

    def _live(self) -> list[int]:
        return sorted(s.conv for s in self.sched.sequences())

    @rule(toks=tokens)
    def add(self, toks: list[int]) -> None:
        self.sched.add(self.next_id, toks)
        self.next_id += 1

    @precondition(lambda self: self.sched.n_live)
    @rule(data=st.data(), toks=tokens)
    def prompt(self, data: st.DataObject, toks: list[int]) -> None:
        conv = data.draw(st.sampled_from(self._live()))
        if self.sched.get(conv).phase is Phase.IDLE:  # the decode thread defers prompts to busy ones
            self.sched.append(conv, toks)

    @precondition(lambda self: self.sched.n_live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._live()))
        self.sched.fork(parent, self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.sched.n_live)
    @rule(data=st.data(), n=st.integers(1, 8))
    def stream(self, data: st.DataObject, n: int) -> None:
        conv = data.draw(st.sampled_from(self._live()))
        seq = self.sched.get(conv)
        if seq.phase is not Phase.IDLE:
            return
        try:
            self.sched.submit(conv)
        except ContextFull:
            assert len(seq.tokens) >= N_CTX
            return
        self.limits[conv] = n
        self.cancelled.discard(conv)

    @precondition(lambda self: self.limits)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        conv = data.draw(st.sampled_from(sorted(self.limits)))
        self.sched.finish(conv)
        del self.limits[conv]
        self.cancelled.add(conv)

    @precondition(lambda self: self.sched.n_live)
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        conv = data.draw(st.sampled_from(self._live()))
        self.sched.remove(conv)
        self.kv.apply(self.sched.take_ops())
        self.limits.pop(conv, None)
        self.cancelled.add(conv)

    @rule()
    def no_kv_slot(self) -> None:
        """llama.cpp refused a batch the plan thought would fit: the scheduler frees cells by force."""
        self.sched.make_room()
        self.kv.apply(self.sched.take_ops())

    @rule()
    def step(self) -> None:
        plan = self.sched.schedule()
        self.kv.apply(plan.ops)
        assert plan.n_tokens <= N_BATCH
        assert len({s.conv for s in plan.slices}) == len(plan.slices)
        for s in plan.slices:
            assert s.conv not in self.cancelled, "a cancelled generation was scheduled"
            assert s.conv in self.limits
        assert self.kv.decode(plan), "the plan did not fit the KV cache"
        sampled = tuple(Sampled(s.conv, 7, b"", False) for s in plan.slices if s.logits)
        self.sched.update(plan, StepResult(StepStatus.OK, sampled))
        for s in sampled:
            self.limits[s.conv] -= 1
            seq = self.sched.get(s.conv)
            if self.limits[s.conv] == 0 or len(seq.tokens) >= N_CTX:
                self.sched.finish(s.conv)
                del self.limits[s.conv]

    @invariant()
    def seq_ids_are_unique_and_in_range(self) -> None:
        ids = [s.seq_id for s in self.sched.sequences() if s.seq_id is not None]
        assert len(ids) == len(set(ids))
        assert all(0 <= i < N_SEQ_MAX for i in ids)

    @invariant()
    def cells_match_what_sequences_hold(self) -> None:
        assert self.kv.used == self.sched.kv.cells.used <= N_CTX
        held = {s.seq_id for s in self.sched.sequences() if s.seq_id is not None}
        for seq in self.sched.sequences():
            if seq.seq_id is not None:
                # positions are contiguous from 0, and the cache holds exactly the sequence's prefix
                assert self.kv.positions(seq.seq_id) == list(range(seq.n_cached))
                assert seq.n_cached <= len(seq.tokens)
        for _, ids, _ in self.kv.cells:
            assert ids <= held

    def teardown(self) -> None:
        # every waiting or running generation is served eventually
        for _ in range(2000):
            if not self.limits:
                break
            self.step()
        assert not self.limits, f"generations never finished: {self.limits}"
        assert not self.sched.busy


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
