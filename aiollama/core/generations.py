"""Running generations and the rules that end them. Pure: no llama.cpp, no event loop.

A generation is one ``stream()`` of one conversation: its sampling parameters, where its output
goes, and the text assembled so far. Each sampled token becomes a :class:`~aiollama.core.outputs.Delta`
for its stream, and ends the generation when:

- it is an end-of-generation token (unless ``ignore_eos``): ``EOG``, the token is not shown;
- the text now holds a stop string: ``STOP``, the text stops before it;
- ``max_tokens`` tokens were generated, or the history fills the context (unless the generation
  shifts its context instead): ``LENGTH``.

Prompts sent while a conversation generates wait here and are appended once the generation ends,
so a conversation's commands keep their order.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from aiollama.core.commands import Admission, Portal, Sink
from aiollama.core.outbox import Outbox
from aiollama.core.outputs import Delta, FinishReason, GenerationStats, TokenLogprob
from aiollama.formats.text import TextAssembler
from aiollama.sampling import SamplingParams
from aiollama.sched import Progress
from aiollama.sched.step import Sampled, Scored, StepResult


class Histories(Protocol):
    """What the finish rules read of the conversations' histories (the scheduler's face)."""

    def length(self, conv: int) -> int: ...

    def progress(self, conv: int) -> Progress: ...


@dataclass(eq=False)
class Generation:
    params: SamplingParams
    sink: Sink
    text: TextAssembler
    shifts: bool = False  # a full context shifts instead of ending the generation
    n_generated: int = 0
    queued: bool = True  # counts against max_queued until admitted
    guide: int | None = None  # the conversation guiding this one's logits, which moves in lockstep
    created: float = 0.0  # when the caller asked (perf_counter)
    admitted_at: float = 0.0  # when it first got a sequence (0: not yet)
    first_at: float = 0.0  # when its first token came (0: not yet)
    decode_steps: int = 0
    stepped_at: float = 0.0  # the step that last gave it tokens
    scored: int = 0  # prompt scoring: positions whose following token's log-probability was sent
    score_end: int = 0  # ... up to here (the prompt's length less one); 0: no scoring
    progress: int = -1  # prompt progress asked for: the cells last told (-1: not asked)
    prompt: int = 0  # the history's length when it began


def stats_of(seq: Progress, gen: Generation | None = None) -> GenerationStats:
    """What a generation cost, from where its conversation stands, timed up to now."""
    stats = GenerationStats(prompt_tokens=seq.prompt_tokens, cached_tokens=seq.cached_tokens,
                            preemptions=seq.preemptions, restores=seq.restores, drafted=seq.drafted,
                            accepted=seq.accepted, prompt_evaluated=seq.prompt_evaluated)
    if gen is None or not gen.created:
        return stats
    now = time.perf_counter()
    admitted = gen.admitted_at or now
    first = gen.first_at or now
    return dataclasses.replace(stats, decode_steps=gen.decode_steps, queue_seconds=admitted - gen.created,
                               prefill_seconds=first - admitted, decode_seconds=now - first)


class Generations:
    def __init__(self, admission: Admission, outbox: Outbox, n_ctx: int) -> None:
        self.admission = admission
        self.outbox = outbox
        self.n_ctx = n_ctx
        self._gens: dict[int, Generation] = {}
        self._deferred: dict[int, list[tuple[int, ...]]] = defaultdict(list)
        self._guides: dict[int, int] = {}  # guiding conversation -> the generation it guides
        self._progress: set[int] = set()  # generations that report their prompt's evaluation
        self._fresh: set[int] = set()  # generations given their first token (see only_first_tokens)

    def __contains__(self, conv: int) -> bool:
        return conv in self._gens

    def __len__(self) -> int:
        return len(self._gens)

    def convs(self) -> list[int]:
        return list(self._gens)

    def start(self, conv: int, params: SamplingParams, sink: Sink, *, shifts: bool = False,
              dropped: tuple[int, int] | None = None, guide: int | None = None, created: float = 0.0,
              prompt: int = 0) -> None:
        """A generation begins; ``dropped``: the context shift its start made (told to its stream);
        ``guide``: the conversation that guides it (its prompts wait for this generation too);
        ``prompt``: the history's length, whose tokens are scored when the parameters ask."""
        self._gens[conv] = Generation(params, sink, TextAssembler(params.stop), shifts, guide=guide,
                                      created=created or time.perf_counter(),
                                      score_end=prompt - 1 if params.prompt_logprobs is not None else 0,
                                      progress=0 if params.prompt_progress else -1, prompt=prompt)
        if params.prompt_progress:
            self._progress.add(conv)
        if guide is not None:
            self._guides[guide] = conv
        if dropped is not None:
            self.outbox.emit(sink, Delta(dropped=dropped))

    def shifted(self, conv: int, keep: int, n: int) -> None:
        """The scheduler dropped tokens ``[keep, keep + n)`` of ``conv``'s history."""
        self.outbox.emit(self._gens[conv].sink, Delta(dropped=(keep, n)))

    def admitted(self, convs: tuple[int, ...]) -> None:
        """These generations got a seq id: they no longer count against ``max_queued``."""
        now = time.perf_counter()
        for conv in convs:
            gen = self._gens.get(conv)
            if gen is not None and gen.queued:
                gen.queued = False
                gen.admitted_at = now
                self.admission.leave()

    def defer(self, conv: int, tokens: tuple[int, ...]) -> bool:
        """Hold a prompt for a generating (or guiding) conversation until its generation ends;
        False if it is neither (append the prompt at once)."""
        if conv not in self._gens and conv not in self._guides:
            return False
        self._deferred[conv].append(tokens)
        return True

    def deferred(self, conv: int) -> list[tuple[int, ...]]:
        """The prompts waiting for ``conv``'s generation to end (a fork inherits them)."""
        return list(self._deferred.get(conv, ()))

    def update(self, result: StepResult, histories: Histories) -> dict[int, int]:
        """Turn the step's sampled tokens into deltas; return the conversations whose generation
        ended (call :meth:`end` for each, after the scheduler has seen the tokens), each with how
        many of its sampled tokens came after its end (a draft taken past a stop): the scheduler
        must drop those from the history."""
        ended: dict[int, int] = {}
        for conv, rows in result.scored.items():
            self._scored(conv, rows)
        if self._progress:
            self._report(histories)
        left = _counts(result.sampled)
        now = time.perf_counter()
        for sampled in result.sampled:
            conv = sampled.conv
            left[conv] -= 1
            if conv in ended:
                ended[conv] += 1
                continue
            gen = self._gens[conv]
            if gen.stepped_at != now:  # its first token this step
                if not gen.first_at:
                    gen.first_at = now
                    self._fresh.add(conv)
                gen.stepped_at = now
                gen.decode_steps += 1
            delta = self._next(gen, sampled, histories.length(conv) - left[conv])
            if delta.finish_reason is not None:
                delta = dataclasses.replace(delta, stats=stats_of(histories.progress(conv), gen))
                ended[conv] = 0
            self.outbox.emit(gen.sink, delta)
        return ended

    def only_first_tokens(self) -> bool:
        """Whether the updates since the last call gave every generation left (there is one at
        least) its first token: then no stream is waiting for the next step."""
        if not self._fresh:  # every step asks: most have nothing to forget
            return False
        fresh, self._fresh = self._fresh, set()
        return bool(self._gens) and all(conv in fresh for conv in self._gens)

    def ending(self, result: StepResult) -> frozenset[int]:
        """The conversations that ``result`` ends whatever their text says: an end of generation
        that counts, a complete constraint, ``max_tokens`` reached, or a row that gave no token (a
        logits processor raised). (A stop string is only known once the text is read.)"""
        counts = _counts(result.sampled)
        ending = set(result.failed)
        for sampled in result.sampled:
            gen = self._gens.get(sampled.conv)
            if gen is None:
                continue
            limit = gen.params.max_tokens
            if sampled.final or (sampled.eog and not gen.params.ignore_eos) or \
                    (limit is not None and gen.n_generated + counts[sampled.conv] >= limit):
                ending.add(sampled.conv)
        return frozenset(ending)

    def _report(self, histories: Histories) -> None:
        """The prompt progress of the generations that asked, where the step evaluated more of it."""
        for conv in list(self._progress):
            gen, seq = self._gens[conv], histories.progress(conv)
            if seq.prompt_tokens < 0:
                continue  # not admitted yet
            total = gen.prompt or seq.n_tokens
            done = min(seq.n_cached, total)
            if done > gen.progress:
                gen.progress = done
                self.outbox.emit(gen.sink, Delta(progress=(total, min(seq.cached_tokens, total), done)))
            if done >= total - 1:
                self._progress.discard(conv)

    def _scored(self, conv: int, rows: tuple[Scored, ...]) -> None:
        """Scored prompt rows, each position once and in order (a preempted prompt is evaluated
        again), become a delta of prompt log-probabilities."""
        gen = self._gens.get(conv)
        if gen is None:
            return
        fresh = tuple(TokenLogprob(token, logprob, top, rank) for pos, token, logprob, top, rank in rows
                      if gen.scored <= pos < gen.score_end)
        if fresh:
            gen.scored += len(fresh)
            self.outbox.emit(gen.sink, Delta(prompt_logprobs=fresh))

    def _next(self, gen: Generation, sampled: Sampled, history_len: int) -> Delta:
        gen.n_generated += 1
        token = (sampled.token,)
        logprobs = () if sampled.logprob is None else \
            (TokenLogprob(sampled.token, sampled.logprob, sampled.top_logprobs),)
        if sampled.eog and (sampled.final or not gen.params.ignore_eos):
            return Delta(gen.text.finish(), (), FinishReason.EOG, history=token)
        text = gen.text.feed(sampled.piece)
        if gen.text.stopped:
            return Delta(text, token, FinishReason.STOP, history=token, logprobs=logprobs, stop=gen.text.matched)
        if sampled.final:  # the constraint is complete
            return Delta(text + gen.text.finish(), token, FinishReason.EOG, history=token, logprobs=logprobs)
        limit = gen.params.max_tokens
        if (limit is not None and gen.n_generated >= limit) or (history_len >= self.n_ctx and not gen.shifts):
            return Delta(text + gen.text.finish(), token, FinishReason.LENGTH, history=token, logprobs=logprobs)
        return Delta(text, token, history=token, logprobs=logprobs)

    def end(self, conv: int, reason: FinishReason | None = None, error: BaseException | None = None,
            stats: GenerationStats | None = None) -> list[tuple[int, ...]]:
        """The generation of ``conv`` is over. With a ``reason`` (or ``error``) its stream is told so
        here; without, :meth:`update` already emitted its last delta. Returns the prompts that
        waited for it, to append now."""
        gen = self._gens.pop(conv)
        self._progress.discard(conv)
        if gen.queued:
            self.admission.leave()
        if reason is not None or error is not None:
            self.outbox.emit(gen.sink, Delta(finish_reason=reason, error=error, stats=stats))
        if gen.guide is not None:
            del self._guides[gen.guide]
        return self._deferred.pop(conv, [])

    def get(self, conv: int) -> Generation:
        return self._gens[conv]

    def guided_by(self, conv: int) -> int | None:
        """The generation ``conv`` guides, if any."""
        return self._guides.get(conv)

    def forget(self, conv: int) -> None:
        """The conversation is closed: drop the prompts it still had waiting."""
        self._deferred.pop(conv, None)

    def of_portal(self, portal: Portal) -> list[int]:
        """The generations whose stream lives behind ``portal``."""
        return [conv for conv, gen in self._gens.items() if gen.sink.portal is portal]


def _counts(sampled: Iterable[Sampled]) -> dict[int, int]:
    """How many of a step's tokens each conversation has (a plain dict: this runs every step)."""
    counts: dict[int, int] = {}
    for x in sampled:
        counts[x.conv] = counts.get(x.conv, 0) + 1
    return counts
