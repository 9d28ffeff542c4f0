"""Constrained generation with llguidance: JSON schemas, regular expressions and Lark grammars.

A constraint is compiled into an ``LLMatcher`` on the caller's thread, at ``stream()``: a schema or
grammar that does not compile raises ``GrammarError`` there, so a stream never runs unconstrained
by mistake. The decode thread asks the matcher for the mask of allowed tokens each step (llguidance
computes the masks of many streams in parallel, without the GIL), sets the others' logits to -inf
before the sampler chain runs, and feeds it the chosen token. When the text is complete, only an
end-of-generation token is allowed, and the stream ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from aiollama.errors import GrammarError
from aiollama.sampling import SamplingParams

SPECIAL = b"\xff"  # how llguidance tells a special token's bytes from text


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: every token's bytes, the EOS and BOS ids, and a
    function that tokenizes text."""

    def __init__(self, pieces: Sequence[bytes], eos: int, bos: int | None, special: Sequence[int],
                 encode: Callable[[str], list[int]]) -> None:
        self.tokens = list(pieces)
        self.eos_token_id = eos
        self.bos_token_id = bos
        self.special_token_ids = list(special)
        self._encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        return self._encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


def make_tokenizer(pieces: Sequence[bytes], *, eog: Sequence[int], bos: int | None, special: Sequence[int],
                   encode: Callable[[str], list[int]]) -> LLTokenizer:
    """An llguidance tokenizer over a vocabulary: ``pieces[i]`` is token i's bytes (special tokens
    prefixed with b"\\xff"), ``eog`` the tokens that end a generation."""
    wrapper = llguidance.TokenizerWrapper(_Vocabulary(pieces, eog[0], bos, special, encode))
    return LLTokenizer(wrapper, n_vocab=len(pieces), eos_token=list(eog))


# Compact JSON, one space after separators: no whitespace for a small model to loop in.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever an object lists its properties and
    says nothing about others: the output has exactly the fields asked for (as OpenAI's strict
    structured outputs, and Pydantic models, mean)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_of(params: SamplingParams) -> str | None:
    """The llguidance grammar for the stream's constraint (None: unconstrained, or GBNF, which
    llama.cpp's own grammar sampler applies)."""
    try:
        if params.json_schema is not None:
            schema = closed(json.loads(params.json_schema))
            return str(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))  # type: ignore[arg-type]
        if params.regex is not None:
            return str(LLMatcher.grammar_from_regex(params.regex))
        if params.lark is not None:
            return str(LLMatcher.grammar_from_lark(params.lark))
    except ValueError as exc:
        raise GrammarError(f"the constraint does not compile: {exc}") from None
    return None


def after_thinking(grammar: str, start: int, end: int, *, eog: Sequence[int], inside: bool) -> str:
    """``grammar`` preceded by a thinking block, for a reasoning model whose markers are the tokens
    ``start`` and ``end``: the model may think first (must, to the end of the block, when the
    prompt opened it: ``inside``), and the constraint applies from the closing marker on. A
    thinking block may hold any token but the markers (blocks do not nest) and the
    end-of-generation tokens ``eog``: a reply cannot end before its constrained part."""
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    first, *rest = top["grammars"]
    name = first.get("name") or "constraint"
    barred = ",".join(str(t) for t in sorted({start, end, *eog}))
    block = f"<[^{barred}]>* <[{end}]> /[ \\t\\r\\n]{{0,4}}/"  # the blank lines models write after it
    if not inside:
        block = f"(<[{start}]> {block})?"
    wrapper = {"name": "after_thinking", "lark_grammar": f"start: {block} @{name}\n"}
    return json.dumps({**top, "grammars": [wrapper, {**first, "name": name}, *rest]})


def matcher(tokenizer: LLTokenizer, grammar: str) -> LLMatcher:
    """A matcher at the start of ``grammar``. Raises GrammarError if it does not compile."""
    m = LLMatcher(tokenizer, grammar, log_level=0)
    if m.is_error():
        raise GrammarError(f"the constraint does not compile: {m.get_error()}")
    return m


def compile_for(params: SamplingParams, tokenizer: Callable[[], LLTokenizer], *,
                thinking: tuple[int, int] | None = None, inside: bool = False) -> LLMatcher | None:
    """The matcher a stream's parameters ask for, or None. ``thinking``: the tokens that open and
    close a reasoning model's thinking block, which comes before the constraint."""
    grammar = grammar_of(params)
    if grammar is None:
        return None
    vocabulary = tokenizer()
    if thinking is not None:
        grammar = after_thinking(grammar, *thinking, eog=vocabulary.eos_tokens, inside=inside)
    return matcher(vocabulary, grammar)


class Masks:
    """Fills the masks of a step's constrained rows at once, and applies them to logits rows.

    With ``threads`` > 1, llguidance fills them in parallel on a pool of its own (without the GIL).
    Give it only CPUs that llama.cpp's threads leave free: on a machine where the decode already
    takes every core, a pool beside it costs the decode more than the masks gain, so one thread
    fills them in turn on the decode thread.
    """

    def __init__(self, n_vocab: int, threads: int = 1) -> None:
        self.n_vocab = n_vocab
        self._executor = LLExecutor(num_threads=threads) if threads > 1 else None
        self._words = (n_vocab + 31) // 32

    def fill(self, matchers: Sequence[Any]) -> np.ndarray:
        """One row of allowed-token bits per matcher."""
        bits = np.full((len(matchers), self._words), -1, dtype=np.int32)
        if self._executor is None or len(matchers) == 1:
            for row, m in zip(bits, matchers):
                m.unsafe_compute_mask_ptr(row.ctypes.data, self._words * 4)
        else:
            self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.ctypes.data,
                                                   self._words * 4, len(matchers))
        return bits

    def apply(self, logits: np.ndarray, bits: np.ndarray) -> None:
        """Set the logits of the tokens ``bits`` does not allow to -inf."""
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.n_vocab].view(bool)
        logits[~allowed] = -np.inf
