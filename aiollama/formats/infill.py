"""Fill-in-the-middle prompts, as llama-server's ``/infill`` builds them.

A code model with FIM tokens completes the middle of a file: the prompt is the text before the
cursor and the text after it, marked by those tokens, and the reply is what goes between. Editors
(llama.vim, llama.vscode) send more of the project too (``input_extra``: other files' chunks),
which goes first, in the repository-level pattern (https://arxiv.org/pdf/2409.12186) where the
vocabulary has the tokens for it::

    [FIM_REP]myproject\\n[FIM_SEP]filename0\\nchunk 0 ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix prompt[FIM_SUF]suffix[FIM_MID]

The prefix keeps its last part and the suffix its first, so that they fit one batch (3:1), and the
extra chunks take what the context has left. Pure: no engine, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aiollama.errors import InvalidRequestError
from aiollama.formats.tokens import Tokenizer

CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra chunks where the vocabulary has no file separator


def text_or_tokens(tokenizer: Tokenizer, value: Any, what: str) -> list[int]:
    """Text, token ids, or a list mixing both, as tokens (text without special tokens)."""
    if isinstance(value, str):
        return tokenizer.tokenize(value, add_special=False, special=False) if value else []
    if not isinstance(value, Sequence):
        raise InvalidRequestError(f"{what} must be text, token ids, or a list of both")
    out: list[int] = []
    for part in value:
        if isinstance(part, str):
            out += tokenizer.tokenize(part, add_special=False, special=False)
        else:
            out.append(tokenizer.check_token(part))
    return out


def infill_tokens(tokenizer: Tokenizer, prefix: Any, suffix: Any, extra: Sequence[Any] = (),
                  prompt: Sequence[int] = (), *, n_batch: int, n_predict: int, n_ctx: int) -> list[int]:
    """The prompt of a fill-in-the-middle request. Raises InvalidRequestError for a model without
    FIM tokens, or a malformed part."""
    fim = tokenizer.fim
    missing = [name for name in ("pre", "suf", "mid") if fim.get(name, -1) < 0]
    if missing:
        raise InvalidRequestError("infill is not supported by this model: it has no fill-in-the-middle "
                                  f"{', '.join(missing)} token")
    tokens_prefix = text_or_tokens(tokenizer, prefix, "input_prefix")
    tokens_suffix = text_or_tokens(tokenizer, suffix, "input_suffix")
    extra_tokens: list[int] = []
    if fim.get("rep", -1) >= 0:
        extra_tokens += [fim["rep"], *tokenizer.tokenize("myproject\n", add_special=False, special=False)]
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("text", ""), str) \
                or not isinstance(chunk.get("filename", "tmp"), str):
            raise InvalidRequestError(f"input_extra[{i}] must be {{'filename': str, 'text': str}}")
        if fim.get("sep", -1) >= 0:
            extra_tokens += [fim["sep"], *tokenizer.tokenize(chunk.get("filename", "tmp") + "\n", add_special=False,
                                                             special=False)]
        else:
            extra_tokens += tokenizer.tokenize(CHUNK_SEPARATOR, add_special=False, special=False)
        extra_tokens += tokenizer.tokenize(chunk.get("text", ""), add_special=False, special=False)
    if fim.get("sep", -1) >= 0:
        extra_tokens += [fim["sep"], *tokenizer.tokenize("filename\n", add_special=False, special=False)]
    n_prefix = min(len(tokens_prefix), 3 * (n_batch // 4))
    n_suffix = min(len(tokens_suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    head = [fim["pre"], *tokens_prefix[len(tokens_prefix) - n_prefix:], *prompt]
    if tokenizer.add_bos and tokenizer.bos >= 0:
        head.insert(0, tokenizer.bos)
    return [*extra_tokens[len(extra_tokens) - n_extra:], *head, fim["suf"], *tokens_suffix[:n_suffix], fim["mid"]]
