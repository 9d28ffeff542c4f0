"""The decode thread: the only code that touches both the native layer and the scheduler.

It owns the model, the context, the batch and every sampler chain, and runs one loop:

1. drain the command queue (blocking only when there is nothing to do);
2. ask the scheduler for a plan and apply its KV operations;
3. make one ``llama_decode`` call (the GIL is released while it runs);
4. sample each sequence that needs a token, with its own sampler chain;
5. hand the step's output to each consumer's event loop in one non-blocking hop.

A fatal error reaches every waiting stream as ``EngineDead``; it never becomes a hang.
"""

from __future__ import annotations

import atexit
import bisect
import queue
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from aiollama.commands import (
    Cancel,
    Close,
    Command,
    Delta,
    Fork,
    Generate,
    NewConversation,
    Portal,
    Prompt,
    Shutdown,
    Sink,
)
from aiollama.errors import (
    AiollamaError,
    ConversationClosed,
    DecodeError,
    EngineClosed,
    EngineDead,
    InvalidRequestError,
)
from aiollama.native import Batch, Context, DecodeStatus, Model, SamplerChain, Vocab
from aiollama.native.sampler import DEFAULT_SEED
from aiollama.sampling import SamplingParams
from aiollama.scheduler import Copy, Phase, Plan, Remove, Scheduler
from aiollama.text import TextAssembler


MAX_NO_SLOT_RETRIES = 16


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    n_ctx: int = 8192
    n_seq_max: int = 16
    n_batch: int = 512
    step_tokens: int = 256
    n_threads: int | None = None
    n_gpu_layers: int = 0
    max_queued: int = 1024


@dataclass(frozen=True)
class Statistics:
    """A snapshot of the engine, published by the decode thread after every step."""

    live: int = 0  # conversations not closed
    active: int = 0  # generating, holding a seq id
    queued: int = 0  # waiting for a seq id
    kv_cells_used: int = 0
    kv_cells_total: int = 0
    seq_ids_used: int = 0  # held by active conversations and by idle ones caching their KV
    n_seq_max: int = 0
    tokens_evaluated: int = 0  # rows decoded: prompts, re-evaluations and sampled tokens
    tokens_generated: int = 0
    decode_steps: int = 0
    aborted_steps: int = 0  # decodes interrupted by a cancel (their partial KV is kept consistent)
    decode_seconds: float = 0.0  # inside llama_decode
    step_seconds: float = 0.0  # whole steps: planning, batch filling, decode, sampling, delivery
    step_histogram: tuple[int, ...] = ()  # steps per STEP_BUCKETS interval, the last one unbounded

    @property
    def python_overhead(self) -> float:
        """Share of step time spent outside ``llama_decode``."""
        return 0.0 if self.step_seconds <= 0 else 1.0 - self.decode_seconds / self.step_seconds


def build_chain(vocab: Vocab, params: SamplingParams, history: list[int]) -> SamplerChain:
    """A sampler chain for one stream; penalties see the conversation's recent history."""
    chain = SamplerChain(vocab)
    try:
        if params.uses_penalties:
            chain.add_penalties(params.penalty_last_n, params.repeat_penalty,
                                params.frequency_penalty, params.presence_penalty)
            recent = history if params.penalty_last_n < 0 else history[-params.penalty_last_n:]
            for token in recent:
                chain.accept(token)  # the chain holds only penalties yet: no grammar sees the prompt
        if params.logit_bias:
            chain.add_logit_bias(params.logit_bias)
        if params.grammar is not None:
            chain.add_grammar(params.grammar)
        if params.greedy:
            chain.add_greedy()
            return chain
        if params.top_k > 0:
            chain.add_top_k(params.top_k)
        if params.typical_p < 1.0:
            chain.add_typical(params.typical_p)
        if params.top_p < 1.0:
            chain.add_top_p(params.top_p)
        if params.min_p > 0.0:
            chain.add_min_p(params.min_p)
        chain.add_temp(params.temperature)
        chain.add_dist(DEFAULT_SEED if params.seed is None else params.seed)
        return chain
    except BaseException:
        chain.close()
        raise


@dataclass(eq=False)
class _Generation:
    params: SamplingParams
    chain: SamplerChain
    sink: Sink
    text: TextAssembler
    n_generated: int = 0
    queued: bool = True  # counts against max_queued until admitted


class Admission:
    """The count of generations waiting for admission, shared by callers and the decode thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._count = 0
        self._lock = threading.Lock()

    def enter(self) -> bool:
        with self._lock:
            if self._count >= self.limit:
                return False
            self._count += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._count -= 1


_live_loops: weakref.WeakSet[DecodeLoop] = weakref.WeakSet()


@atexit.register
def _stop_live_loops() -> None:
    # A forgotten engine must not decode while the interpreter is torn down.
    for loop in list(_live_loops):
        loop.shutdown(timeout=10.0)


STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # seconds


@dataclass
class _Counters:
    tokens_evaluated: int = 0
    tokens_generated: int = 0
    decode_steps: int = 0
    aborted_steps: int = 0
    decode_seconds: float = 0.0
    step_seconds: float = 0.0


class DecodeLoop:
    """Owns the llama.cpp state on one thread; everything else talks to it through :meth:`send`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.admission = Admission(config.max_queued)
        self.statistics = Statistics()
        self.model: Model | None = None
        self.dead: EngineDead | None = None
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="aiollama-decode", daemon=True)
        self._in_prefill: frozenset[int] = frozenset()
        self._ctx: Context | None = None
        self._gens: dict[int, _Generation] = {}
        self._deferred: dict[int, list[tuple[int, ...]]] = defaultdict(list)
        self._out: dict[Portal, list[tuple[Sink, Delta]]] = {}
        self._counters = _Counters()
        self._step_counts = [0] * (len(STEP_BUCKETS) + 1)

    # caller side (any thread)

    def start(self) -> None:
        _live_loops.add(self)
        self._thread.start()

    def wait_ready(self) -> None:
        """Block until the model is loaded; re-raise a load failure."""
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def send(self, command: Command) -> None:
        """Queue a command; never blocks. A cancel of a sequence being prefilled aborts the decode."""
        if self.dead is not None:
            raise self.dead
        self._commands.put(command)
        if self.dead is not None:  # it died meanwhile: the command may never be answered
            raise self.dead
        if isinstance(command, (Cancel, Close)) and command.conv in self._in_prefill:
            ctx = self._ctx
            if ctx is not None:
                ctx.request_abort()

    def shutdown(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._commands.put(Shutdown())
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # decode thread

    def _run(self) -> None:
        cfg = self.config
        model = ctx = batch = None
        try:
            try:
                model = Model(cfg.model_path, n_gpu_layers=cfg.n_gpu_layers)
                ctx = Context(model, n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_seq_max=cfg.n_seq_max,
                              n_threads=cfg.n_threads, kv_unified=True)
                batch = Batch(ctx.n_batch)
            except BaseException as exc:
                self._startup_error = exc
                return
            self.model, self._ctx = model, ctx
            self.scheduler = Scheduler(n_ctx=ctx.n_ctx, n_seq_max=ctx.n_seq_max, n_batch=ctx.n_batch,
                                       step_tokens=cfg.step_tokens)
            self._publish()
            self._ready.set()
            try:
                self._loop(ctx, batch)
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the streams
                self._die(exc)
        finally:
            self._ready.set()
            self._answer_leftovers(self.dead or EngineClosed("the engine is closed"))
            for gen in self._gens.values():
                gen.chain.close()
            self._gens.clear()
            self._ctx = None
            for handle in (batch, ctx, model):
                if handle is not None:
                    handle.close()
            _live_loops.discard(self)

    def _loop(self, ctx: Context, batch: Batch) -> None:
        sched = self.scheduler
        counters = self._counters
        no_slot_streak = 0
        while True:
            if not self._drain(block=not sched.busy):
                return
            t0 = time.perf_counter()
            plan = sched.schedule()
            self._apply(ctx, plan)
            self._note_admissions()
            if not plan.rows:
                self._publish()
                self._flush()
                continue
            batch.clear()
            outputs: list[tuple[int, int]] = []
            for row in plan.rows:
                last = batch.add_tokens(row.tokens, row.pos, row.seq_id, output_last=row.logits)
                if row.logits:
                    outputs.append((row.conv, last))
            self._in_prefill = frozenset(r.conv for r in plan.rows if len(r.tokens) > 1)
            self._publish()  # admissions show while a long decode runs
            ctx.clear_abort()
            t1 = time.perf_counter()
            status = ctx.decode(batch)
            t2 = time.perf_counter()
            self._in_prefill = frozenset()
            counters.decode_steps += 1
            counters.decode_seconds += t2 - t1
            if status is DecodeStatus.OK:
                no_slot_streak = 0
                sched.commit(plan)
                counters.tokens_evaluated += plan.n_tokens
                for conv, index in outputs:
                    self._sample(ctx, conv, index)
            elif status is DecodeStatus.NO_KV_SLOT:
                # Planning keeps batches within the free cells, so this is rare: free cells by
                # force and retry; give up only if it keeps happening with nothing left to free.
                no_slot_streak = 0 if sched.make_room() else no_slot_streak + 1
                if no_slot_streak > MAX_NO_SLOT_RETRIES:
                    raise DecodeError("llama.cpp keeps finding no KV slot and nothing can be freed")
            elif status is DecodeStatus.ABORTED or status.is_fatal:
                counters.aborted_steps += status is DecodeStatus.ABORTED
                for row in plan.rows:
                    sched.resync(row.conv, ctx.seq_pos_max(row.seq_id) + 1)
                if status.is_fatal:
                    raise DecodeError(f"llama_decode failed: {status.name}")
            else:
                raise DecodeError(f"llama_decode rejected a planned batch: {status.name}")
            elapsed = time.perf_counter() - t0
            counters.step_seconds += elapsed
            self._step_counts[bisect.bisect_left(STEP_BUCKETS, elapsed)] += 1
            self._publish()  # before the hop, so that a woken consumer sees this step's numbers
            self._flush()

    def _drain(self, block: bool) -> bool:
        """Run queued commands; False once shutdown is asked for."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, Shutdown):
                closed = EngineClosed("the engine was closed while this stream ran")
                for conv in list(self._gens):
                    self._end(conv, "cancelled", Delta(error=closed))
                self._publish()
                self._flush()
                return False
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, command: Command) -> None:
        sched = self.scheduler
        if isinstance(command, NewConversation):
            sched.add(command.conv, command.tokens)
        elif isinstance(command, Prompt):
            if command.conv in self._gens:
                self._deferred[command.conv].append(command.tokens)  # after the generation ends
            elif command.conv in sched:
                sched.append(command.conv, command.tokens)
        elif isinstance(command, Fork):
            if command.parent in sched:
                child = sched.fork(command.parent, command.child)
                for tokens in self._deferred.get(command.parent, ()):
                    child.tokens.extend(tokens)
        elif isinstance(command, Generate):
            self._generate(command)
        elif isinstance(command, Cancel):
            if command.conv in self._gens:
                self._end(command.conv, "cancelled")
        elif isinstance(command, Close):
            if command.conv in self._gens:
                self._end(command.conv, "cancelled")
            if command.conv in sched:
                sched.remove(command.conv)
            self._deferred.pop(command.conv, None)
            if command.ack is not None:
                self._emit(command.ack, Delta(finish_reason="closed"))

    def _generate(self, command: Generate) -> None:
        sched, conv = self.scheduler, command.conv
        error: BaseException | None = None
        if conv not in sched:
            error = ConversationClosed("the conversation is closed")
        elif conv in self._gens:
            error = InvalidRequestError("the conversation is already generating; finish or cancel that stream first")
        if error is None:
            assert self.model is not None
            try:
                chain = build_chain(self.model.vocab, command.params, sched.get(conv).tokens)
            except AiollamaError as exc:
                error = exc
        if error is None:
            try:
                sched.submit(conv)
            except AiollamaError as exc:
                chain.close()
                error = exc
        if error is not None:
            self.admission.leave()
            self._emit(command.sink, Delta(error=error))
            return
        self._gens[conv] = _Generation(command.params, chain, command.sink, TextAssembler(command.params.stop))

    def _note_admissions(self) -> None:
        for conv, gen in self._gens.items():
            if gen.queued and self.scheduler.get(conv).phase is Phase.RUNNING:
                gen.queued = False
                self.admission.leave()

    def _apply(self, ctx: Context, plan: Plan) -> None:
        for op in plan.ops:
            if isinstance(op, Remove):
                ctx.seq_rm(op.seq_id, op.p0, -1)
            elif isinstance(op, Copy):
                ctx.seq_cp(op.src, op.dst, 0, op.n)

    def _sample(self, ctx: Context, conv: int, index: int) -> None:
        gen = self._gens[conv]
        assert self.model is not None
        vocab = self.model.vocab
        token = gen.chain.sample(ctx, index)
        gen.n_generated += 1
        self._counters.tokens_generated += 1
        self.scheduler.add_token(conv, token)
        finish: str | None = None
        tokens: tuple[int, ...]
        if vocab.is_eog(token) and not gen.params.ignore_eos:
            text, tokens, finish = gen.text.finish(), (), "eog"
        else:
            text, tokens = gen.text.feed(vocab.token_to_piece(token)), (token,)
            if gen.text.stopped:
                finish = "stop"
            elif (gen.n_generated >= gen.params.max_tokens
                  or len(self.scheduler.get(conv).tokens) >= self.scheduler.n_ctx):
                finish = "length"
                text += gen.text.finish()
        if finish is None:
            self._emit(gen.sink, Delta(text, tokens))
        else:
            self._end(conv, finish, Delta(text, tokens, finish))

    def _end(self, conv: int, reason: str, last: Delta | None = None) -> None:
        """The generation of ``conv`` is over: tell its stream, free its sampler, keep its KV."""
        gen = self._gens.pop(conv)
        if gen.queued:
            self.admission.leave()
        self._emit(gen.sink, last if last is not None else Delta(finish_reason=reason))
        gen.chain.close()
        self.scheduler.finish(conv)
        for tokens in self._deferred.pop(conv, ()):
            self.scheduler.append(conv, tokens)

    def _emit(self, sink: Sink, delta: Delta) -> None:
        self._out.setdefault(sink.portal, []).append((sink, delta))

    def _flush(self) -> None:
        """One hop per consumer loop for everything this step produced."""
        out, self._out = self._out, {}
        for portal, items in out.items():
            if not portal.send(_Dispatch(items)):
                self._orphaned(portal)

    def _orphaned(self, portal: Portal) -> None:
        """The event loop behind ``portal`` has closed: end its generations, nobody reads them."""
        for conv in [c for c, gen in self._gens.items() if gen.sink.portal is portal]:
            self._end(conv, "cancelled")
        self._out.pop(portal, None)
        self._publish()

    def _publish(self) -> None:
        c = self.scheduler.counts()
        self.statistics = Statistics(
            live=c.live, active=c.active, queued=c.queued, kv_cells_used=c.kv_cells_used,
            kv_cells_total=c.kv_cells_total, seq_ids_used=c.seq_ids_used,
            n_seq_max=self.config.n_seq_max if self._ctx is None else self._ctx.n_seq_max,
            step_histogram=tuple(self._step_counts),
            **vars(self._counters))  # a flat copy; asdict would deep-copy every step

    def _die(self, exc: BaseException) -> None:
        dead = EngineDead(f"the decode thread failed: {exc!r}")
        dead.__cause__ = exc
        self.dead = dead
        for gen in self._gens.values():
            self._emit(gen.sink, Delta(error=dead))
        self._flush()

    def _answer_leftovers(self, error: AiollamaError) -> None:
        """Commands that arrived after the loop stopped still get an answer."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Generate):
                self._emit(command.sink, Delta(error=error))
            elif isinstance(command, Close) and command.ack is not None:
                self._emit(command.ack, Delta(finish_reason="closed"))
        self._flush()


@dataclass(frozen=True)
class _Dispatch:
    items: list[tuple[Sink, Delta]] = field(default_factory=list)

    def __call__(self) -> None:
        for sink, delta in self.items:
            sink.deliver(delta)
