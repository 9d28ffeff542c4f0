"""Scripted tiny models: a model that writes one chosen reply, on any engine.

The model is a llama of one layer whose next token is a function of its last few tokens, set so
that greedy decoding after one chat request's prompt writes a chosen reply and then ends its turn.
Each of its attention heads looks at one earlier position only: queries and keys are the same for
every token (they read a constant dimension of the embeddings) and differ by ``back`` steps of
RoPE, so the score peaks at that distance. A head copies that token's code into dimensions of its
own, and the output matrix maps the last tokens at each step of the script to the next one: the
exact solution of a linear system, since their features are independent. It looks as far back as
the script needs (the fewest tokens after which each step of it has one next token). Greedy decoding
then writes the reply on llama-server as on aiollama, and the two can be compared on what they make
of the same output.

The vocabulary is SmolLM2's with a family's markers added as tokens, and the GGUF carries the
family's vendor template.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter
from tiny_model import add_fields, copy_tokenizer, finish

from aiollama.formats.chat import ChatTemplate
from aiollama.formats.messages import normalize
from aiollama.native import Model
from aiollama.runner.tokenizer import VocabTokenizer

HEAD = 128  # the dimensions of each head (one per earlier token looked at)
ROPE_BASE = 20.0
SHARP_PAIRS = 20  # the rotary pairs a head's scores use: the fastest, which peak at one distance alone
PAIR_WEIGHT = 8.0  # |q| and |k| in each of them: the scores' gap between that distance and the others
LIFT = 30.0  # how far the scripted next token's logit stands above the rest


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
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(path.name + f".{os.getpid()}.vocab")
    _write(draft, fields, _Shape(2), np.zeros((n_vocab, 2 * HEAD), dtype=np.float32), None)  # its vocabulary
    with Model(draft, vocab_only=True) as model:
        tokenizer = VocabTokenizer(model.vocab)
        prompt = ChatTemplate.of(tokenizer).render(normalize(request["messages"]), tools=request.get("tools"),
                                                   tool_choice=request.get("tool_choice", "auto")).prompt
        tokens = tokenizer.tokenize(prompt, add_special=True, special=True)
        script = tokens + tokenizer.tokenize(reply, add_special=False, special=True) + [tokenizer.eos]
    draft.unlink()
    order = next(n for n in range(2, 9) if _steps(script, len(tokens) - 1, n) is not None)
    shape = _Shape(order)
    rng = np.random.default_rng(seed)
    code = rng.standard_normal((n_vocab, shape.code))
    code /= np.linalg.norm(code, axis=1, keepdims=True)
    embd = np.zeros((n_vocab, shape.n_embd), dtype=np.float32)
    embd[:, 0] = 1.0
    embd[:, 1:1 + shape.code] = code
    _write(path, fields, shape, embd, _output(shape, code, _steps(script, len(tokens) - 1, order) or {}))
    return path


class _Shape:
    """A scripted model looking ``order`` tokens back: a head for each, a code for each token."""

    def __init__(self, order: int) -> None:
        self.order = order
        self.n_embd = HEAD * order
        self.code = (self.n_embd - 1) // (order + 1)


def _steps(script: list[int], start: int, order: int) -> dict[tuple[int, ...], int] | None:
    """From position ``start`` of ``script`` on, the ``order`` tokens before each position and its
    own, and the next token; None if the same tokens are followed by two different ones."""
    steps: dict[tuple[int, ...], int] = {}
    for at in range(start, len(script) - 1):
        context = tuple(script[at - order:at + 1])
        if steps.setdefault(context, script[at + 1]) != script[at + 1]:
            return None
    return steps


def _output(shape: _Shape, code: np.ndarray, steps: dict[tuple[int, ...], int]) -> np.ndarray:
    """The output matrix that maps each context of ``steps`` to its next token."""
    contexts = list(steps)
    features = np.stack([_features(shape, code, c) for c in contexts], axis=1)  # (n_embd, n_contexts)
    targets = sorted(set(steps.values()))
    wanted = np.zeros((len(targets), len(contexts)))
    for j, context in enumerate(contexts):
        wanted[targets.index(steps[context]), j] = LIFT
    out = np.zeros((len(code), shape.n_embd), dtype=np.float32)
    out[targets] = wanted @ np.linalg.pinv(features)
    return out


def _features(shape: _Shape, code: np.ndarray, context: tuple[int, ...]) -> np.ndarray:
    """What the output matrix sees at a position: the normed residual of the current token's
    embedding and the codes of the earlier tokens that the heads wrote."""
    x = np.zeros(shape.n_embd)
    x[0] = 1.0
    for back, token in enumerate(reversed(context)):  # the current token first
        x[1 + back * shape.code:1 + (back + 1) * shape.code] = code[token]
    return x / np.sqrt((x * x).mean())


def _attention(shape: _Shape) -> dict[str, np.ndarray]:
    """The heads' weights: queries and keys from the constant dimension, ``back`` RoPE steps apart
    in the fastest pairs (head ``back - 1``'s score peaks ``back`` positions earlier); values the
    token's code, written by the output projection into that earlier token's dimensions."""
    n = shape.n_embd
    h0 = np.sqrt(n / 2.0)  # the constant dimension after the layer's RMS norm
    theta = ROPE_BASE ** (-2.0 * np.arange(HEAD // 2) / HEAD)
    wq, wk, wv, wo = (np.zeros((n, n)) for _ in range(4))
    for head in range(shape.order):
        back, base = head + 1, head * HEAD
        for m in range(SHARP_PAIRS):
            wq[base + 2 * m, 0] = PAIR_WEIGHT / h0
            wk[base + 2 * m, 0] = PAIR_WEIGHT * np.cos(back * theta[m]) / h0
            wk[base + 2 * m + 1, 0] = PAIR_WEIGHT * np.sin(back * theta[m]) / h0
        for i in range(shape.code):
            wv[base + i, 1 + i] = 1.0
            wo[1 + back * shape.code + i, base + i] = 1.0 / h0
    return {"attn_q": wq, "attn_k": wk, "attn_v": wv, "attn_output": wo}


def _write(path: Path, fields: dict[str, Any], shape: _Shape, embd: np.ndarray, out: np.ndarray | None) -> None:
    n_vocab, n = len(embd), shape.n_embd
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name("aiollama scripted test model")
    writer.add_block_count(1)
    writer.add_context_length(8192)
    writer.add_embedding_length(n)
    writer.add_feed_forward_length(16)
    writer.add_head_count(shape.order)
    writer.add_head_count_kv(shape.order)
    writer.add_rope_dimension_count(HEAD)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0)
    add_fields(writer, fields)
    ones = np.ones(n, dtype=np.float32)
    writer.add_tensor("token_embd.weight", embd)
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", out if out is not None else np.zeros((n_vocab, n), dtype=np.float32))
    layer = {**_attention(shape), "ffn_gate": np.zeros((16, n)), "ffn_up": np.zeros((16, n)), "ffn_down": np.zeros((n, 16))}
    writer.add_tensor("blk.0.attn_norm.weight", ones)
    writer.add_tensor("blk.0.ffn_norm.weight", ones)
    for name, value in layer.items():
        writer.add_tensor(f"blk.0.{name}.weight", value.astype(np.float32))
    finish(writer, tmp, path)
