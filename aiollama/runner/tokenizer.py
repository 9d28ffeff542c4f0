"""The model's tokenizer for callers on any thread.

llama.cpp's tokenizer calls are thread-safe, so callers tokenize on their own thread and a long text
never stalls the decode loop. The decode thread owns the model and may close it at any moment, so
every call pins the native model for its duration; once the model is gone a call raises
``EngineClosed``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from aiollama.errors import ClosedError, EngineClosed
from aiollama.formats import constraints
from aiollama.formats.images import has_images, text_only
from aiollama.formats.tokens import SpecialToken
from aiollama.native import Vocab
from aiollama.native.binding import lib
from aiollama.native.chat import ChatTemplates


class VocabTokenizer:
    """:class:`~aiollama.sched.step.Tokenizer` over a :class:`~aiollama.native.Vocab`."""

    def __init__(self, vocab: Vocab) -> None:
        self._vocab = vocab
        self.n_vocab = vocab.n_tokens
        self.bos, self.eos, self.eot = vocab.bos, vocab.eos, vocab.eot
        self.add_bos = vocab.add_bos
        self.add_eos, self.add_sep, self.sep = vocab.add_eos, vocab.add_sep, vocab.sep
        self.rerank_template = vocab.chat_template("rerank")  # a reranker's pair, where the file has one
        self.fim = dict(vocab.fim)
        self._specials: list[SpecialToken] | None = None
        self._guidance: Any = None
        self._lock = threading.Lock()
        self._pieces: dict[int, bytes] = {}  # at most one entry per token of the vocabulary

    @contextlib.contextmanager
    def _pinned(self) -> Iterator[Vocab]:
        try:
            with self._vocab.pinned() as vocab:
                yield vocab
        except ClosedError:
            raise EngineClosed("the engine is closed") from None

    def tokenize(self, text: str, *, add_special: bool, special: bool) -> list[int]:
        with self._pinned() as vocab:
            return vocab.tokenize(text, add_special=add_special, parse_special=special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        if has_images(tokens):  # an image's placeholders have no text
            tokens = text_only(tokens)
        with self._pinned() as vocab:
            return vocab.detokenize(tokens, unparse_special=special)

    def check_token(self, token: object) -> int:
        return self._vocab.check_token(token)  # type: ignore[arg-type]

    def is_control(self, token: int) -> bool:
        with self._pinned() as vocab:
            return vocab.is_control(token)

    def token_text(self, token: int) -> str:
        with self._pinned() as vocab:
            return vocab.token_text(token)

    def piece(self, token: int) -> bytes:
        """A token's bytes, special tokens as their text: asked of llama.cpp once per token (the
        server reads them for every token and every alternative of log-probabilities)."""
        if type(token) is not int:  # not cached: llama.cpp's binding refuses what is not a token
            return self._piece(token)
        known = self._pieces.get(token)
        if known is None:
            known = self._pieces[token] = self._piece(token)  # a bad id raises: nothing is kept
        return known

    def _piece(self, token: int) -> bytes:
        with self._pinned() as vocab:
            return vocab.token_to_piece(token, special=True)

    def special_tokens(self) -> Sequence[SpecialToken]:
        if self._specials is None:
            with self._pinned() as vocab:
                found = vocab.special_tokens()
            user = lib.LLAMA_TOKEN_ATTR_USER_DEFINED
            self._specials = [
                SpecialToken(token, text, control=not attr & user, lstrip=bool(attr & lib.LLAMA_TOKEN_ATTR_LSTRIP),
                             rstrip=bool(attr & lib.LLAMA_TOKEN_ATTR_RSTRIP))
                for token, text, attr in found]
        return self._specials

    def guidance(self) -> Any:
        """The vocabulary for llguidance (built on first use: a pass over every token)."""
        with self._lock:
            if self._guidance is None:
                with self._pinned() as vocab:
                    control = lib.LLAMA_TOKEN_ATTR_CONTROL
                    special = {t for t, text, attr in vocab.special_tokens()
                               if attr & control or (text.startswith("<") and text.endswith(">"))}
                    pieces = [(constraints.SPECIAL if t in special else b"") + vocab.token_to_piece(t, special=True)
                              for t in range(vocab.n_tokens)]
                    eog = [t for t in range(vocab.n_tokens) if vocab.is_eog(t)] or [vocab.eos]
                self._guidance = constraints.make_tokenizer(
                    pieces, eog=eog, bos=vocab.bos if vocab.bos >= 0 else None, special=sorted(special),
                    encode=lambda text: self.tokenize(text, add_special=False, special=False))
            return self._guidance

    def chat_layer(self, source: str | None = None) -> ChatTemplates:
        """llama.cpp's chat templates of the model (its own; ``source``: this template text instead,
        seeing the model's BOS and EOS). Raises ChatTemplateError for a template llama.cpp cannot
        read."""
        return ChatTemplates(source, vocab=self._vocab)
