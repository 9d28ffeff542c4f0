"""The sequences a scheduler knows, and its queues: what callers asked for (conversations added,
prompted, forked, rewound), which generations wait and which run, and preemption, which moves a
running one back to waiting. :class:`~aiollama.sched.scheduler.Scheduler` holds one and builds each
step's plan from it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from aiollama.sched.images import ImageStore
from aiollama.sched.kvcache import MIN_PARK_TOKENS, KVManager
from aiollama.sched.lockstep import generations
from aiollama.sched.sequence import Phase, SeqState
from aiollama.sched.step import Op

# A waiting generation's priority improves by one every this many seconds: nothing waits forever.
AGING_SECONDS = 5.0
# Between a conversation's cache salt and its adapters in the salt its cells are keyed by.
LORA_SALT = "\x00lora="


class Queues:
    """Every live sequence by conversation, the waiting and the running ones, over ``kv``. The
    scheduler holds one and reads its lists; nothing outside ``sched/`` sees it."""

    lora_used = False  # a conversation with LoRA adapters was added: steps may take turns

    def __init__(self, kv: KVManager, clock: Callable[[], float]) -> None:
        self.kv = kv
        self.preemptions = 0
        self.seqs: dict[int, SeqState] = {}
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self.clock = clock
        self.images = ImageStore()  # the rows of the pictures in the conversations' histories

    def get(self, conv: int) -> SeqState:
        return self.seqs[conv]

    def __contains__(self, conv: int) -> bool:
        return conv in self.seqs

    def sequences(self) -> list[SeqState]:
        """Every live sequence (a read for tests and statistics; do not modify them)."""
        return list(self.seqs.values())

    def add(self, conv: int, tokens: Iterable[int] = (), salt: str | None = None,
            lora: tuple[tuple[str, float], ...] = ()) -> SeqState:
        """A conversation; it shares cached cells only with holders of the same ``salt`` and the
        same LoRA adapters (cells computed under other adapters hold other values)."""
        if conv in self.seqs:
            raise KeyError(f"conversation {conv} already exists")
        if lora:
            salt = f"{salt or ''}{LORA_SALT}{lora!r}"
            self.lora_used = True
        seq = SeqState(conv, list(tokens), last_used=self.kv.tick(), salt=salt, lora=lora)
        self.seqs[conv] = seq
        return seq

    def set_lora(self, conv: int, lora: tuple[tuple[str, float], ...]) -> None:
        """An idle conversation's next generations decode with other adapters. What it has cached
        was computed under the old ones: it stays behind as a cache entry of those (switching back
        finds it), and the conversation shares cells with holders of the new ones from now on."""
        old = self.seqs[conv]
        assert old.phase is Phase.IDLE, "callers switch adapters only between generations"
        if lora == old.lora:
            return
        salt = None if old.salt is None else old.salt.partition(LORA_SALT)[0] or None
        del self.seqs[conv]
        self.add(conv, old.tokens, salt, lora)
        self.kv.retire(old)

    def append(self, conv: int, tokens: Iterable[int]) -> None:
        seq = self.seqs[conv]
        seq.tokens.extend(tokens)
        seq.last_used = self.kv.tick()

    def fork(self, parent: int, child: int, n_tokens: int | None = None) -> SeqState:
        """The child starts with the parent's first ``n_tokens`` tokens (all of them by default);
        it shares their KV once it runs (prefix sharing)."""
        src = self.seqs[parent]
        src.last_used = self.kv.tick()
        child_seq = self.add(child, src.tokens if n_tokens is None else src.tokens[:n_tokens])
        child_seq.salt, child_seq.lora = src.salt, src.lora
        self.images.fork(parent, child)
        return child_seq

    def rewind(self, conv: int, n_tokens: int) -> None:
        """Keep only the first ``n_tokens`` tokens of an idle conversation (and of its cache)."""
        seq = self.seqs[conv]
        assert seq.phase is Phase.IDLE, "callers rewind only conversations that do not generate"
        del seq.tokens[n_tokens:]
        self.kv.truncate(seq, n_tokens)
        seq.last_used = self.kv.tick()

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def n_live(self) -> int:
        return len(self.seqs)

    @property
    def n_active(self) -> int:
        return len(self.running)

    @property
    def n_queued(self) -> int:
        return len(self.waiting)

    def take_ops(self) -> tuple[Op, ...]:
        """KV operations decided outside a plan (a close between steps); they also lead the next plan."""
        return self.kv.take_ops()

    def next_waiting(self) -> SeqState | None:
        """The waiting generation to admit next: the lowest priority value after aging, then the
        preempted, then the first come; of those not waiting for a state from disk."""
        now = self.clock()
        return min((s for s in self.waiting if s.loading is None), default=None,
                   key=lambda s: (s.priority - int((now - s.queued_at) / AGING_SECONDS), not s.preempted, s.queued_at))

    def preempt_newest(self, only_if_several: bool) -> set[int]:
        """Preempt the running generation that gives way first (see room.fit)."""
        if not self.running or (only_if_several and generations(self.running) <= 1):
            return set()
        return self.preempt(self.victim())

    def victim(self) -> SeqState:
        """The running generation to preempt first: the lowest priority, then the newest."""
        return max(self.running, key=lambda s: (s.priority, s.started))

    def preempt(self, seq: SeqState) -> set[int]:
        """Stop a running generation to free its cells (parked in host memory if it has room), with
        the sequence that guides it or that it guides; it resumes first among its equals when room
        returns. Returns the conversations stopped."""
        owner = seq.owner or seq
        group = (owner, owner.guide) if owner.guide is not None else (owner,)
        for s in group:
            if s.phase is not Phase.RUNNING:
                continue
            self.running.remove(s)
            if self.kv.host.enabled and s.n_cached >= MIN_PARK_TOKENS:
                self.kv.park(s)
            self.kv.drop(s)
            s.phase = Phase.WAITING
            s.follow = None
            s.preemptions += 1
        owner.preempted = True
        self.waiting.append(owner)
        self.preemptions += 1
        return {s.conv for s in group}
