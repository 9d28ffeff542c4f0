"""A hypothesis state machine over the scheduler and its prefix cache, with a fake KV cache that keeps
each cell's token: random prompts, forks, streams (some shifting their context), cancels, rewinds,
closes, forced evictions and steps keep every invariant:

- the cells in use never exceed the cache, and the fake cache agrees with the scheduler's count;
- every holder (conversation or cache entry) holds exactly the tokens of its own prefix, so a
  prefix hit never returns cells that differ from the request;
- a step never takes cells from a running conversation it did not preempt;
- every generation finishes.

``TestImageScheduler`` adds pictures (placeholder rows, see ``aiollama.formats.images``) to prompts,
as a projector whose pictures go whole in one step does: every picture row a plan decodes has its
rows in the plan (the conversation that holds it brought them, or a fork inherited them), and no
slice ends inside a picture.

``TestHybridScheduler`` runs the same machine over a hybrid model's memory (a recurrent state beside
the cells, see ``fake_kv``), with failed decodes too: every holder's state is then the one after its
cells, so a rewind, a prefix hit, a preemption or a failure went back to a checkpoint or to nothing.
"""

from __future__ import annotations

import os

from fake_kv import FakeKV
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from aiollama.errors import ContextFull, InvalidRequestError
from aiollama.formats.images import image_row, placeholders
from aiollama.sched.kvtree import common_prefix
from aiollama.sched.scheduler import Scheduler, SchedulerConfig
from aiollama.sched.sequence import Phase
from aiollama.sched.step import Plan, Sampled, StepResult, StepStatus

N_CTX, N_SEQ_IDS, MAX_RUNNING, N_BATCH, STEP, HOST = 96, 6, 3, 24, 12, 6000
tokens = st.lists(st.integers(1, 50), min_size=1, max_size=30)
SYSTEM = list(range(101, 125))  # a prefix many conversations share, so that the cache gets hits


def picture(number: int) -> list[int]:
    return placeholders(number, 2 + 2 * number)


class SchedulerMachine(RuleBasedStateMachine):
    memory = "kv"
    images = False
    rollback = 0  # hybrid: the tokens of its last decode a state can drop (drafts are no longer)

    @initialize(host=st.sampled_from([0, HOST]), checkpoints=st.sampled_from([0, HOST]))
    def setup(self, host: int, checkpoints: int) -> None:
        self.sched = Scheduler(SchedulerConfig(n_ctx=N_CTX, n_seq_max=N_SEQ_IDS, n_batch=N_BATCH, step_tokens=STEP,
                                               max_running=MAX_RUNNING, host_bytes=host, memory=self.memory,
                                               checkpoint_bytes=checkpoints, whole_images=self.images,
                                               rollback=self.rollback))
        self.kv = FakeKV(N_CTX, N_SEQ_IDS, recurrent=self.memory != "kv", rollback=self.rollback)
        self.next_id = 1
        self.limits: dict[int, int] = {}  # running generations: tokens still to generate
        self.cancelled: set[int] = set()

    def said(self, pos: int) -> int:
        """The token the fake model chooses at ``pos``: always 7."""
        return 7

    def _live(self) -> list[int]:
        return sorted(s.conv for s in self.sched.sequences())

    def _apply_ops(self) -> None:
        applied = self.kv.apply(self.sched.take_ops())
        self.sched.update(_empty, StepResult(StepStatus.OK, **applied))

    @rule(toks=tokens, shared=st.booleans())
    def add(self, toks: list[int], shared: bool) -> None:
        self.sched.add(self.next_id, (SYSTEM if shared else []) + toks)
        self.next_id += 1

    @precondition(lambda self: self.sched.statistics().live)
    @rule(data=st.data(), toks=tokens)
    def prompt(self, data: st.DataObject, toks: list[int]) -> None:
        conv = data.draw(st.sampled_from(self._live()))
        if self.sched.get(conv).phase is Phase.IDLE:  # the decode thread defers prompts to busy ones
            self.sched.append(conv, toks)

    @precondition(lambda self: self.images)
    @rule(toks=tokens, number=st.integers(0, 3), data=st.data())
    def add_or_prompt_a_picture(self, toks: list[int], number: int, data: st.DataObject) -> None:
        """A prompt with a picture: its conversation brings the picture's rows."""
        live = [c for c in self._live() if self.sched.get(c).phase is Phase.IDLE]
        conv = data.draw(st.sampled_from([None, *live]))
        if conv is None:
            conv, self.next_id = self.next_id, self.next_id + 1
            self.sched.add(conv, SYSTEM + picture(number) + toks)
        else:
            self.sched.append(conv, picture(number) + toks)
        self.sched.add_images(conv, {number: ["row"] * len(picture(number))})

    def _check_pictures(self, plan: Plan) -> None:
        assert all(s.tokens for s in plan.slices), "an empty slice"
        for s in plan.slices:
            history = self.sched.get(s.conv).tokens
            for t in s.tokens:
                if t < 0:
                    number, row = image_row(t)
                    assert number in plan.images and row < len(plan.images[number]), "a picture without its rows"
            end = s.pos + len(s.tokens)
            if s.tokens[-1] < 0 and end < len(history) and history[end] < 0:
                (number, row), following = image_row(s.tokens[-1]), image_row(history[end])
                assert following != (number, row + 1), "a slice ends inside a picture"

    @precondition(lambda self: self.sched.statistics().live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._live()))
        n = data.draw(st.integers(0, len(self.sched.get(parent).tokens)))
        self.sched.fork(parent, self.next_id, n)
        self.next_id += 1

    @precondition(lambda self: self.sched.statistics().live)
    @rule(data=st.data(), n=st.one_of(st.integers(1, 8), st.integers(60, 150)), shift=st.booleans(),
          draft=st.sampled_from([0, 0, 2, 4]))
    def stream(self, data: st.DataObject, n: int, shift: bool, draft: int) -> None:
        conv = data.draw(st.sampled_from(self._live()))
        seq = self.sched.get(conv)
        if seq.phase is not Phase.IDLE or not seq.tokens or seq.tokens[-1] < 0:  # (the API refuses the last)
            return
        try:
            self.sched.submit(conv, n_keep=4 if shift else None, draft=draft)
        except ContextFull:
            assert len(seq.tokens) >= N_CTX and not shift
            return
        except InvalidRequestError:  # drafts longer than a state rolls back: refused, nothing changed
            assert self.memory != "kv" and draft > self.rollback and seq.phase is Phase.IDLE
            return
        self._apply_ops()  # a history shifted at once gave up cells: the next step applies that first
        assert len(seq.tokens) < N_CTX
        self.limits[conv] = n
        self.cancelled.discard(conv)

    @precondition(lambda self: self.limits)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        conv = data.draw(st.sampled_from(sorted(self.limits)))
        self.sched.finish(conv)
        del self.limits[conv]
        self.cancelled.add(conv)

    @precondition(lambda self: self.sched.statistics().live)
    @rule(data=st.data())
    def rewind(self, data: st.DataObject) -> None:
        conv = data.draw(st.sampled_from(self._live()))
        seq = self.sched.get(conv)
        if seq.phase is Phase.IDLE:
            self.sched.rewind(conv, data.draw(st.integers(0, len(seq.tokens))))
            self._apply_ops()

    @precondition(lambda self: self.sched.statistics().live)
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        conv = data.draw(st.sampled_from(self._live()))
        self.sched.remove(conv)
        self._apply_ops()
        self.limits.pop(conv, None)
        self.cancelled.add(conv)

    @rule()
    def no_kv_slot(self) -> None:
        """llama.cpp refused a batch the plan thought would fit: the scheduler frees cells by force."""
        self.sched.make_room()
        self._apply_ops()

    @precondition(lambda self: self.limits)
    @rule()
    def failed_step(self) -> None:
        """A decode that failed (or was aborted) halfway: the first half of its tokens are in the
        cache, and the recurrent states of its sequences are half computed."""
        plan = self.sched.schedule()
        applied = self.kv.apply(plan.ops)
        if not plan.slices:
            self.sched.update(plan, StepResult(StepStatus.OK, **applied))
            return
        self._check_pictures(plan)
        assert self.kv.decode(plan, limit=plan.n_tokens // 2)
        n_cached = {s.conv: self.kv.pos_max(s.seq_id) + 1 for s in plan.slices}
        self.sched.update(plan, StepResult(StepStatus.ABORTED, n_cached=n_cached, **applied))
        self._apply_ops()

    @rule()
    def step(self) -> None:
        before = {s.conv: (s.seq_id, s.n_cached) for s in self.sched.sequences() if s.phase is Phase.RUNNING}
        plan = self.sched.schedule()
        applied = self.kv.apply(plan.ops)
        assert plan.n_tokens <= N_BATCH
        assert len({s.conv for s in plan.slices}) == len(plan.slices)
        self._check_pictures(plan)
        shifted = {conv for conv, _, _ in plan.shifted}
        for conv, (seq_id, n_cached) in before.items():
            seq = self.sched.get(conv)
            if seq.phase is Phase.RUNNING and seq.seq_id == seq_id and conv not in shifted:
                assert seq.n_cached >= n_cached, "a running conversation lost cells it was not preempted for"
        for s in plan.slices:
            assert s.conv not in self.cancelled, "a cancelled generation was scheduled"
            assert s.conv in self.limits
        assert self.kv.decode(plan), "the plan did not fit the KV cache"
        sampled: list[Sampled] = []
        for s in plan.slices:  # the model says said(position); a draft is taken while it says the same
            if not s.logits:
                continue
            at = s.pos + len(s.tokens) - s.draft  # the position of the token this row chooses
            sampled.append(Sampled(s.conv, self.said(at), b"", False))
            taken = 0
            while taken < s.draft and s.tokens[1 + taken] == self.said(at + taken):
                taken += 1
                sampled.append(Sampled(s.conv, self.said(at + taken), b"", False))
            if taken < s.draft and self.memory == "kv":
                self.kv.remove(s.seq_id, s.pos + 1 + taken)
            elif taken < s.draft:
                assert s.draft <= self.rollback
                self.kv.roll_back(s.seq_id, s.pos + 1 + taken)
        self.sched.update(plan, StepResult(StepStatus.OK, tuple(sampled), **applied))
        left = {s.conv: sum(1 for x in sampled if x.conv == s.conv) for s in sampled}
        for s in sampled:
            left[s.conv] -= 1
            if s.conv not in self.limits:
                continue  # it ended earlier in this step's draft
            self.limits[s.conv] -= 1
            seq = self.sched.get(s.conv)
            if self.limits[s.conv] == 0 or (len(seq.tokens) - left[s.conv] >= N_CTX and seq.n_keep is None):
                self.sched.finish(s.conv)
                del self.limits[s.conv]
                if left[s.conv]:  # what the draft gave past the end goes, as the engine does
                    self.sched.rewind(s.conv, len(seq.tokens) - left[s.conv])
                    self._apply_ops()

    @invariant()
    def seq_ids_are_unique_and_in_range(self) -> None:
        ids = [s.seq_id for s in self.sched._kv.holders()]
        assert len(ids) == len(set(ids))
        assert all(i is not None and 0 <= i < N_SEQ_IDS for i in ids)
        assert self.sched.statistics().active <= MAX_RUNNING

    @invariant()
    def every_holder_holds_its_own_prefix(self) -> None:
        assert self.kv.used == self.sched._kv.cells.used <= N_CTX
        held = {s.seq_id for s in self.sched._kv.holders()}
        for seq in self.sched._kv.holders():
            assert seq.seq_id is not None
            # positions are contiguous from 0, and the cells hold exactly the sequence's prefix
            assert self.kv.positions(seq.seq_id) == list(range(seq.n_cached))
            assert self.kv.tokens(seq.seq_id) == seq.tokens[:seq.n_cached]
            assert seq.n_cached <= len(seq.tokens)
        for _, ids, _ in self.kv.cells:
            assert ids <= held
        assert self.sched._kv.cells_cached() <= self.sched._kv.cells.used

    @invariant()
    def the_radix_tree_finds_the_longest_cached_prefix(self) -> None:
        holders = list(self.sched._kv.holders())
        for probe in [h.tokens for h in holders] + [s.tokens + [9] for s in self.sched.sequences()]:
            expected = max((min(common_prefix(probe, h.tokens), h.n_cached) for h in holders), default=0)
            donor, n = self.sched._kv.find(probe, len(probe))
            assert n == expected
            if n:
                assert donor is not None and donor.n_cached >= n and donor.tokens[:n] == probe[:n]

    @invariant()
    def recurrent_states_follow_their_cells(self) -> None:
        if self.memory == "kv":
            return
        for seq in self.sched._kv.holders():
            assert seq.seq_id is not None
            assert self.kv.states.get(seq.seq_id, ()) == tuple(seq.tokens[:seq.n_cached]), \
                f"seq {seq.seq_id}: its recurrent state is not the one after its {seq.n_cached} cells"

    @invariant()
    def host_memory_stays_within_its_budget(self) -> None:
        assert self.sched._kv.host.used_bytes <= self.sched._kv.host.budget

    def teardown(self) -> None:
        # every waiting or running generation is served eventually
        for _ in range(2000):
            if not self.limits:
                break
            self.step()
        assert not self.limits, f"generations never finished: {self.limits}"
        assert not self.sched.busy


_empty = Plan()

class HybridMachine(SchedulerMachine):
    memory = "hybrid"


class HybridDraftMachine(SchedulerMachine):
    """Drafts on a hybrid model whose state rolls back (llama.cpp's snapshots): rejected draft
    tokens leave the state within its last decode, and the rest of the machine's rules hold."""

    memory = "hybrid"
    rollback = 3

    def said(self, pos: int) -> int:
        """Mostly 7, 8 at scattered positions: n-gram drafts of the history are taken as far as
        they agree, and rejected from there."""
        return 8 if pos * 7919 % 11 < 3 else 7


class ImageMachine(SchedulerMachine):
    images = True


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=int(os.environ.get("AIOLLAMA_STATE_EXAMPLES", 150)), stateful_step_count=40,
                                  deadline=None)
TestHybridScheduler = HybridMachine.TestCase
TestHybridScheduler.settings = TestScheduler.settings
TestHybridDraftScheduler = HybridDraftMachine.TestCase
TestHybridDraftScheduler.settings = TestScheduler.settings
TestImageScheduler = ImageMachine.TestCase
TestImageScheduler.settings = TestScheduler.settings


# Found by the hybrid machine: three running streams that did not fit the cache together. Admission
# gave the cells a preemption had freed back to the preempted ones at once, so the stream that
# stayed never progressed, step after step. Admission now leaves room for the running ones' prompts.
LIVELOCK = [
    ('add', False, [47, 2, 43, 30]),
    ('add', True, [49]),
    ('add', True, [47]),
    ('stream', 1, 6, False, 0),
    ('stream', 1, 1, False, 0),
    ('stream', 1, 1, False, 0),
    ('add', True, [16, 5, 49]),
    ('stream', 1, 1, False, 0),
    ('stream', 2, 5, False, 0),
    ('add', True, [13, 39, 3, 43]),
    ('stream', 3, 1, False, 0),
    ('stream', 1, 1, False, 0),
    ('stream', 1, 1, True, 0),
    ('add', True, [1, 1, 1, 1]),
    ('add', True, [1, 1, 1]),
    ('add', False, [40]),
    ('add', True, [44, 8, 1, 37, 22, 19, 25, 34, 9, 34]),
    ('stream', 1, 1, False, 0),
    ('add', False, [1]),
    ('add', True, [37, 29, 43, 5, 10, 15, 35, 3, 21, 21, 11, 25, 40, 18]),
    ('stream', 6, 120, True, 0),
    ('stream', 8, 4, False, 0),
    ('stream', 5, 1, True, 4),
    ('stream', 9, 125, False, 0),
    ('stream', 8, 91, False, 0),
    ('stream', 2, 8, False, 0),
    ('add', True, [47, 39, 1, 44, 20, 14, 32, 2, 5, 21]),
    ('add', True, [28, 41, 39]),
    ('stream', 3, 137, True, 0),
    ('stream', 5, 4, False, 0),
    ('stream', 8, 7, True, 4),
    ('add', False, [42, 38, 43, 50]),
    ('stream', 7, 95, False, 4),
    ('add', False, [18]),
    ('add', True, [5]),
    ('stream', 11, 7, False, 4),
]


def test_admission_leaves_room_for_the_running_prompts() -> None:
    class Draw:
        def __init__(self, value: int) -> None:
            self.value = value

        def draw(self, strategy: object) -> int:
            return self.value

    machine = HybridMachine()
    machine.setup(host=HOST, checkpoints=HOST)
    for action in LIVELOCK:
        if action[0] == "add":
            machine.add(toks=action[2], shared=action[1])
        else:
            machine.stream(Draw(action[1]), n=action[2], shift=action[3], draft=action[4])  # type: ignore[arg-type]
    machine.teardown()  # every generation finishes
