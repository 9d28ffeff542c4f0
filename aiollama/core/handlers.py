"""Callers' commands, applied by the decode thread between steps: one handler per command type,
in one table. Commands of conversations that are gone are ignored (a close races everything), and
every command that waits for an answer gets one, an error included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from aiollama.config import EngineConfig
from aiollama.core.commands import (
    Admission,
    Cancel,
    ClearCache,
    Close,
    Command,
    Embed,
    Fork,
    Generate,
    Load,
    NewConversation,
    Prompt,
    Rewind,
    Save,
)
from aiollama.core.generations import Generations
from aiollama.core.outbox import Outbox
from aiollama.core.outputs import Ack, Delta, FinishReason, Snapshot, Vectors
from aiollama.errors import AiollamaError, ConversationBusy, ConversationClosed
from aiollama.sched import Scheduler
from aiollama.sched.step import Executor, Plan


class Core(Protocol):
    """What the handlers use of :class:`~aiollama.core.engine_core.EngineCore`."""

    executor: Executor
    config: EngineConfig
    admission: Admission
    scheduler: Scheduler
    generations: Generations
    outbox: Outbox

    def end(self, conv: int, reason: FinishReason | None = None, error: BaseException | None = None,
            past_end: int = 0) -> None: ...


class Handlers:
    """The handler of each command type, over one engine core."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._table: dict[type, Callable[[Any], None]] = {
            NewConversation: self._new, Prompt: self._prompt, Fork: self._fork, Generate: self._generate,
            Cancel: self._cancel, Close: self._close, Rewind: self._rewind, Save: self._save, Load: self._load,
            Embed: self._embed, ClearCache: self._clear_cache,
        }

    def __call__(self, command: Command) -> None:
        self._table[type(command)](command)

    def _new(self, command: NewConversation) -> None:
        self.core.scheduler.add(command.conv, command.tokens, command.salt, command.lora)

    def _prompt(self, command: Prompt) -> None:
        sched, gens = self.core.scheduler, self.core.generations
        if command.images and command.conv in sched:
            sched.add_images(command.conv, command.images)
        if command.conv in sched and not gens.defer(command.conv, command.tokens):
            sched.append(command.conv, command.tokens)

    def _fork(self, command: Fork) -> None:
        if command.parent in self.core.scheduler:
            self.core.scheduler.fork(command.parent, command.child, command.n_tokens)

    def _cancel(self, command: Cancel) -> None:
        if command.conv in self.core.generations:
            self.core.end(command.conv, FinishReason.CANCELLED)

    def _close(self, command: Close) -> None:
        core, sched, gens = self.core, self.core.scheduler, self.core.generations
        if command.conv in gens:
            core.end(command.conv, FinishReason.CANCELLED)
        guided = gens.guided_by(command.conv)
        if guided is not None:
            core.end(guided, error=ConversationClosed("the conversation guiding this one was closed"))
        if command.conv in sched:
            sched.remove(command.conv)
        gens.forget(command.conv)
        if command.ack is not None:
            core.outbox.emit(command.ack, Ack())

    def _rewind(self, command: Rewind) -> None:
        sched, gens = self.core.scheduler, self.core.generations
        if command.conv in sched and command.conv not in gens and gens.guided_by(command.conv) is None:
            sched.rewind(command.conv, command.n_tokens)

    def _embed(self, command: Embed) -> None:
        try:
            self.core.outbox.emit(command.sink, Vectors(self.core.executor.embed(command.texts, command.normalize)))
        except AiollamaError as exc:
            self.core.outbox.emit(command.sink, Delta(error=exc))

    def _clear_cache(self, command: ClearCache) -> None:
        self.core.scheduler.clear_cache()
        self.core.outbox.emit(command.ack, Ack())

    def _generate(self, command: Generate) -> None:
        conv = command.conv
        try:
            if conv not in self.core.scheduler:
                raise ConversationClosed("the conversation is closed")
            if conv in self.core.generations:
                raise ConversationBusy("the conversation is already generating: read that stream to its "
                                       "end or cancel it first")
            if self.core.generations.guided_by(conv) is not None:
                raise ConversationBusy("the conversation guides another one's stream: wait for that to end")
            if command.lora is not None:
                self.core.scheduler.set_lora(conv, command.lora)
            guide = command.guide
            if guide is not None:
                self._check_guide(conv, guide)
            params = command.params
            shifts = self.core.config.context_shift if params.context_shift is None else params.context_shift
            shifts = shifts and guide is None  # the two histories stay in step
            n_keep = self.core.config.n_keep if params.n_keep is None else params.n_keep
            draft = self.core.config.draft_tokens if params.draft_tokens is None else params.draft_tokens
            if command.matcher is not None:  # a constraint's mask needs the tokens before it: one row at a time
                draft = 0
            self.core.executor.start_sampling(conv, params, self.core.scheduler.tokens(conv), command.matcher,
                                         guidance=None if guide is None else (guide, command.guidance_scale))
            try:
                dropped = self.core.scheduler.submit(conv, n_keep if shifts else None, draft, priority=params.priority,
                                                guide=guide, score=params.prompt_logprobs is not None,
                                                max_tokens=params.max_tokens)
            except BaseException:
                self.core.executor.stop_sampling(conv)
                raise
        except AiollamaError as exc:
            self.core.admission.leave()
            self.core.outbox.emit(command.sink, Delta(error=exc))
            return
        self.core.generations.start(conv, params, command.sink, shifts=shifts, dropped=dropped, guide=guide,
                               created=command.created, prompt=self.core.scheduler.length(conv))

    def _check_guide(self, conv: int, guide: int) -> None:
        if guide not in self.core.scheduler:
            raise ConversationClosed("the guidance conversation is closed")
        if guide in self.core.generations or self.core.generations.guided_by(guide) is not None:
            raise ConversationBusy("the guidance conversation is generating or guiding another stream")

    def _sync_kv(self) -> None:
        """Apply the KV operations decided since the last step (between steps, before reading or
        writing a sequence's cells directly)."""
        plan = Plan(self.core.scheduler.take_ops())
        if plan.ops:
            self.core.scheduler.update(plan, self.core.executor.execute(plan))

    def _save(self, command: Save) -> None:
        if command.conv not in self.core.scheduler:
            self.core.outbox.emit(command.sink, Delta(error=ConversationClosed("the conversation is closed")))
            return
        self._sync_kv()
        held = self.core.scheduler.held(command.conv)
        state = held.parked or b""
        if held.seq_id is not None:
            state = self.core.executor.read_state(held.seq_id)
        self.core.outbox.emit(command.sink, Snapshot(held.tokens, held.n_cached if state else 0, state,
                                                     dict(held.images)))

    def _load(self, command: Load) -> None:
        sched = self.core.scheduler
        n_cached = command.n_cached if command.state else 0
        seq_id = sched.place(command.conv, command.tokens, command.images, n_cached)
        if seq_id is not None:
            self._sync_kv()  # evictions first: they may have freed the very seq id now assigned
            ok = self.core.executor.write_state(seq_id, command.state)
            sched.placed(command.conv, n_cached, ok)
            if not ok:
                self._sync_kv()
        self.core.outbox.emit(command.sink, Ack())
