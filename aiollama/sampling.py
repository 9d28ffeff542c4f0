"""Generation parameters: validated where the caller passes them, applied on the decode thread."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from aiollama._validate import SEED_MAX, integer, number
from aiollama.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20  # as OpenAI


def seed_for(seed: int, index: int) -> int:
    """The seed of choice ``index`` when one request of several choices gives one ``seed``."""
    return (seed + index) % (SEED_MAX + 1)


def wrap_seed(seed: int) -> int:
    """Any integer (an OpenAI ``seed`` may be negative or 64-bit) as a valid seed."""
    return seed % (SEED_MAX + 1)


MAX_DRAFT_TOKENS = 32
PRIORITY_LIMIT = 2**31

# ``fn(tokens, logits)``: the history so far and the row (float32, writable, n_vocab long), changed in
# place; a returned array of the row's shape replaces the row instead.
LogitsProcessor = Callable[[tuple[int, ...], "np.ndarray"], Any]


@dataclass(frozen=True)
class SamplingParams:
    """How one stream chooses its tokens.

    ``max_tokens`` None generates until the model ends its turn or the context is full.
    ``temperature`` 0 means greedy. The penalties look at the last ``penalty_last_n`` tokens of the
    conversation, prompt included. ``seed`` None picks a random seed. ``stop`` strings end the stream
    and are never emitted. ``context_shift`` and ``n_keep`` choose what happens when the history
    outgrows the context (None: the engine's setting). ``draft_tokens`` > 0 decodes with n-gram
    drafts of up to that many tokens a step (0: none; None: the engine's setting); the text is the
    same, only the steps fewer.

    Constraints (at most one): ``grammar`` is GBNF text; ``json_schema`` a JSON schema (a dict, its
    JSON text, or a class with ``model_json_schema()``, such as a Pydantic model); ``regex`` a regular
    expression; ``lark`` a Lark grammar (llguidance's dialect). A constrained stream ends when the
    text is complete (or with ``length``). ``logprobs`` puts each token's log-probability on the
    chunks, with its ``top_logprobs`` most likely alternatives.

    ``logits_processors`` are functions ``fn(tokens, logits)`` called in order on the decode thread
    before the sampler chain, with the history (a tuple of token ids) and the logits row (a
    writable float32 numpy array, ``n_vocab`` long) to change in place (or a returned array of the
    same shape). ``priority`` orders admission, prompt evaluation and preemption: lower values
    first, equal values first come first served; a waiting stream's priority improves with the
    time it waits, so none waits forever.

    ``reasoning_budget`` bounds a thinking block (``<think>``...``</think>``, opened by the
    template or by the model): after that many tokens in it, the engine writes
    ``reasoning_budget_message`` and the closing marker itself, and the model answers after them.
    0 closes the block at once; None leaves it to the model.

    ``prompt_logprobs`` (0 to 20 alternatives) scores the prompt: the log-probability of each of its
    tokens after the first, given those before it, computed in the same decode steps as everything
    else. The prompt is then evaluated whole (no cached prefix has logits).

    ``prompt_progress`` delivers, while the prompt is evaluated (in chunks of the step budget),
    chunks with no text whose ``progress`` is (prompt tokens, of those found in the cache, of those
    evaluated so far), as llama-server's ``return_progress``.

    ``thinking_tags`` are the markers (opening, closing) of the model's thinking block that
    ``reasoning_budget`` counts in (a chat turn sets its format's; else ``<think>`` and
    ``</think>``, or gpt-oss's analysis channel).

    ``grammar_prefill`` is text the ``grammar`` takes as already generated before the first token
    (special tokens parsed): the generation prompt a chat template wrote, where llama.cpp's
    grammar of a tool call begins with it. ``preserved_tokens`` are token texts the stream's text
    shows even where they are control tokens (a model format's markers, which its parser reads);
    a chat turn sets both.

    Every field is checked on creation and a bad one raises ``InvalidRequestError`` (a
    ``ValueError``) naming it.
    """

    max_tokens: int | None = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    grammar: str | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    context_shift: bool | None = None
    n_keep: int | None = None
    draft_tokens: int | None = None
    json_schema: Any = None
    regex: str | None = None
    lark: str | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    logits_processors: tuple[LogitsProcessor, ...] = ()
    priority: int = 0
    reasoning_budget: int | None = None
    reasoning_budget_message: str = ""
    prompt_logprobs: int | None = None
    grammar_prefill: str = ""
    preserved_tokens: tuple[str, ...] = ()
    thinking_tags: tuple[str, ...] = ()
    prompt_progress: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            integer("max_tokens", self.max_tokens, low=1, high=2**31 - 1)
        number("temperature", self.temperature, low=0.0)
        integer("top_k", self.top_k, low=0, high=2**31 - 1)
        number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        number("min_p", self.min_p, low=0.0, high=1.0)
        number("typical_p", self.typical_p, low=0.0, high=1.0, low_open=True)
        number("repeat_penalty", self.repeat_penalty, low=0.0, low_open=True)
        number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        integer("penalty_last_n", self.penalty_last_n, low=-1, high=2**31 - 1)
        if self.seed is not None:
            integer("seed", self.seed, low=0, high=SEED_MAX)
        if not isinstance(self.logit_bias, Mapping):
            raise InvalidRequestError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}",
                                      param="logit_bias")
        for token, bias in self.logit_bias.items():
            integer("logit_bias token", token, low=0)
            if not (isinstance(bias, (int, float)) and not isinstance(bias, bool)) or math.isnan(bias):
                raise InvalidRequestError(f"logit_bias value for token {token} must be a number, got {bias!r}",
                                          param="logit_bias")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise InvalidRequestError("grammar must be a non-empty GBNF string", param="grammar")
        stop: Any = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}",
                                      param="stop")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}", param="ignore_eos")
        if self.context_shift is not None and not isinstance(self.context_shift, bool):
            raise InvalidRequestError(f"context_shift must be a bool or None, got {self.context_shift!r}",
                                      param="context_shift")
        if self.n_keep is not None:
            integer("n_keep", self.n_keep, low=0)
        if self.draft_tokens is not None:
            integer("draft_tokens", self.draft_tokens, low=0, high=MAX_DRAFT_TOKENS)
        self._check_constraint()
        if not isinstance(self.logprobs, bool):
            raise InvalidRequestError(f"logprobs must be a bool, got {self.logprobs!r}", param="logprobs")
        integer("top_logprobs", self.top_logprobs, low=0, high=MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=True", param="top_logprobs")
        processors: Any = self.logits_processors
        if callable(processors):
            processors = (processors,)
        if not isinstance(processors, Sequence) or isinstance(processors, str) \
                or not all(callable(fn) for fn in processors):
            raise InvalidRequestError(f"logits_processors must be a list of functions fn(tokens, logits), "
                                      f"got {self.logits_processors!r}", param="logits_processors")
        object.__setattr__(self, "logits_processors", tuple(processors))
        integer("priority", self.priority, low=-PRIORITY_LIMIT, high=PRIORITY_LIMIT - 1)
        if self.reasoning_budget is not None:
            integer("reasoning_budget", self.reasoning_budget, low=0, high=2**31 - 1)
        if self.prompt_logprobs is not None:
            integer("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_TOP_LOGPROBS)
        if not isinstance(self.reasoning_budget_message, str):
            raise InvalidRequestError(f"reasoning_budget_message must be a str, got {self.reasoning_budget_message!r}",
                                      param="reasoning_budget_message")
        if not isinstance(self.prompt_progress, bool):
            raise InvalidRequestError(f"prompt_progress must be a bool, got {self.prompt_progress!r}",
                                      param="prompt_progress")
        if not isinstance(self.grammar_prefill, str):
            raise InvalidRequestError(f"grammar_prefill must be a str, got {self.grammar_prefill!r}",
                                      param="grammar_prefill")
        if self.grammar_prefill and self.grammar is None:
            raise InvalidRequestError("grammar_prefill needs a grammar", param="grammar_prefill")
        preserved: Any = self.preserved_tokens
        if not isinstance(preserved, Sequence) or isinstance(preserved, str) or \
                not all(isinstance(t, str) and t for t in preserved):
            raise InvalidRequestError(f"preserved_tokens must be a list of token texts, got {self.preserved_tokens!r}",
                                      param="preserved_tokens")
        object.__setattr__(self, "preserved_tokens", tuple(preserved))
        tags: Any = self.thinking_tags
        if not isinstance(tags, Sequence) or isinstance(tags, str) or len(tags) not in (0, 2) or \
                not all(isinstance(t, str) and t.strip() for t in tags):
            raise InvalidRequestError(f"thinking_tags must be (opening, closing) marker texts, got {self.thinking_tags!r}",
                                      param="thinking_tags")
        object.__setattr__(self, "thinking_tags", tuple(tags))

    def _check_constraint(self) -> None:
        given = [name for name in ("grammar", "json_schema", "regex", "lark") if getattr(self, name) is not None]
        if len(given) > 1:
            raise InvalidRequestError(f"give at most one constraint, got {', '.join(given)}", param=given[1])
        for name in ("regex", "lark"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string, got {value!r}", param=name)
        schema = self.json_schema
        if schema is None:
            return
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()  # a Pydantic model class
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"json_schema is not valid JSON: {exc}", param="json_schema") from None
        if not isinstance(schema, Mapping) and not isinstance(schema, bool):
            raise InvalidRequestError(f"json_schema must be a JSON object (a dict, its text or a Pydantic model), "
                                      f"got {type(self.json_schema).__name__}", param="json_schema")
        object.__setattr__(self, "json_schema", json.dumps(schema))  # one form from here on: JSON text

    @property
    def constrained(self) -> bool:
        """Whether the tokens must follow a grammar, a schema, a regex or a Lark grammar."""
        return self.grammar is not None or self.json_schema is not None or self.regex is not None \
            or self.lark is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0) and self.penalty_last_n != 0

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SamplingParams:
        """Build from keyword arguments; unknown names raise InvalidRequestError naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**kwargs)
