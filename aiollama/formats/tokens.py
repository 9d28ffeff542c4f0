"""The vocabulary as the pure layers see it: a tokenizer usable from any thread, and the special
tokens it splits out of text first. ``aiollama.runner.tokenizer`` implements it over llama.cpp; tests
implement it over bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class SpecialToken:
    """A token the tokenizer splits out of text before anything else (llama.cpp's special tokens).

    ``control`` tokens are split only when special-token parsing is asked for; the others
    (user-defined) always are. ``lstrip``/``rstrip``: whitespace on that side is dropped.
    """

    id: int
    text: str
    control: bool = True
    lstrip: bool = False
    rstrip: bool = False


class Tokenizer(Protocol):
    """The model's tokenizer, usable from any thread."""

    n_vocab: int
    bos: int  # -1 when the model has none
    eos: int
    eot: int
    add_bos: bool
    fim: dict[str, int]  # fill-in-the-middle tokens: "pre", "suf", "mid", "rep", "sep" (-1: none)

    def tokenize(self, text: str, *, add_special: bool, special: bool) -> list[int]: ...

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str: ...

    def check_token(self, token: object) -> int: ...

    def is_control(self, token: int) -> bool: ...

    def token_text(self, token: int) -> str: ...

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for (special tokens as their text)."""
        ...

    def special_tokens(self) -> Sequence[SpecialToken]:
        """Every special token, longest text first (the order the tokenizer splits them in)."""
        ...

    def guidance(self) -> Any:
        """The vocabulary as llguidance's ``LLTokenizer`` (for constrained generation)."""
        ...

    def chat_layer(self, source: str | None = None) -> Any:
        """llama.cpp's chat templates of the model, or of the template text ``source``
        (:class:`aiollama.formats.chat.ChatLayer`)."""
        ...
