"""Tiny transformer models with an MTP block in the layouts of the other families llama.cpp runs MTP
for, beside GLM-4.5's (tests/tiny_mtp.py), with SmolLM2's vocabulary:

- DeepSeek V3 (``deepseek2``) and V3.2 (``deepseek32``): multi-head latent attention (queries and
  keys-values through low-rank projections; the cache holds the latent), a dense first layer,
  then a mixture of experts with a shared one; V3.2 adds the sparse attention's indexer, which
  picks the ``top_k`` cells each token attends to (a cache of its own beside the latent one), and
  so does GLM-5 (``glm-dsa``), in V3.2's layout;
- Step 3.5 (``step35``): sliding-window layers beside full-attention ones (two caches, the window's
  dropping what falls behind it), a per-head attention gate, and a mixture of experts with a
  shared one; MiMo-V2 (``mimo2``): the same windows, with attention sinks, and experts alone;
  Hunyuan V3 (``hy_v3``): full attention only, experts with a shared one; Cohere Command's
  mixture of experts (``cohere2moe``): windows, layer norms, attention and feed-forward side by
  side from one norm.

And one hybrid: Qwen4-exp (``qwen4exp``), gated delta nets beside a sparse attention over pooled
blocks of cells, its residual stream widened into several mixed ones (hyper-connections).

``agree`` as in tests/tiny_mtp.py: a head that predicts exactly what the model predicts, or a
random one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import ExpertGatingFuncType, GGUFWriter
from tiny_model import add_fields, finish
from tiny_mtp import (
    add_ends,
    add_experts,
    add_gated_experts,
    add_nextn,
    add_ssm_and_vocab,
    cached_mtp,
    open_hybrid,
    weights,
)

DEEPSEEK2 = "deepseek2"
DEEPSEEK32 = "deepseek32"
GLM_DSA = "glm-dsa"  # GLM-5: DeepSeek V3.2's attention
STEP35 = "step35"
MIMO2 = "mimo2"
HY_V3 = "hy_v3"
COHERE2MOE = "cohere2moe"


def add_shape(writer: GGUFWriter, arch: str, fields: dict[str, object], n_vocab: int, *, n_embd: int, n_head: int,
              n_expert: int, n_ff: int, n_ff_exp: int, gating: int = ExpertGatingFuncType.SIGMOID.value) -> None:
    """What every one of these models says of its shape, its experts (``gating``: how the router
    scores them, llama.cpp's number) and its vocabulary."""
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(n_ff_exp)
    writer.add_expert_shared_count(1)
    writer.add_expert_weights_norm(True)
    writer.add_expert_weights_scale(1.0)
    writer.add_uint32(f"{arch}.expert_gating_func", gating)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0)  # all F32
    add_fields(writer, {k: f.contents() for k, f in fields.items()})  # type: ignore[attr-defined]


def add_dense(writer: GGUFWriter, p: str, weight: Callable[..., np.ndarray], n_embd: int, n_ff: int) -> None:
    """A dense gated feed-forward."""
    writer.add_tensor(p + "ffn_gate.weight", weight(n_ff, n_embd))
    writer.add_tensor(p + "ffn_up.weight", weight(n_ff, n_embd))
    writer.add_tensor(p + "ffn_down.weight", weight(n_embd, n_ff, out=True))


def finish_head(writer: GGUFWriter, tmp: Path, path: Path, p: str, weight: Callable[..., np.ndarray], agree: bool,
                n_embd: int) -> Path:
    """The MTP block's own tensors (at ``p``) and the norm it ends with, then the file put in place."""
    add_nextn(writer, p, n_embd, weight, agree)
    writer.add_tensor(p + "nextn.shared_head_norm.weight", np.ones(n_embd, dtype=np.float32))
    finish(writer, tmp, path)
    return path


def write_deepseek_mtp_model(path: Path, tokenizer_source: Path, *, agree: bool, arch: str = DEEPSEEK32,
                             n_embd: int = 64, n_head: int = 4, q_lora_rank: int = 32, kv_lora_rank: int = 32,
                             n_rot: int = 8, qk_nope: int = 16, v_head_dim: int = 16, n_ff: int = 128,
                             n_ff_exp: int = 32, n_expert: int = 4, n_trunk: int = 2, indexer_heads: int = 8,
                             indexer_dim: int = 64, indexer_top_k: int = 16, temperature_scale: float = 0.0) -> Path:
    """A tiny DeepSeek V3 (``deepseek2``), V3.2 (``deepseek32``, with the sparse attention's
    indexer: a token attends to ``indexer_top_k`` cells at most) or GLM-5 (``glm-dsa``, the same)
    with one MTP block (latent attention, a mixture of experts, and a norm of its own before the
    model's output). Eight indexer heads: with two, a cell's score is often exactly zero (each
    head's is cut at zero), and which of the tied cells a token attends to depends on where they
    lie in the cache. ``temperature_scale``: Mistral Large 3's attention temperature (DeepSeek V3's
    layout), which llama.cpp's MTP head does not run."""
    if arch not in (DEEPSEEK2, DEEPSEEK32, GLM_DSA):
        raise ValueError(f"not a DeepSeek layout: {arch}")
    writer, tmp, fields, n_vocab = open_hybrid(path, tokenizer_source, arch, n_trunk, "transformer")
    writer.add_head_count_kv(1)  # one latent key-value head
    writer.add_key_length(kv_lora_rank + n_rot)  # the cache holds the latent and the rotated part
    writer.add_value_length(kv_lora_rank)
    writer.add_uint32(f"{arch}.attention.key_length_mla", qk_nope + n_rot)
    writer.add_uint32(f"{arch}.attention.value_length_mla", v_head_dim)
    writer.add_uint32(f"{arch}.attention.q_lora_rank", q_lora_rank)
    writer.add_uint32(f"{arch}.attention.kv_lora_rank", kv_lora_rank)
    writer.add_rope_dimension_count(n_rot)
    writer.add_leading_dense_block_count(1)
    if temperature_scale:
        writer.add_float32(f"{arch}.attention.temperature_scale", temperature_scale)
        writer.add_uint32(f"{arch}.attention.temperature_length", 64)
    if arch != DEEPSEEK2:
        writer.add_uint32(f"{arch}.attention.indexer.head_count", indexer_heads)
        writer.add_uint32(f"{arch}.attention.indexer.key_length", indexer_dim)
        writer.add_uint32(f"{arch}.attention.indexer.top_k", indexer_top_k)
    add_shape(writer, arch, fields, n_vocab, n_embd=n_embd, n_head=n_head, n_expert=n_expert, n_ff=n_ff,
              n_ff_exp=n_ff_exp)
    weight = weights(41 if agree else 43, agree)
    ones = add_ends(writer, weight, n_vocab, n_embd)
    for i in range(n_trunk + 1):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        writer.add_tensor(p + "attn_q_a.weight", weight(q_lora_rank, n_embd))
        writer.add_tensor(p + "attn_q_a_norm.weight", np.ones(q_lora_rank, dtype=np.float32))
        writer.add_tensor(p + "attn_q_b.weight", weight(n_head * (qk_nope + n_rot), q_lora_rank))
        writer.add_tensor(p + "attn_kv_a_mqa.weight", weight(kv_lora_rank + n_rot, n_embd))
        writer.add_tensor(p + "attn_kv_a_norm.weight", np.ones(kv_lora_rank, dtype=np.float32))
        writer.add_tensor(p + "attn_k_b.weight", weight(n_head, kv_lora_rank, qk_nope))
        writer.add_tensor(p + "attn_v_b.weight", weight(n_head, v_head_dim, kv_lora_rank))
        writer.add_tensor(p + "attn_output.weight", weight(n_embd, n_head * v_head_dim, out=True))
        if arch != DEEPSEEK2:
            writer.add_tensor(p + "indexer.k_norm.weight", np.ones(indexer_dim, dtype=np.float32))
            writer.add_tensor(p + "indexer.k_norm.bias", np.zeros(indexer_dim, dtype=np.float32))
            writer.add_tensor(p + "indexer.proj.weight", weight(indexer_heads, n_embd))
            writer.add_tensor(p + "indexer.attn_k.weight", weight(indexer_dim, n_embd))
            writer.add_tensor(p + "indexer.attn_q_b.weight", weight(indexer_heads * indexer_dim, q_lora_rank))
        writer.add_tensor(p + "ffn_norm.weight", ones)
        if i == 0:  # the leading dense layer
            add_dense(writer, p, weight, n_embd, n_ff)
        else:
            add_experts(writer, p, weight, n_embd, n_expert, n_ff_exp)
    return finish_head(writer, tmp, path, f"blk.{n_trunk}.", weight, agree, n_embd)


def write_window_mtp_model(path: Path, tokenizer_source: Path, *, agree: bool, arch: str = STEP35, n_embd: int = 64,
                           n_head: int = 4, n_head_kv: int = 2, layers: str = "sf", window: int = 8, n_ff: int = 128,
                           n_ff_exp: int = 32, n_expert: int = 4) -> Path:
    """A tiny Step 3.5 (``step35``), MiMo-V2 (``mimo2``) or Hunyuan V3 (``hy_v3``, whose layers are
    all "f"): sliding-window layers "s" (a window of ``window`` tokens) beside full-attention ones
    "f", the first feed-forward dense, the others mixtures of experts, and one MTP block (full
    attention, experts (MiMo-V2's dense), a norm of its own). Step 3.5's and Hunyuan V3's queries
    and keys are normed per head, their experts have a shared one, and a gate per head scales Step
    3.5's attention's output; MiMo-V2's queries, keys and values come from one projection, and its
    attention has sinks. Cohere's (``cohere2moe``) layers norm their input once (a layer norm) for
    the attention and the feed-forward beside it, and scale the logits."""
    if arch not in (STEP35, MIMO2, HY_V3, COHERE2MOE):
        raise ValueError(f"not a sliding-window MTP layout: {arch}")
    if arch == HY_V3:
        layers = "f" * len(layers)
    head_dim = n_embd // n_head
    writer, tmp, fields, n_vocab = open_hybrid(path, tokenizer_source, arch, len(layers), "transformer")
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    if arch != HY_V3:
        writer.add_sliding_window(window)
        writer.add_array(f"{arch}.attention.sliding_window_pattern", [kind == "s" for kind in layers] + [False])
    if arch != MIMO2:
        writer.add_expert_shared_feed_forward_length(n_ff_exp)
    if arch == COHERE2MOE:
        writer.add_layer_norm_eps(1e-5)
        writer.add_logit_scale(0.5)
        writer.add_leading_dense_block_count(1)
    add_shape(writer, arch, fields, n_vocab, n_embd=n_embd, n_head=n_head, n_expert=n_expert, n_ff=n_ff,
              n_ff_exp=n_ff_exp)
    weight = weights(47 if agree else 53, agree)
    ones = add_ends(writer, weight, n_vocab, n_embd)
    for i in range(len(layers) + 1):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        if arch != MIMO2:
            writer.add_tensor(p + "attn_q.weight", weight(n_head * head_dim, n_embd))
            writer.add_tensor(p + "attn_k.weight", weight(n_head_kv * head_dim, n_embd))
            writer.add_tensor(p + "attn_v.weight", weight(n_head_kv * head_dim, n_embd))
        if arch in (STEP35, HY_V3):
            writer.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        if arch == STEP35:
            writer.add_tensor(p + "attn_gate.weight", weight(n_head, n_embd))
        elif arch == MIMO2:  # MiMo-V2's head takes the queries, keys and values from one projection
            writer.add_tensor(p + "attn_qkv.weight", weight((n_head + 2 * n_head_kv) * head_dim, n_embd))
            writer.add_tensor(p + "attn_sinks.weight", weight(n_head))
        writer.add_tensor(p + "attn_output.weight", weight(n_embd, n_head * head_dim, out=True))
        if arch != COHERE2MOE:
            writer.add_tensor(p + "ffn_norm.weight", ones)
        if i == 0 or (arch == MIMO2 and i == len(layers)):  # MiMo-V2's head is dense too
            add_dense(writer, p, weight, n_embd, n_ff)
        elif arch != MIMO2:
            # Hunyuan V3's selection bias has no suffix, Cohere's experts none
            bias = {STEP35: "exp_probs_b.bias", HY_V3: "exp_probs_b"}.get(arch)
            add_experts(writer, p, weight, n_embd, n_expert, n_ff_exp, bias)
        else:
            writer.add_tensor(p + "ffn_gate_inp.weight", weight(n_expert, n_embd))
            writer.add_tensor(p + "exp_probs_b.bias", np.zeros(n_expert, dtype=np.float32))
            writer.add_tensor(p + "ffn_gate_exps.weight", weight(n_expert, n_ff_exp, n_embd))
            writer.add_tensor(p + "ffn_up_exps.weight", weight(n_expert, n_ff_exp, n_embd))
            writer.add_tensor(p + "ffn_down_exps.weight", weight(n_expert, n_embd, n_ff_exp, out=True))
    return finish_head(writer, tmp, path, f"blk.{len(layers)}.", weight, agree, n_embd)


def family_mtp_model(cache: Path, tokenizer_source: Path, arch: str, *, agree: bool) -> Path:
    """The cached tiny MTP model of ``arch`` (deepseek2, deepseek32, glm-dsa, step35, mimo2, hy_v3 or
    cohere2moe), written on first use."""
    if arch in (STEP35, MIMO2, HY_V3, COHERE2MOE):
        return cached_mtp(cache, arch, agree,
                          lambda p: write_window_mtp_model(p, tokenizer_source, agree=agree, arch=arch))
    return cached_mtp(cache, arch, agree,
                      lambda p: write_deepseek_mtp_model(p, tokenizer_source, agree=agree, arch=arch))


QWEN4EXP = "qwen4exp"


def write_qwen4exp_mtp_model(path: Path, tokenizer_source: Path, *, agree: bool, n_embd: int = 64, n_head: int = 4,
                             n_head_kv: int = 2, layers: str = "gga", d_state: int = 16, n_k_heads: int = 2,
                             n_v_heads: int = 4, d_conv: int = 4, n_ff_exp: int = 32, n_expert: int = 4, hc: int = 2,
                             hc_rank: int = 8, indexer_heads: int = 4, indexer_dim: int = 16, indexer_top_k: int = 16,
                             pool: int = 4) -> Path:
    """A tiny Qwen4-exp (hybrid: gated-delta-net layers "g" beside gated attention layers "a" whose
    sparse attention attends to the ``indexer_top_k`` cells an indexer picks among pooled blocks of
    ``pool`` cells; ``hc`` residual streams mixed before and after each block (hyper-connections)
    instead of layer norms, the last mixer the output norm; experts everywhere) with one MTP block.
    The agreeing head's last mixer is the model's own."""
    arch, head_dim = QWEN4EXP, n_embd // n_head
    key_dim, value_dim, hc_dim = d_state * n_k_heads, d_state * n_v_heads, hc * n_embd
    writer, tmp, fields, n_vocab = open_hybrid(path, tokenizer_source, arch, len(layers))
    writer.add_array(f"{arch}.attention.recurrent_layers", [kind == "g" for kind in layers] + [False])
    writer.add_array(f"{arch}.attention.compress_ratios", [0 if kind == "g" else pool for kind in layers] + [pool])
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff_exp)
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(n_ff_exp)
    writer.add_expert_shared_feed_forward_length(n_ff_exp)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_array(f"{arch}.rope.dimension_sections", [head_dim // 4, head_dim // 4 - head_dim // 8, head_dim // 8, 0])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_uint32(f"{arch}.hyper_connection.count", hc)
    writer.add_uint32(f"{arch}.hyper_connection.low_rank", hc_rank)
    writer.add_uint32(f"{arch}.attention.indexer.head_count", indexer_heads)
    writer.add_uint32(f"{arch}.attention.indexer.key_length", indexer_dim)
    writer.add_uint32(f"{arch}.attention.indexer.top_k", indexer_top_k)
    add_ssm_and_vocab(writer, arch, fields, n_vocab, conv_kernel=d_conv, inner_size=value_dim, state_size=d_state,
                      time_step_rank=n_v_heads, group_count=n_k_heads)
    weight = weights(59 if agree else 61, agree)

    def mixer_parts() -> dict[str, np.ndarray]:  # a mixer's gammas, and its low-rank gate
        return {"norm": np.ones((hc, n_embd), dtype=np.float32), "down": weight(hc_rank, hc_dim),
                "up": weight(hc_dim, hc_rank)}

    head = mixer_parts()
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd, scale=1.0))
    for name, value in head.items():
        writer.add_tensor(f"output_hc_{name}.weight", value)
    writer.add_tensor("output.weight", weight(n_vocab, n_embd, scale=1.0))
    for i, kind in enumerate(layers + "m"):
        p = f"blk.{i}."
        for block in ("attn", "ffn"):  # the mixers before the token mixer and before the experts
            for name, value in mixer_parts().items():
                writer.add_tensor(p + f"hc_{block}_{name}.weight", value)
            writer.add_tensor(p + f"hc_{block}_inject.weight", weight(hc, hc_dim))
        if kind == "g":
            writer.add_tensor(p + "attn_qkv.weight", weight(2 * key_dim + value_dim, n_embd))
            writer.add_tensor(p + "attn_gate.weight", weight(value_dim, n_embd))
            writer.add_tensor(p + "ssm_conv1d.weight", weight(2 * key_dim + value_dim, d_conv, scale=0.5))
            writer.add_tensor(p + "ssm_dt.bias", np.zeros(n_v_heads, dtype=np.float32))
            writer.add_tensor(p + "ssm_a", -np.ones(n_v_heads, dtype=np.float32))
            writer.add_tensor(p + "ssm_beta.weight", weight(n_v_heads, n_embd))
            writer.add_tensor(p + "ssm_alpha.weight", weight(n_v_heads, n_embd))
            writer.add_tensor(p + "ssm_norm.weight", np.ones(d_state, dtype=np.float32))
            writer.add_tensor(p + "ssm_out.weight", weight(n_embd, value_dim, out=True))
        else:
            writer.add_tensor(p + "attn_q.weight", weight(2 * n_head * head_dim, n_embd))  # queries and their gates
            writer.add_tensor(p + "attn_k.weight", weight(n_head_kv * head_dim, n_embd))
            writer.add_tensor(p + "attn_v.weight", weight(n_head_kv * head_dim, n_embd))
            writer.add_tensor(p + "attn_output.weight", weight(n_embd, n_head * head_dim, out=True))
            writer.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(p + "indexer.q_proj.weight", weight(indexer_heads * indexer_dim, n_embd))
            writer.add_tensor(p + "indexer.k_proj.weight", weight(indexer_dim, n_embd))
            writer.add_tensor(p + "indexer.q_norm.weight", np.ones(indexer_dim, dtype=np.float32))
            writer.add_tensor(p + "indexer.k_norm.weight", np.ones(indexer_dim, dtype=np.float32))
        add_gated_experts(writer, p, weight, n_embd, n_expert, n_ff_exp)
        if kind == "m":
            add_nextn(writer, p, n_embd, weight, agree, streams=hc)
            for name, value in (head if agree else mixer_parts()).items():
                writer.add_tensor(p + f"nextn.hc_head_{name}.weight", value)
    finish(writer, tmp, path)
    return path


def qwen4exp_mtp_model(cache: Path, tokenizer_source: Path, *, agree: bool) -> Path:
    """The cached tiny Qwen4-exp with an MTP block, written on first use."""
    return cached_mtp(cache, QWEN4EXP, agree, lambda p: write_qwen4exp_mtp_model(p, tokenizer_source, agree=agree))


DEEPSEEK4 = "deepseek4"


def write_deepseek4_mtp_model(path: Path, tokenizer_source: Path, *, agree: bool, n_embd: int = 64, n_head: int = 4,
                              head_dim: int = 32, n_rot: int = 8, q_lora_rank: int = 32, o_groups: int = 2,
                              o_rank: int = 16, window: int = 8, ratios: tuple[int, ...] = (4, 128), n_ff_exp: int = 32,
                              n_expert: int = 4, hc: int = 4, indexer_heads: int = 4, indexer_dim: int = 64,
                              indexer_top_k: int = 16) -> Path:
    """A tiny DeepSeek V4: a key-value head shared by every query head (one projection for both,
    attention sinks, a window of ``window`` tokens), beside it in each layer the compressed blocks
    of ``ratios`` cells (4: attended to where an indexer picks them; 128: all of them); ``hc``
    residual streams mixed before and after each block (Sinkhorn-balanced hyper-connections);
    experts with a shared one; one MTP block."""
    arch = DEEPSEEK4
    hc_dim, mix = hc * n_embd, (2 + hc) * hc
    writer, tmp, fields, n_vocab = open_hybrid(path, tokenizer_source, arch, len(ratios), "transformer")
    writer.add_head_count_kv(1)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(n_rot)
    writer.add_sliding_window(window)
    writer.add_uint32(f"{arch}.attention.q_lora_rank", q_lora_rank)
    writer.add_uint32(f"{arch}.attention.output_group_count", o_groups)
    writer.add_uint32(f"{arch}.attention.output_lora_rank", o_rank)
    writer.add_float32(f"{arch}.attention.compress_rope_freq_base", 160000.0)
    writer.add_array(f"{arch}.attention.compress_ratios", [*ratios, 0])
    writer.add_uint32(f"{arch}.attention.indexer.head_count", indexer_heads)
    writer.add_uint32(f"{arch}.attention.indexer.key_length", indexer_dim)
    writer.add_uint32(f"{arch}.attention.indexer.top_k", indexer_top_k)
    writer.add_uint32(f"{arch}.hyper_connection.count", hc)
    writer.add_uint32(f"{arch}.hyper_connection.sinkhorn_iterations", 3)
    writer.add_float32(f"{arch}.hyper_connection.epsilon", 1e-6)
    writer.add_uint32(f"{arch}.hash_layer_count", 0)
    writer.add_float32(f"{arch}.swiglu_clamp_exp", 10.0)
    add_shape(writer, arch, fields, n_vocab, n_embd=n_embd, n_head=n_head, n_expert=n_expert, n_ff=n_ff_exp,
              n_ff_exp=n_ff_exp, gating=4)  # the square root of a softplus
    weight = weights(67 if agree else 71, agree)
    ones = add_ends(writer, weight, n_vocab, n_embd)
    writer.add_tensor("output_hc_fn.weight", weight(hc, hc_dim))
    writer.add_tensor("output_hc_base.weight", np.zeros(hc, dtype=np.float32))
    writer.add_tensor("output_hc_scale.weight", np.ones(1, dtype=np.float32))
    for i, ratio in enumerate([*ratios, 0]):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        writer.add_tensor(p + "attn_sinks.weight", weight(n_head))
        writer.add_tensor(p + "attn_q_a.weight", weight(q_lora_rank, n_embd))
        writer.add_tensor(p + "attn_q_a_norm.weight", np.ones(q_lora_rank, dtype=np.float32))
        writer.add_tensor(p + "attn_q_b.weight", weight(n_head * head_dim, q_lora_rank))
        writer.add_tensor(p + "attn_kv.weight", weight(head_dim, n_embd))
        writer.add_tensor(p + "attn_kv_a_norm.weight", np.ones(head_dim, dtype=np.float32))
        writer.add_tensor(p + "attn_output_a.weight", weight(o_rank * o_groups, n_head * head_dim // o_groups))
        writer.add_tensor(p + "attn_output_b.weight", weight(n_embd, o_groups * o_rank, out=True))
        for block in ("attn", "ffn"):
            writer.add_tensor(p + f"hc_{block}_fn.weight", weight(mix, hc_dim))
            writer.add_tensor(p + f"hc_{block}_base.weight", np.zeros(mix, dtype=np.float32))
            writer.add_tensor(p + f"hc_{block}_scale.weight", np.ones(3, dtype=np.float32))
        if ratio:
            width = (2 if ratio == 4 else 1) * head_dim  # blocks of 4 overlap their neighbours
            writer.add_tensor(p + "attn_compressor_kv.weight", weight(width, n_embd))
            writer.add_tensor(p + "attn_compressor_gate.weight", weight(width, n_embd))
            writer.add_tensor(p + "attn_compressor_ape.weight", weight(ratio, width))
            writer.add_tensor(p + "attn_compressor_norm.weight", np.ones(head_dim, dtype=np.float32))
        if ratio == 4:
            writer.add_tensor(p + "indexer.proj.weight", weight(indexer_heads, n_embd))
            writer.add_tensor(p + "indexer.attn_q_b.weight", weight(indexer_heads * indexer_dim, q_lora_rank))
            writer.add_tensor(p + "indexer_compressor_kv.weight", weight(2 * indexer_dim, n_embd))
            writer.add_tensor(p + "indexer_compressor_gate.weight", weight(2 * indexer_dim, n_embd))
            writer.add_tensor(p + "indexer_compressor_ape.weight", weight(ratio, 2 * indexer_dim))
            writer.add_tensor(p + "indexer_compressor_norm.weight", np.ones(indexer_dim, dtype=np.float32))
        writer.add_tensor(p + "ffn_norm.weight", ones)
        add_experts(writer, p, weight, n_embd, n_expert, n_ff_exp)
    return finish_head(writer, tmp, path, f"blk.{len(ratios)}.", weight, agree, n_embd)


def deepseek4_mtp_model(cache: Path, tokenizer_source: Path, *, agree: bool) -> Path:
    """The cached tiny DeepSeek V4 with an MTP block, written on first use."""
    return cached_mtp(cache, DEEPSEEK4, agree, lambda p: write_deepseek4_mtp_model(p, tokenizer_source, agree=agree))
