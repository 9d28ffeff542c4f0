"""Tiny random-weight llama models for fast native tests.

The weights are random (2 layers, width 64), so the text is nonsense, but the tokenizer metadata is
SmolLM2's real one (GPT-2 style BPE, 49152 tokens), so real text tokenizes and detokenizes exactly
as with the real model. A model is deterministic for a given seed and cached by its parameters.

:func:`spm_model` writes one with a small SentencePiece vocabulary of its own instead (Llama's
``llama`` tokenizer with byte fallback and a space prefix) and a Gemma-style chat template whose
turn markers are control tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, PoolingType

TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)


def copy_tokenizer(source: Path) -> dict[str, object]:
    """The tokenizer metadata of a GGUF file, to write into another."""
    reader = GGUFReader(str(source))
    return {k: reader.fields[k] for k in TOKENIZER_KEYS if k in reader.fields}


def add_fields(writer: GGUFWriter, fields: dict[str, object]) -> None:
    """Write metadata values, typed by their Python type (ints as uint32)."""
    for key, value in fields.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))  # type: ignore[call-overload]


def cached(path: Path, write: Callable[[Path], object]) -> Path:
    """``path``, written by ``write`` on first use."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    return path


def finish(writer: GGUFWriter, tmp: Path, path: Path) -> None:
    """Write the file out under a temporary name, then put it in place (a reader never sees half)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)


def write_tiny_model(
    path: Path,
    tokenizer_source: Path | None,
    *,
    tokenizer: dict[str, object] | None = None,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 4096,
    seed: int = 0,
    deltas: dict[str, np.ndarray] | None = None,
) -> Path:
    """A tiny llama; ``deltas`` are added to the named weights (a LoRA merged into them, say)."""
    fields = copy_tokenizer(tokenizer_source) if tokenizer_source is not None else {}
    n_vocab = len(fields["tokenizer.ggml.tokens"].data) if fields else len(tokenizer["tokenizer.ggml.tokens"])  # type: ignore[index, arg-type]
    head_dim = n_embd // n_head

    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name("aiollama tiny test model")
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0)  # all F32
    add_fields(writer, {k: f.contents() for k, f in fields.items()})  # type: ignore[attr-defined]
    add_fields(writer, tokenizer or {})

    rng = np.random.default_rng(seed)

    def add(name: str, array: np.ndarray) -> None:
        writer.add_tensor(name, (array + deltas[name]).astype(np.float32) if deltas and name in deltas else array)

    def weight(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    # numpy shape (rows, cols) is ggml ne = [cols, rows]
    add("token_embd.weight", weight(n_vocab, n_embd, scale=1.0))
    add("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add(p + "attn_q.weight", weight(n_head * head_dim, n_embd, scale=0.2))
        add(p + "attn_k.weight", weight(n_head_kv * head_dim, n_embd, scale=0.2))
        add(p + "attn_v.weight", weight(n_head_kv * head_dim, n_embd, scale=0.2))
        add(p + "attn_output.weight", weight(n_embd, n_head * head_dim, scale=0.2))
        add(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add(p + "ffn_gate.weight", weight(n_ff, n_embd, scale=0.2))
        add(p + "ffn_up.weight", weight(n_ff, n_embd, scale=0.2))
        add(p + "ffn_down.weight", weight(n_embd, n_ff, scale=0.2))
    finish(writer, tmp, path)
    return path


def tiny_model(cache: Path, tokenizer_source: Path, **params: int) -> Path:
    """The cached tiny model for these parameters, written on first use."""
    tag = "-".join(f"{k}{v}" for k, v in sorted(params.items())) or "default"
    path = cache / f"tiny-llama-v1-{tag}.gguf"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        write_tiny_model(path, tokenizer_source, **params)
    return path


def quantized_model(cache: Path, tokenizer_source: Path, kind: str, **params: int) -> Path:
    """The cached tiny model for ``params``, quantized by llama.cpp to ``kind`` (every weight matrix;
    K-quants need a width that is a multiple of 256)."""
    from aiollama.native.model import quantize

    source = tiny_model(cache, tokenizer_source, **params)
    path = source.with_name(f"{source.stem}-{kind}.gguf")
    if not path.is_file():
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        quantize(source, tmp, kind)
        os.replace(tmp, path)
    return path


GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

SPM_WORDS = ("Hello world What is the capital of France Paris Tell me a story about tokens and chat "
             "templates user model system Be brief Name colour Another one Unicode line breaks tabs spaces "
             "leading trailing")


def spm_tokenizer() -> dict[str, object]:
    """A small SentencePiece vocabulary: control tokens, 256 byte-fallback tokens, characters, and
    every piece of a few words (with and without the space mark) scored by length, so that merges
    build whole words; plus "?<", a piece that spans what a template and a message would join."""
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
    types = [2, 3, 3, 3, 3]  # UNKNOWN, CONTROL
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256  # BYTE
    pieces: set[str] = set("\u2581?<>!.,:;'\"-")
    pieces.add("?<")
    for word in SPM_WORDS.split():
        for form in (word, "\u2581" + word):
            pieces.update(form[i:j] for i in range(len(form)) for j in range(i + 1, len(form) + 1))
    ordered = sorted(pieces, key=lambda p: (len(p), p))
    tokens += ordered
    types += [1] * len(ordered)  # NORMAL
    scores = [0.0] * (5 + 256) + [float(len(p)) for p in ordered]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.chat_template": GEMMA_STYLE_TEMPLATE,
    }


def spm_model(cache: Path) -> Path:
    """The cached tiny model with the SentencePiece vocabulary above, written on first use."""
    path = cache / "tiny-llama-spm-v1.gguf"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        write_tiny_model(path, None, tokenizer=spm_tokenizer())
    return path


def mamba_model(cache: Path, tokenizer_source: Path, *, layers: str = "mm") -> Path:
    """The cached tiny Mamba model (``layers`` "m" each), or with attention layers among them ("a")
    a Jamba: Mamba beside attention, a hybrid. Written on first use."""
    path = cache / ("tiny-mamba-v2.gguf" if layers == "mm" else f"tiny-jamba-v1-{layers}.gguf")
    return cached(path, lambda p: write_mamba_model(p, tokenizer_source, layers=layers))


def write_mamba_model(path: Path, tokenizer_source: Path, *, layers: str = "mm", n_embd: int = 64,
                      n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128) -> Path:
    """A tiny random Mamba: a purely recurrent model (a state per sequence, no KV cells). With
    attention layers ("a" in ``layers``) a Jamba instead, in llama.cpp's layout: ``head_count_kv``
    per layer (0 for a Mamba layer), norms of dt, B and C, and a feed-forward block in every layer."""
    fields = copy_tokenizer(tokenizer_source)
    n_vocab = len(fields["tokenizer.ggml.tokens"].data)  # type: ignore[attr-defined]
    d_inner, d_conv, d_state, dt_rank = 2 * n_embd, 4, 16, 4
    jamba = "a" in layers
    head_dim = n_embd // n_head
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), "jamba" if jamba else "mamba")
    writer.add_name("aiollama tiny recurrent test model")
    writer.add_block_count(len(layers))
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff if jamba else 0)
    writer.add_head_count(n_head if jamba else 0)
    if jamba:
        writer.add_head_count_kv([n_head_kv if kind == "a" else 0 for kind in layers])
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(dt_rank)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(0)
    add_fields(writer, {k: f.contents() for k, f in fields.items()})  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)

    def weight(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd, scale=1.0))
    writer.add_tensor("output_norm.weight", ones(n_embd))
    for i, kind in enumerate(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones(n_embd))
        if kind == "a":
            writer.add_tensor(p + "attn_q.weight", weight(n_head * head_dim, n_embd))
            writer.add_tensor(p + "attn_k.weight", weight(n_head_kv * head_dim, n_embd))
            writer.add_tensor(p + "attn_v.weight", weight(n_head_kv * head_dim, n_embd))
            writer.add_tensor(p + "attn_output.weight", weight(n_embd, n_head * head_dim))
        else:
            writer.add_tensor(p + "ssm_in.weight", weight(2 * d_inner, n_embd))
            writer.add_tensor(p + "ssm_conv1d.weight", weight(d_inner, d_conv))
            writer.add_tensor(p + "ssm_conv1d.bias", weight(d_inner))
            writer.add_tensor(p + "ssm_x.weight", weight(dt_rank + 2 * d_state, d_inner))
            writer.add_tensor(p + "ssm_dt.weight", weight(d_inner, dt_rank))
            writer.add_tensor(p + "ssm_dt.bias", weight(d_inner))
            writer.add_tensor(p + "ssm_a", -np.abs(weight(d_inner, d_state)))
            writer.add_tensor(p + "ssm_d", weight(d_inner))
            writer.add_tensor(p + "ssm_out.weight", weight(n_embd, d_inner))
            if jamba:
                writer.add_tensor(p + "ssm_dt_norm.weight", ones(dt_rank))
                writer.add_tensor(p + "ssm_b_norm.weight", ones(d_state))
                writer.add_tensor(p + "ssm_c_norm.weight", ones(d_state))
        if jamba:
            writer.add_tensor(p + "ffn_norm.weight", ones(n_embd))
            writer.add_tensor(p + "ffn_gate.weight", weight(n_ff, n_embd))
            writer.add_tensor(p + "ffn_up.weight", weight(n_ff, n_embd))
            writer.add_tensor(p + "ffn_down.weight", weight(n_embd, n_ff))
    finish(writer, tmp, path)
    return path


def write_lfm2_model(path: Path, tokenizer_source: Path, *, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                     n_ff: int = 128, l_cache: int = 3, layers: str = "cacc") -> Path:
    """A tiny random LFM2: a hybrid of short-convolution layers ("c", a recurrent state each) and
    attention layers ("a"), in llama.cpp's layout (``head_count_kv`` per layer, 0 for a conv layer;
    the final norm under the name ``token_embd_norm``)."""
    fields = copy_tokenizer(tokenizer_source)
    n_vocab = len(fields["tokenizer.ggml.tokens"].data)  # type: ignore[attr-defined]
    head_dim = n_embd // n_head
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), "lfm2")
    writer.add_name("aiollama tiny hybrid test model")
    writer.add_block_count(len(layers))
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv([n_head_kv if kind == "a" else 0 for kind in layers])
    writer.add_uint32("lfm2.shortconv.l_cache", l_cache)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0)
    add_fields(writer, {k: f.contents() for k, f in fields.items()})  # type: ignore[attr-defined]
    rng = np.random.default_rng(5)

    def weight(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    ones = np.ones(n_embd, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd, scale=1.0))
    writer.add_tensor("token_embd_norm.weight", ones)
    for i, kind in enumerate(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        if kind == "a":
            writer.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(p + "attn_q.weight", weight(n_head * head_dim, n_embd))
            writer.add_tensor(p + "attn_k.weight", weight(n_head_kv * head_dim, n_embd))
            writer.add_tensor(p + "attn_v.weight", weight(n_head_kv * head_dim, n_embd))
            writer.add_tensor(p + "attn_output.weight", weight(n_embd, n_head * head_dim))
        else:
            writer.add_tensor(p + "shortconv.conv.weight", weight(n_embd, l_cache, scale=0.5))
            writer.add_tensor(p + "shortconv.in_proj.weight", weight(3 * n_embd, n_embd))
            writer.add_tensor(p + "shortconv.out_proj.weight", weight(n_embd, n_embd))
        writer.add_tensor(p + "ffn_norm.weight", ones)
        writer.add_tensor(p + "ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(p + "ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(p + "ffn_down.weight", weight(n_embd, n_ff))
    finish(writer, tmp, path)
    return path


def lfm2_model(cache: Path, tokenizer_source: Path) -> Path:
    """The cached tiny LFM2 (hybrid) model, written on first use."""
    return cached(cache / "tiny-lfm2-v1.gguf", lambda p: write_lfm2_model(p, tokenizer_source))


def write_bert_model(path: Path, tokenizer_source: Path, *, n_layer: int = 2, n_embd: int = 64,
                     n_head: int = 4, n_ff: int = 128, n_ctx_train: int = 512, rerank: bool = False) -> Path:
    """A tiny random BERT (non-causal, mean pooling): a dedicated embedding model. With ``rerank``,
    a reranker instead: rank pooling over a classifier head (``cls`` and ``cls.output``, one label)."""
    fields = copy_tokenizer(tokenizer_source)
    fields.pop("tokenizer.chat_template", None)
    n_vocab = len(fields["tokenizer.ggml.tokens"].data)  # type: ignore[attr-defined]
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), "bert")
    writer.add_name("aiollama tiny embedding test model")
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(PoolingType.RANK if rerank else PoolingType.MEAN)
    if rerank:
        writer.add_classifier_output_labels(["relevant"])
    writer.add_token_type_count(2)
    writer.add_file_type(0)
    add_fields(writer, {k: f.contents() for k, f in fields.items()})  # type: ignore[attr-defined]
    rng = np.random.default_rng(1)

    def weight(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    ones, zeros = np.ones(n_embd, dtype=np.float32), np.zeros(n_embd, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd, scale=1.0))
    writer.add_tensor("token_types.weight", weight(2, n_embd))
    writer.add_tensor("position_embd.weight", weight(n_ctx_train, n_embd))
    writer.add_tensor("token_embd_norm.weight", ones)
    writer.add_tensor("token_embd_norm.bias", zeros)
    for i in range(n_layer):
        p = f"blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(p + name + ".weight", weight(n_embd, n_embd))
            writer.add_tensor(p + name + ".bias", weight(n_embd))
        writer.add_tensor(p + "attn_output_norm.weight", ones)
        writer.add_tensor(p + "attn_output_norm.bias", zeros)
        writer.add_tensor(p + "ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(p + "ffn_up.bias", weight(n_ff))
        writer.add_tensor(p + "ffn_down.weight", weight(n_embd, n_ff))
        writer.add_tensor(p + "ffn_down.bias", weight(n_embd))
        writer.add_tensor(p + "layer_output_norm.weight", ones)
        writer.add_tensor(p + "layer_output_norm.bias", zeros)
    if rerank:
        writer.add_tensor("cls.weight", weight(n_embd, n_embd, scale=0.5))
        writer.add_tensor("cls.bias", weight(n_embd))
        writer.add_tensor("cls.output.weight", weight(1, n_embd, scale=1.0))
        writer.add_tensor("cls.output.bias", weight(1))
    finish(writer, tmp, path)
    return path


def bert_model(cache: Path, tokenizer_source: Path) -> Path:
    """The cached tiny BERT model, written on first use."""
    return cached(cache / "tiny-bert-v1.gguf", lambda p: write_bert_model(p, tokenizer_source))


def rerank_model(cache: Path, tokenizer_source: Path) -> Path:
    """The cached tiny reranker (a BERT with a classifier head, pooled by rank), written on first use."""
    return cached(cache / "tiny-rerank-v1.gguf", lambda p: write_bert_model(p, tokenizer_source, rerank=True))


# A Qwen-style template: tools in a system turn, calls in <tool_call> tags, tool results as
# <tool_response> user turns, and a generation prompt that opens a thinking block (as reasoning
# models' templates do), or, with enable_thinking false, writes an empty one (as Qwen3's does).
QWEN_STYLE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{% if m.content %}{{ m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments if c.function.arguments is string \
else c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif open_thinking is not defined or open_thinking %}<think>
{% endif %}{% endif %}"""

THINK_TOKENS = ("<think>", "</think>")


def reasoning_model(cache: Path, tokenizer_source: Path, *, opens_thinking: bool = True) -> Path:
    """The tiny model with SmolLM2's vocabulary plus ``<think>`` and ``</think>`` (user-defined
    tokens, as in Qwen3) and the Qwen-style template above, which opens a thinking block in its
    generation prompt (or, with ``opens_thinking=False``, leaves the model to open one)."""
    path = cache / f"tiny-reasoning-v3-{'opens' if opens_thinking else 'plain'}.gguf"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        fields = {k: f.contents() for k, f in copy_tokenizer(tokenizer_source).items()}  # type: ignore[attr-defined]
        fields["tokenizer.ggml.tokens"] = list(fields["tokenizer.ggml.tokens"]) + list(THINK_TOKENS)  # type: ignore[call-overload]
        fields["tokenizer.ggml.token_type"] = list(fields["tokenizer.ggml.token_type"]) + [4, 4]  # type: ignore[call-overload]
        template = QWEN_STYLE_TEMPLATE if opens_thinking else QWEN_STYLE_TEMPLATE.replace(
            "{% elif open_thinking is not defined or open_thinking %}<think>\n", "")
        fields["tokenizer.chat_template"] = template
        write_tiny_model(path, None, tokenizer=fields, seed=3)
    return path


def write_lora(path: Path, base: Path, *, rank: int = 4, alpha: float = 8.0, seed: int = 7,
               targets: tuple[str, ...] = ("blk.0.attn_q.weight", "blk.1.ffn_up.weight")) -> dict[str, np.ndarray]:
    """A LoRA adapter for the tiny model ``base`` (llama.cpp's layout: ``NAME.lora_a`` of ggml
    shape [n_in, rank], ``NAME.lora_b`` of [rank, n_out], ``adapter.lora.alpha``); returns what it
    adds to each weight at scale 1 (``alpha / rank * B @ A``), to merge into a model."""
    reader = GGUFReader(str(base))
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in reader.tensors}
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    deltas = {}
    for name in targets:
        n_out, n_in = shapes[name]
        a = (rng.standard_normal((rank, n_in)) * 0.3).astype(np.float32)
        b = (rng.standard_normal((n_out, rank)) * 0.3).astype(np.float32)
        writer.add_tensor(name + ".lora_a", a)
        writer.add_tensor(name + ".lora_b", b)
        deltas[name] = (alpha / rank) * (b @ a)
    finish(writer, tmp, path)
    return deltas


FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>")


def fim_model(cache: Path, tokenizer_source: Path) -> Path:
    """The tiny model with fill-in-the-middle tokens added to SmolLM2's vocabulary (control tokens,
    which llama.cpp finds by their text; the vocabulary's own ``<repo_name>`` and ``<file_sep>``
    serve the repository-level pattern)."""
    path = cache / "tiny-fim-v1.gguf"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        fields = {k: f.contents() for k, f in copy_tokenizer(tokenizer_source).items()}  # type: ignore[attr-defined]
        fields["tokenizer.ggml.tokens"] = list(fields["tokenizer.ggml.tokens"]) + list(FIM_TOKENS)  # type: ignore[call-overload]
        fields["tokenizer.ggml.token_type"] = list(fields["tokenizer.ggml.token_type"]) + [3] * len(FIM_TOKENS)  # type: ignore[call-overload]
        write_tiny_model(path, None, tokenizer=fields, seed=9)
    return path
