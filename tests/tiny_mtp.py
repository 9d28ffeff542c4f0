"""Tiny models with a multi-token-prediction (MTP) layer, in GLM-4.5's layout (``glm4moe``): two
dense attention layers, then one NextN block (the MTP head: a token's embedding and the hidden state
before it, projected, through one attention layer with a mixture of experts) that llama.cpp runs
in a context of its own (``LLAMA_CONTEXT_TYPE_MTP``).

Two variants, both with SmolLM2's vocabulary:

- ``agree=False``: every weight random, so the head's guesses are noise (a draft that never pays);
- ``agree=True``: the layers add nothing to the residual stream (their output projections are
  zero), so the model's next token is a function of the current token alone, and the head's input
  projection keeps only the token's embedding: it predicts, from a token, exactly what the model
  predicts from it. Greedy drafts then always agree (a draft that always pays).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import ExpertGatingFuncType, GGUFWriter
from tiny_model import add_fields, cached, copy_tokenizer, finish

ARCH = "glm4moe"


def weights(seed: int, agree: bool) -> Callable[..., np.ndarray]:
    """``weight(*shape, scale=0.2, out=False)``: random, or zero for an output projection (``out``)
    of the agreeing model."""
    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float = 0.2, out: bool = False) -> np.ndarray:
        if out and agree:
            return np.zeros(shape, dtype=np.float32)
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    return weight


def add_nextn(writer: GGUFWriter, p: str, n_embd: int, weight: Callable[..., np.ndarray], agree: bool,
              streams: int = 1) -> None:
    """The NextN block's own tensors: the norms of the token's embedding and of the hidden state
    (of each of its ``streams``, where hyper-connections widen it), and the projection of [the
    embedding | the state] to the width, which the agreeing head keeps the embedding only of."""
    ones = np.ones(n_embd, dtype=np.float32)
    writer.add_tensor(p + "nextn.enorm.weight", ones)
    writer.add_tensor(p + "nextn.hnorm.weight", ones if streams == 1 else np.ones((streams, n_embd), dtype=np.float32))
    eh = weight(n_embd, 2 * n_embd)
    if agree:
        eh = np.hstack([np.eye(n_embd, dtype=np.float32), np.zeros((n_embd, n_embd), dtype=np.float32)])
    writer.add_tensor(p + "nextn.eh_proj.weight", eh)


def add_ends(writer: GGUFWriter, weight: Callable[..., np.ndarray], n_vocab: int, n_embd: int) -> np.ndarray:
    """The token embeddings, the output norm and the output projection (not tied: the next token is
    not this one); returns the norms' weights (ones)."""
    ones = np.ones(n_embd, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd, scale=1.0))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", weight(n_vocab, n_embd, scale=1.0))
    return ones


def add_experts(writer: GGUFWriter, p: str, weight: Callable[..., np.ndarray], n_embd: int, n_expert: int,
                n_ff_exp: int, bias: str | None = "exp_probs_b.bias") -> None:
    """A mixture of ``n_expert`` experts with a bias on their selection (the tensor ``bias``; None:
    no bias), beside a gated shared expert (GLM-4.5's and Bailing-MoE 3's feed-forward)."""
    writer.add_tensor(p + "ffn_gate_inp.weight", weight(n_expert, n_embd))
    if bias is not None:
        writer.add_tensor(p + bias, np.zeros(n_expert, dtype=np.float32))
    writer.add_tensor(p + "ffn_gate_exps.weight", weight(n_expert, n_ff_exp, n_embd))
    writer.add_tensor(p + "ffn_up_exps.weight", weight(n_expert, n_ff_exp, n_embd))
    writer.add_tensor(p + "ffn_down_exps.weight", weight(n_expert, n_embd, n_ff_exp, out=True))
    writer.add_tensor(p + "ffn_gate_shexp.weight", weight(n_ff_exp, n_embd))
    writer.add_tensor(p + "ffn_up_shexp.weight", weight(n_ff_exp, n_embd))
    writer.add_tensor(p + "ffn_down_shexp.weight", weight(n_embd, n_ff_exp, out=True))


def add_gated_experts(writer: GGUFWriter, p: str, weight: Callable[..., np.ndarray], n_embd: int, n_expert: int,
                      n_ff_exp: int) -> None:
    """A mixture of ``n_expert`` experts beside a shared one whose output a gate of its own scales
    (the Qwen hybrids' feed-forward)."""
    writer.add_tensor(p + "ffn_gate_inp.weight", weight(n_expert, n_embd))
    writer.add_tensor(p + "ffn_gate_exps.weight", weight(n_expert, n_ff_exp, n_embd))
    writer.add_tensor(p + "ffn_up_exps.weight", weight(n_expert, n_ff_exp, n_embd))
    writer.add_tensor(p + "ffn_down_exps.weight", weight(n_expert, n_embd, n_ff_exp, out=True))
    writer.add_tensor(p + "ffn_gate_inp_shexp.weight", weight(n_embd))
    writer.add_tensor(p + "ffn_gate_shexp.weight", weight(n_ff_exp, n_embd))
    writer.add_tensor(p + "ffn_up_shexp.weight", weight(n_ff_exp, n_embd))
    writer.add_tensor(p + "ffn_down_shexp.weight", weight(n_embd, n_ff_exp, out=True))


def write_mtp_model(path: Path, tokenizer_source: Path | None, *, agree: bool, tokenizer: dict[str, object] | None = None,
                    n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128, n_ff_exp: int = 32,
                    n_expert: int = 2, n_trunk: int = 2, n_nextn: int = 1) -> Path:
    """The model, with ``n_nextn`` MTP blocks; its vocabulary copied from ``tokenizer_source``, or
    the fields of ``tokenizer``."""
    fields = copy_tokenizer(tokenizer_source) if tokenizer_source is not None else {}
    n_vocab = len(fields["tokenizer.ggml.tokens"].data) if fields else len(tokenizer["tokenizer.ggml.tokens"])  # type: ignore[index, arg-type, attr-defined]
    head_dim = n_embd // n_head
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), ARCH)
    writer.add_name("aiollama tiny MTP test model")
    writer.add_block_count(n_trunk + n_nextn)
    writer.add_uint32(f"{ARCH}.nextn_predict_layers", n_nextn)
    writer.add_uint32(f"{ARCH}.leading_dense_block_count", n_trunk)  # the NextN block is the MoE one
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_expert_feed_forward_length(n_ff_exp)
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(1)
    writer.add_expert_shared_count(1)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0)  # all F32
    add_fields(writer, {k: f.contents() for k, f in fields.items()})  # type: ignore[attr-defined]
    add_fields(writer, tokenizer or {})
    weight = weights(11 if agree else 13, agree)

    ones = add_ends(writer, weight, n_vocab, n_embd)  # numpy shape (rows, cols) is ggml ne = [cols, rows]
    for i in range(n_trunk + n_nextn):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        writer.add_tensor(p + "attn_q.weight", weight(n_head * head_dim, n_embd))
        writer.add_tensor(p + "attn_k.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(p + "attn_v.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(p + "attn_output.weight", weight(n_embd, n_head * head_dim, out=True))
        writer.add_tensor(p + "post_attention_norm.weight", ones)
        if i < n_trunk:
            writer.add_tensor(p + "ffn_gate.weight", weight(n_ff, n_embd))
            writer.add_tensor(p + "ffn_up.weight", weight(n_ff, n_embd))
            writer.add_tensor(p + "ffn_down.weight", weight(n_embd, n_ff, out=True))
            continue
        add_experts(writer, p, weight, n_embd, n_expert, n_ff_exp)
        add_nextn(writer, p, n_embd, weight, agree)
    finish(writer, tmp, path)
    return path


def mtp_model(cache: Path, tokenizer_source: Path, *, agree: bool) -> Path:
    """The cached tiny MTP model, written on first use."""
    name = f"tiny-mtp-v1-{'agree' if agree else 'random'}.gguf"
    return cached(cache / name, lambda p: write_mtp_model(p, tokenizer_source, agree=agree))


QWEN35 = "qwen35"
QWEN35MOE = "qwen35moe"
QWEN3NEXT = "qwen3next"


def open_hybrid(path: Path, tokenizer_source: Path, arch: str, n_trunk: int,
                kind: str = "hybrid") -> tuple[GGUFWriter, Path, dict[str, Any], int]:
    """A writer of a tiny MTP model of ``arch`` (a hybrid, or another ``kind``; into a temporary
    file beside ``path``): its name, ``n_trunk`` layers and one MTP block; with the tokenizer's
    fields and its size."""
    fields = copy_tokenizer(tokenizer_source)
    n_vocab = len(fields["tokenizer.ggml.tokens"].data)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), arch)
    writer.add_name(f"aiollama tiny {kind} MTP test model")
    writer.add_block_count(n_trunk + 1)
    writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
    return writer, tmp, fields, n_vocab


def add_ssm_and_vocab(writer: GGUFWriter, arch: str, fields: dict[str, object], n_vocab: int, **ssm: int) -> None:
    """A hybrid's recurrent sizes (``{arch}.ssm.<name>`` for each of ``ssm``), then the
    vocabulary's size, an all-F32 file type and the tokenizer's fields."""
    for name, value in ssm.items():
        writer.add_uint32(f"{arch}.ssm.{name}", value)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0)
    add_fields(writer, {k: f.contents() for k, f in fields.items()})  # type: ignore[attr-defined]


def write_qwen35_mtp_model(path: Path, tokenizer_source: Path, *, agree: bool, arch: str = QWEN35, n_embd: int = 64,
                           n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128, layers: str = "ga", d_state: int = 16,
                           n_k_heads: int = 2, n_v_heads: int = 4, d_conv: int = 4, n_ff_exp: int = 32,
                           n_expert: int = 4) -> Path:
    """A tiny Qwen3.5 (hybrid: gated-delta-net layers "g", a recurrent state each, beside gated
    attention layers "a") with one MTP block after them, in llama.cpp's layout; ``agree`` as above.
    ``arch`` ``qwen35moe`` (Qwen3.5-MoE) and ``qwen3next`` (Qwen3-Next, the family's first): every
    feed-forward a mixture of ``n_expert`` experts (two used) beside a gated shared one, the MTP
    block's too; Qwen3-Next's gated-delta-net layers read their beta and alpha from one projection,
    and its rotary embedding has no sections."""
    if arch not in (QWEN35, QWEN35MOE, QWEN3NEXT):
        raise ValueError(f"not a Qwen hybrid: {arch}")
    moe = arch != QWEN35
    head_dim = n_embd // n_head
    key_dim, value_dim = d_state * n_k_heads, d_state * n_v_heads
    writer, tmp, fields, n_vocab = open_hybrid(path, tokenizer_source, arch, len(layers))
    writer.add_array(f"{arch}.attention.recurrent_layers", [kind == "g" for kind in layers] + [False])
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    if moe:
        writer.add_expert_count(n_expert)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(n_ff_exp)
        writer.add_expert_shared_feed_forward_length(n_ff_exp)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if arch != QWEN3NEXT:
        writer.add_array(f"{arch}.rope.dimension_sections", [head_dim // 4, head_dim // 4 - head_dim // 8, head_dim // 8, 0])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    add_ssm_and_vocab(writer, arch, fields, n_vocab, conv_kernel=d_conv, inner_size=value_dim, state_size=d_state,
                      time_step_rank=n_v_heads, group_count=n_k_heads)
    weight = weights(17 if agree else 19, agree)

    def attention(p: str) -> None:
        writer.add_tensor(p + "attn_q.weight", weight(2 * n_head * head_dim, n_embd))  # queries and their gates
        writer.add_tensor(p + "attn_k.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(p + "attn_v.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(p + "attn_output.weight", weight(n_embd, n_head * head_dim, out=True))
        writer.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
        writer.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))

    ones = add_ends(writer, weight, n_vocab, n_embd)
    for i, kind in enumerate(layers + "m"):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        writer.add_tensor(p + "post_attention_norm.weight", ones)
        if kind == "g":
            writer.add_tensor(p + "attn_qkv.weight", weight(2 * key_dim + value_dim, n_embd))
            writer.add_tensor(p + "attn_gate.weight", weight(value_dim, n_embd))
            writer.add_tensor(p + "ssm_conv1d.weight", weight(2 * key_dim + value_dim, d_conv, scale=0.5))
            writer.add_tensor(p + "ssm_dt.bias", np.zeros(n_v_heads, dtype=np.float32))
            writer.add_tensor(p + "ssm_a", -np.ones(n_v_heads, dtype=np.float32))
            if arch == QWEN3NEXT:
                writer.add_tensor(p + "ssm_ba.weight", weight(2 * n_v_heads, n_embd))
            else:
                writer.add_tensor(p + "ssm_beta.weight", weight(n_v_heads, n_embd))
                writer.add_tensor(p + "ssm_alpha.weight", weight(n_v_heads, n_embd))
            writer.add_tensor(p + "ssm_norm.weight", np.ones(d_state, dtype=np.float32))
            writer.add_tensor(p + "ssm_out.weight", weight(n_embd, value_dim, out=True))
        else:
            attention(p)
        if moe:
            add_gated_experts(writer, p, weight, n_embd, n_expert, n_ff_exp)
        else:
            writer.add_tensor(p + "ffn_gate.weight", weight(n_ff, n_embd))
            writer.add_tensor(p + "ffn_up.weight", weight(n_ff, n_embd))
            writer.add_tensor(p + "ffn_down.weight", weight(n_embd, n_ff, out=True))
        if kind == "m":
            add_nextn(writer, p, n_embd, weight, agree)
    finish(writer, tmp, path)
    return path


def cached_mtp(cache: Path, arch: str, agree: bool, write: Callable[[Path], Path]) -> Path:
    """The cached tiny MTP model of ``arch`` (``agree``: its head's), ``write`` on first use."""
    return cached(cache / f"tiny-{arch}-mtp-v1-{'agree' if agree else 'random'}.gguf", write)


def qwen35_mtp_model(cache: Path, tokenizer_source: Path, *, agree: bool, arch: str = QWEN35) -> Path:
    """The cached tiny Qwen hybrid MTP model of ``arch``, written on first use."""
    return cached_mtp(cache, arch, agree, lambda p: write_qwen35_mtp_model(p, tokenizer_source, agree=agree, arch=arch))


NEMOTRON_H_MOE = "nemotron_h_moe"


def write_nemotron_mtp_model(path: Path, tokenizer_source: Path, *, agree: bool, n_embd: int = 64, n_head: int = 4,
                             n_head_kv: int = 2, layers: str = "MAE", d_state: int = 16, n_ssm_head: int = 4,
                             n_group: int = 2, d_conv: int = 4, n_ff_exp: int = 32, n_expert: int = 4) -> Path:
    """A tiny Nemotron-H MoE (hybrid: Mamba-2 layers "M", a recurrent state each, attention layers
    "A" and mixture-of-experts layers "E", each a block of its own) with one MTP block after them (an
    attention and a mixture of experts sub-layer, then a layer norm before the model's output), in
    llama.cpp's layout; ``agree`` as above (the embeddings' rows have a mean of zero, so that the
    head's layer norm and the model's RMS norm give one direction)."""
    arch, head_dim, d_inner = NEMOTRON_H_MOE, n_embd // n_head, n_embd
    conv_dim = d_inner + 2 * n_group * d_state
    writer, tmp, fields, n_vocab = open_hybrid(path, tokenizer_source, arch, len(layers))
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    # a layer is recurrent where it has neither key-value heads nor a feed-forward
    writer.add_feed_forward_length([n_ff_exp if kind == "E" else 0 for kind in layers] + [n_ff_exp])
    writer.add_head_count(n_head)
    writer.add_head_count_kv([n_head_kv if kind == "A" else 0 for kind in layers] + [n_head_kv])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(n_ff_exp)
    writer.add_expert_shared_feed_forward_length(n_ff_exp)
    writer.add_expert_shared_count(1)
    writer.add_expert_weights_norm(True)
    writer.add_expert_weights_scale(1.0)
    writer.add_layer_norm_eps(1e-5)
    writer.add_layer_norm_rms_eps(1e-5)
    add_ssm_and_vocab(writer, arch, fields, n_vocab, conv_kernel=d_conv, inner_size=d_inner, state_size=d_state,
                      time_step_rank=n_ssm_head, group_count=n_group)
    weight = weights(23 if agree else 29, agree)

    def attention(p: str) -> None:
        writer.add_tensor(p + "attn_q.weight", weight(n_head * head_dim, n_embd))
        writer.add_tensor(p + "attn_k.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(p + "attn_v.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(p + "attn_output.weight", weight(n_embd, n_head * head_dim, out=True))

    def experts(p: str) -> None:
        writer.add_tensor(p + "ffn_gate_inp.weight", weight(n_expert, n_embd))
        writer.add_tensor(p + "exp_probs_b.bias", np.zeros(n_expert, dtype=np.float32))
        writer.add_tensor(p + "ffn_up_exps.weight", weight(n_expert, n_ff_exp, n_embd))
        writer.add_tensor(p + "ffn_down_exps.weight", weight(n_expert, n_embd, n_ff_exp, out=True))
        writer.add_tensor(p + "ffn_up_shexp.weight", weight(n_ff_exp, n_embd))
        writer.add_tensor(p + "ffn_down_shexp.weight", weight(n_embd, n_ff_exp, out=True))

    ones = np.ones(n_embd, dtype=np.float32)
    embd = weight(n_vocab, n_embd, scale=1.0)
    writer.add_tensor("token_embd.weight", embd - embd.mean(axis=1, keepdims=True))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", weight(n_vocab, n_embd, scale=1.0))
    for i, kind in enumerate(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        if kind == "M":
            writer.add_tensor(p + "ssm_in.weight", weight(2 * d_inner + 2 * n_group * d_state + n_ssm_head, n_embd))
            writer.add_tensor(p + "ssm_conv1d.weight", weight(conv_dim, d_conv, scale=0.5))
            writer.add_tensor(p + "ssm_conv1d.bias", np.zeros(conv_dim, dtype=np.float32))
            writer.add_tensor(p + "ssm_dt.bias", np.zeros(n_ssm_head, dtype=np.float32))
            writer.add_tensor(p + "ssm_a", -np.ones((n_ssm_head, 1), dtype=np.float32))
            writer.add_tensor(p + "ssm_d", np.ones((n_ssm_head, 1), dtype=np.float32))
            writer.add_tensor(p + "ssm_norm.weight", np.ones((n_group, d_inner // n_group), dtype=np.float32))
            writer.add_tensor(p + "ssm_out.weight", weight(n_embd, d_inner, out=True))
        elif kind == "A":
            attention(p)
        else:
            experts(p)
    p = f"blk.{len(layers)}."
    add_nextn(writer, p, n_embd, weight, agree)
    writer.add_tensor(p + "nextn.shared_head_norm.weight", ones)
    writer.add_tensor(p + "attn_norm.weight", ones)
    attention(p)
    writer.add_tensor(p + "post_attention_norm.weight", ones)
    experts(p)
    finish(writer, tmp, path)
    return path


def nemotron_mtp_model(cache: Path, tokenizer_source: Path, *, agree: bool) -> Path:
    """The cached tiny Nemotron-H MoE with an MTP block, written on first use."""
    return cached_mtp(cache, NEMOTRON_H_MOE, agree, lambda p: write_nemotron_mtp_model(p, tokenizer_source, agree=agree))


BAILINGMOE3 = "bailingmoe3"


def write_bailing_mtp_model(path: Path, tokenizer_source: Path, *, agree: bool, n_embd: int = 64, n_head: int = 4,
                            layers: str = "ka", head_dim: int = 16, d_conv: int = 4, kv_lora_rank: int = 32,
                            n_rot: int = 8, qk_nope: int = 16, v_head_dim: int = 16, n_ff_exp: int = 32,
                            n_expert: int = 4) -> Path:
    """A tiny Bailing-MoE 3 (hybrid: Kimi delta attention layers "k", a recurrent state each with
    short convolutions of their queries, keys and values, beside multi-head latent attention layers
    "a", every feed-forward a mixture of experts with a shared one) with one MTP block after them (a
    latent attention and a mixture of experts, then an RMS norm before the model's output), in
    llama.cpp's layout; ``agree`` as above. A layer is recurrent where it has no key-value head."""
    arch, d_inner = BAILINGMOE3, head_dim * n_head
    writer, tmp, fields, n_vocab = open_hybrid(path, tokenizer_source, arch, len(layers))
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff_exp)
    writer.add_head_count(n_head)
    writer.add_head_count_kv([1 if kind == "a" else 0 for kind in layers] + [1])  # one latent key-value head
    writer.add_key_length(kv_lora_rank + n_rot)  # the cache holds the latent and the rotated part
    writer.add_value_length(kv_lora_rank)
    writer.add_uint32(f"{arch}.attention.key_length_mla", qk_nope + n_rot)
    writer.add_uint32(f"{arch}.attention.value_length_mla", v_head_dim)
    writer.add_uint32(f"{arch}.attention.kv_lora_rank", kv_lora_rank)
    writer.add_rope_dimension_count(n_rot)
    writer.add_rope_freq_base(10000.0)
    writer.add_uint32(f"{arch}.kda.head_dim", head_dim)
    writer.add_float32(f"{arch}.kda.gate_lower_bound", -5.0)
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(n_ff_exp)
    writer.add_expert_shared_feed_forward_length(n_ff_exp)
    writer.add_expert_shared_count(1)
    writer.add_leading_dense_block_count(0)
    writer.add_expert_weights_norm(True)
    writer.add_expert_weights_scale(1.0)
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    writer.add_layer_norm_rms_eps(1e-6)
    add_ssm_and_vocab(writer, arch, fields, n_vocab, conv_kernel=d_conv)
    weight = weights(31 if agree else 37, agree)
    ones = np.ones(n_embd, dtype=np.float32)

    def latent_attention(p: str) -> None:
        writer.add_tensor(p + "attn_q.weight", weight(n_head * (qk_nope + n_rot), n_embd))
        writer.add_tensor(p + "attn_kv_a_mqa.weight", weight(kv_lora_rank + n_rot, n_embd))
        writer.add_tensor(p + "attn_kv_a_norm.weight", np.ones(kv_lora_rank, dtype=np.float32))
        writer.add_tensor(p + "attn_k_b.weight", weight(n_head, kv_lora_rank, qk_nope))
        writer.add_tensor(p + "attn_v_b.weight", weight(n_head, v_head_dim, kv_lora_rank))
        writer.add_tensor(p + "attn_gate.weight", weight(n_head, n_embd))
        writer.add_tensor(p + "attn_output.weight", weight(n_embd, n_head * v_head_dim, out=True))

    def experts(p: str) -> None:
        writer.add_tensor(p + "ffn_norm.weight", ones)
        add_experts(writer, p, weight, n_embd, n_expert, n_ff_exp)

    add_ends(writer, weight, n_vocab, n_embd)
    for i, kind in enumerate(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        if kind == "k":
            for x in "qkv":
                writer.add_tensor(p + f"attn_{x}.weight", weight(d_inner, n_embd))
                writer.add_tensor(p + f"ssm_conv1d_{x}.weight", weight(d_inner, 1, d_conv, scale=0.5))
            writer.add_tensor(p + "ssm_f_a.weight", weight(d_inner, n_embd))
            writer.add_tensor(p + "ssm_beta.weight", weight(n_head, n_embd))
            writer.add_tensor(p + "ssm_a", -np.ones((n_head, 1), dtype=np.float32))
            writer.add_tensor(p + "ssm_dt.bias", np.zeros(d_inner, dtype=np.float32))
            writer.add_tensor(p + "ssm_g_a.weight", weight(d_inner, n_embd))
            writer.add_tensor(p + "ssm_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(p + "attn_output.weight", weight(n_embd, d_inner, out=True))
        else:
            latent_attention(p)
        experts(p)
    p = f"blk.{len(layers)}."
    add_nextn(writer, p, n_embd, weight, agree)
    writer.add_tensor(p + "layer_output_norm.weight", ones)
    writer.add_tensor(p + "attn_norm.weight", ones)
    latent_attention(p)
    experts(p)
    finish(writer, tmp, path)
    return path


def bailing_mtp_model(cache: Path, tokenizer_source: Path, *, agree: bool) -> Path:
    """The cached tiny Bailing-MoE 3 with an MTP block, written on first use."""
    return cached_mtp(cache, BAILINGMOE3, agree, lambda p: write_bailing_mtp_model(p, tokenizer_source, agree=agree))


def hybrid_mtp_model(cache: Path, tokenizer_source: Path, arch: str, *, agree: bool) -> Path:
    """The cached tiny hybrid MTP model of ``arch`` (qwen35, qwen35moe, qwen3next, nemotron_h_moe or
    bailingmoe3)."""
    if arch == NEMOTRON_H_MOE:
        return nemotron_mtp_model(cache, tokenizer_source, agree=agree)
    if arch == BAILINGMOE3:
        return bailing_mtp_model(cache, tokenizer_source, agree=agree)
    return qwen35_mtp_model(cache, tokenizer_source, agree=agree, arch=arch)
