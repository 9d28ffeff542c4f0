"""Scripted tiny models: a model that writes one chosen reply, on any engine.

The model is a bigram table in the shape of a llama: its attention and feed-forward blocks write
nothing (their output projections are zero), so a position's logits depend on its own token alone,
and the output matrix maps each token of a chain to the next. The chain spells the reply in tokens
of distinct ids (so that each has one successor), starting from the last token of the rendered
prompt of one chat request, and ends with end of generation. Greedy decoding then writes the reply
on llama-server as on aiollama, and the two can be compared on what they make of the same output.

The vocabulary is SmolLM2's with a family's markers added as tokens, and the GGUF carries the
family's vendor template.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from tiny_model import copy_tokenizer, finish
from gguf import GGUFWriter

from aiollama.formats.chat import ChatTemplate
from aiollama.formats.messages import normalize
from aiollama.native import Model
from aiollama.runner.tokenizer import VocabTokenizer

N_EMBD = 64
LIFT = 40.0  # how far a successor's logit stands above the rest


def scripted_model(path: Path, tokenizer_source: Path, *, template: str, markers: tuple[str, ...],
                   request: dict[str, Any], reply: str, seed: int = 11) -> Path:
    """The model at ``path`` (written on first use) that answers ``request`` with ``reply``."""
    if path.is_file():
        return path
    fields = {k: f.contents() for k, f in copy_tokenizer(tokenizer_source).items()}  # type: ignore[attr-defined]
    known = set(fields["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    new = [m for m in markers if m not in known]
    fields["tokenizer.ggml.tokens"] = list(fields["tokenizer.ggml.tokens"]) + new  # type: ignore[call-overload]
    fields["tokenizer.ggml.token_type"] = list(fields["tokenizer.ggml.token_type"]) + [4] * len(new)  # type: ignore[call-overload]
    fields["tokenizer.chat_template"] = template
    n_vocab = len(fields["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    embd = rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, fields, embd, np.zeros((n_vocab, N_EMBD), dtype=np.float32))  # to read its vocabulary
    with Model(path, vocab_only=True) as model:
        tokenizer = VocabTokenizer(model.vocab)
        prompt = ChatTemplate.of(tokenizer).render(normalize(request["messages"]), tools=request.get("tools"),
                                                   tool_choice=request.get("tool_choice", "auto")).prompt
        last = tokenizer.tokenize(prompt, add_special=True, special=True)[-1]
        chain = [last, *_distinct_tokens(tokenizer, reply, avoid={last, tokenizer.eos}), tokenizer.eos]
    out = (rng.standard_normal((n_vocab, N_EMBD)) * 0.01).astype(np.float32)
    unit = embd / np.linalg.norm(embd, axis=1, keepdims=True)
    for token, successor in zip(chain, chain[1:]):
        out[successor] += LIFT * unit[token] / np.sqrt(N_EMBD)
    _write(path, fields, embd, out)
    return path


# what a newline may be written as where a plain one is taken (a bigram model writes each token once)
NEWLINES = (b"\n", b"\n ", b" \n", b"\n\t", b"\n  ", b" \n ", b"\n   ", b"\n\t\t", b"\n    ", b"\n\t\t\t")


def _distinct_tokens(tokenizer: VocabTokenizer, text: str, avoid: set[int]) -> list[int]:
    """Tokens of distinct ids whose pieces spell ``text`` (a newline, where it must, as a newline
    and some spaces or tabs): the family's markers as their own tokens, the rest in the longest
    pieces not taken yet (a depth-first search)."""
    pieces: dict[bytes, int] = {}
    for token in range(tokenizer.n_vocab):
        pieces.setdefault(tokenizer.piece(token), token)
    data = text.encode()
    longest = max(len(p) for p in pieces)
    used: set[int] = set(avoid)
    out: list[int] = []

    def options(at: int) -> list[tuple[int, int]]:
        """(token, where the text goes on) for each piece that may come at ``at``."""
        found = [(pieces[data[at:end]], end) for end in range(min(len(data), at + longest), at, -1)
                 if data[at:end] in pieces]
        if data[at:at + 1] == b"\n":
            found += [(pieces[n], at + 1) for n in NEWLINES[1:] if n in pieces]
        return found

    def search(at: int) -> bool:
        if at == len(data):
            return True
        for token, end in options(at):
            if token in used:
                continue
            used.add(token)
            out.append(token)
            if search(end):
                return True
            used.discard(token)
            out.pop()
        return False

    if not search(0):
        raise ValueError(f"no spelling of {text!r} in distinct tokens")
    return out


def _write(path: Path, fields: dict[str, Any], embd: np.ndarray, out: np.ndarray) -> None:
    from tiny_model import add_fields

    n_vocab = len(embd)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name("aiollama scripted test model")
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(N_EMBD)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_rope_dimension_count(N_EMBD // 4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0)
    add_fields(writer, fields)
    ones = np.ones(N_EMBD, dtype=np.float32)
    zero = np.zeros((N_EMBD, N_EMBD), dtype=np.float32)
    small = (np.random.default_rng(1).standard_normal((N_EMBD, N_EMBD)) * 0.1).astype(np.float32)
    writer.add_tensor("token_embd.weight", embd)
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", out)
    for name, value in (("attn_norm", ones), ("attn_q", small), ("attn_k", small), ("attn_v", small),
                        ("attn_output", zero), ("ffn_norm", ones), ("ffn_gate", small), ("ffn_up", small),
                        ("ffn_down", zero)):
        writer.add_tensor(f"blk.0.{name}.weight", value)
    finish(writer, tmp, path)
