"""The callers' side of one engine: what every conversation of it shares.

:class:`EngineClient` sends commands to the decode thread, hands out conversation ids, counts
queued generations, and tokenizes on the caller's thread. It is the only thing conversations talk
to; nothing here runs on the decode thread or calls llama.cpp, except the thread-safe tokenizer.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiollama.api.images import Image, ImageEncoder
from aiollama.api.portal import AsyncioPortal, AsyncSink, TrioPortal, current_portal
from aiollama.config import EngineConfig
from aiollama.core.commands import Admission, Command
from aiollama.core.loop import DecodeLoop
from aiollama.core.outputs import Item, Statistics
from aiollama.errors import (
    ContextFull,
    EngineClosed,
    EngineDead,
    ImageError,
    InvalidRequestError,
    WrongEventLoop,
)
from aiollama.formats import constraints, reasoning
from aiollama.formats.chat import ChatTemplate, Segment, chat_tokens
from aiollama.formats.tokens import Tokenizer
from aiollama.sampling import SamplingParams
from aiollama.sched.step import Executor


class EngineClient:
    """Starts and stops the decode thread, and carries every caller's request to it.

    ``owner`` is the event loop (or trio token) of an async engine: calls from anywhere else raise
    ``WrongEventLoop``. None serves plain threads.
    """

    def __init__(self, config: EngineConfig, open_executor: Callable[[], Executor], owner: Any = None) -> None:
        self.config = config
        self.owner = owner
        self.admission = Admission(config.max_queued)
        self.decode_loop = DecodeLoop(config, open_executor, self.admission)
        self.closed = False
        self._ids = itertools.count(1)
        self.conversations: weakref.WeakSet[Any] = weakref.WeakSet()  # every Conversation made, until collected
        self._tokenizer: Tokenizer | None = None
        self._chat_template: ChatTemplate | None = None
        self._thinking: tuple[int, int] | None | bool = False  # False: not looked up yet

    # lifetime

    def start(self) -> None:
        """Open the executor on the decode thread; blocks until it is ready, re-raises its failure."""
        self.decode_loop.start()
        try:
            self.decode_loop.wait_ready()
        except BaseException:
            self.close()  # the decode thread has already ended; nothing stays open
            raise
        self._tokenizer = self.decode_loop.tokenizer
        self.images = ImageEncoder(self.decode_loop.projector)
        if self.config.chat_template is not None:  # a template given by hand is read now: a broken one fails the start
            try:
                _ = self.chat_template
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Stop the decode thread (running streams end with EngineClosed); raises EngineDead if it
        had failed."""
        self.closed = True
        self.decode_loop.shutdown()
        if self.decode_loop.dead is not None:
            raise self.decode_loop.dead

    def close_nowait(self) -> None:
        """Ask the decode thread to stop without waiting for it (from a finalizer, say)."""
        self.closed = True
        self.decode_loop.shutdown(timeout=0)

    @property
    def dead(self) -> EngineDead | None:
        return self.decode_loop.dead

    @property
    def usable(self) -> bool:
        return not self.closed and self.decode_loop.dead is None and self.decode_loop.alive

    def check(self) -> None:
        """Raise unless the engine can take requests."""
        if self.decode_loop.dead is not None:
            raise self.decode_loop.dead
        if self.closed or self._tokenizer is None:
            raise EngineClosed("the engine is closed" if self.closed else "the engine is not started")

    def check_loop(self) -> AsyncioPortal | TrioPortal:
        """The caller's portal; WrongEventLoop if an async engine is used outside its own loop."""
        portal = current_portal()
        if self.owner is not None and portal.owner is not self.owner:
            raise WrongEventLoop("this engine belongs to the event loop that started it; start one "
                                 "engine per event loop, or use SyncEngine from threads")
        return portal

    def failure(self) -> BaseException | None:
        """None while the decode thread runs; otherwise what a caller still waiting on it gets (it
        answers every request before it ends, so this only matters if it could not)."""
        loop = self.decode_loop
        if loop.alive:
            return None
        return loop.dead or EngineClosed("the engine stopped before it answered")

    def async_sink(self, on_item: Callable[[Item], None] | None = None) -> AsyncSink:
        """An inbox on the caller's event loop (WrongEventLoop elsewhere) that a waiting reader
        leaves with the engine's error if the engine ends without answering."""
        return AsyncSink(self.check_loop(), on_item, self.failure)

    def send(self, command: Command) -> None:
        self.check()
        self.decode_loop.send(command)

    def new_id(self) -> int:
        return next(self._ids)

    def open_conversations(self) -> int:
        """Conversations made and not closed (nor collected), counted on the callers' side: at once,
        where the decode thread's ``live`` counts them after its next step."""
        return sum(1 for conv in list(self.conversations) if not conv.closed)

    def statistics(self) -> Statistics:
        return self.decode_loop.statistics

    @property
    def n_ctx(self) -> int:
        return self.decode_loop.n_ctx

    @property
    def fingerprint(self) -> Mapping[str, str | int]:
        """What a saved conversation must match to be loaded here."""
        return self.decode_loop.fingerprint

    @property
    def model_info(self) -> Mapping[str, str | int]:
        return self.decode_loop.model_info

    # tokens

    @property
    def tokenizer(self) -> Tokenizer:
        self.check()
        assert self._tokenizer is not None
        return self._tokenizer

    def tokenize(self, text: str, *, add_special: bool, special: bool) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special, special=special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        return self.tokenizer.detokenize(tokens, special=special)

    def encode(self, content: str | Sequence[int], *, first: bool, special: bool) -> list[int]:
        """Token ids for a prompt: text is tokenized (BOS on the first prompt), ids are checked."""
        if isinstance(content, str):
            return self.tokenize(content, add_special=first, special=special)
        if isinstance(content, (bytes, bytearray)) or not isinstance(content, Sequence):
            raise InvalidRequestError(f"a prompt is text or a sequence of token ids, got {type(content).__name__}")
        tokenizer = self.tokenizer
        return [tokenizer.check_token(t) for t in content]

    def check_prompt(self, tokens: list[int]) -> None:
        if len(tokens) >= self.n_ctx:
            raise ContextFull(f"a prompt of {len(tokens)} tokens does not fit a context of {self.n_ctx} "
                              "with room to generate", n_prompt_tokens=len(tokens), n_ctx=self.n_ctx)
        if tokens[-1] < 0:
            raise ImageError("a prompt must not end with an image: give some text after it")

    def prompt_tokens(self, content: Any, *, first: bool, special: bool) -> tuple[list[int], dict[int, Any]]:
        """Tokens for a prompt of text, token ids, or a list of parts (text, Image, token id), and
        the rows of the images among them by image number."""
        if isinstance(content, (list, tuple)) and any(isinstance(p, (str, Image)) for p in content):
            tokens: list[int] = []
            images: dict[int, Any] = {}
            for part in content:
                if isinstance(part, Image):
                    if first and not tokens and self.tokenizer.add_bos and self.tokenizer.bos >= 0:
                        tokens.append(self.tokenizer.bos)  # as a first text part begins, and as libmtmd does
                    got, rows = self.images.tokens(part)
                    tokens += got
                    images.update(rows)
                elif isinstance(part, str):
                    tokens += self.tokenize(part, add_special=first and not tokens, special=special)
                else:
                    tokens.append(self.tokenizer.check_token(part))
            return tokens, images
        return self.encode(content, first=first, special=special), {}

    @property
    def thinking_tokens(self) -> tuple[int, int] | None:
        """The tokens ``<think>`` and ``</think>`` of a reasoning model (each one token of its
        vocabulary), or None."""
        if self._thinking is False:
            tokenizer, found = self.tokenizer, []
            for marker in (reasoning.START, reasoning.END):
                ids = tokenizer.tokenize(marker, add_special=False, special=True)
                if len(ids) == 1 and tokenizer.token_text(ids[0]) == marker:
                    found.append(ids[0])
            self._thinking = (found[0], found[1]) if len(found) == 2 else None
        assert self._thinking is not True
        return self._thinking

    def generation_start(self, prompt_tail: Sequence[int], guide_tail: Sequence[int] = ()) -> bool:
        """Whether a prompt ending with these tokens leaves the model inside a thinking block.
        Raises ImageError where a history (or the guiding one's) ends inside a picture."""
        if prompt_tail[-1:] and prompt_tail[-1] < 0 or guide_tail[-1:] and guide_tail[-1] < 0:
            raise ImageError("the history ends with a picture's rows (a rewind cut into it): prompt text first")
        return reasoning.opened(self.detokenize(prompt_tail))

    def constraint(self, params: SamplingParams, *, inside_thinking: bool = False) -> Any:
        """The compiled constraint (an llguidance matcher) ``params`` ask for, or None. Raises
        GrammarError if it does not compile: a stream never runs unconstrained by mistake. For a
        reasoning model the constraint starts after the thinking block (``inside_thinking``: the
        prompt opened it)."""
        return constraints.compile_for(params, lambda: self.tokenizer.guidance(), thinking=self.thinking_tokens,
                                       inside=inside_thinking)

    # chat

    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template, rendered by llama.cpp (built on first use): the engine's
        ``chat_template`` option, else the GGUF's own (ChatML where it has none, as llama-server).
        Raises ChatTemplateError for a template llama.cpp cannot read."""
        if self._chat_template is None:
            self._chat_template = ChatTemplate.of(self.tokenizer, self.config.chat_template,
                                                  reasoning=self.config.reasoning)
        return self._chat_template

    def chat_tokens(self, parts: list[Segment], *, first: bool, images: Sequence[list[int]] = ()) -> list[int]:
        """Tokens of rendered chat text: split only at the template's own special tokens."""
        return chat_tokens(self.tokenizer, parts, first=first, images=images)
