"""Writes a random-weight llama model of a chosen shape (F16) with the tokenizer of another GGUF file.

    python benchmarks/gpu/model.py TOKENIZER.gguf OUT.gguf [N_LAYER N_EMBD N_HEAD N_HEAD_KV N_FF]

The default shape is a 1B-class llama (16 layers, width 2048, 32 heads, 8 KV heads, FFN 8192).
Random weights decode at the speed of trained ones of the same shape; with end-of-generation
ignored they measure throughput. A few random matrices per shape are reused across layers: their
values do not change the speed, and the file is written in seconds.
"""

from __future__ import annotations

import sys

import numpy as np
from gguf import GGUFReader, GGUFWriter

ONE_B = (16, 2048, 32, 8, 8192)


def write(tokenizer: str, out: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int) -> None:
    fields = {k: f.contents() for k, f in GGUFReader(tokenizer).fields.items() if k.startswith("tokenizer.")}
    n_vocab = len(fields["tokenizer.ggml.tokens"])
    head = n_embd // n_head
    w = GGUFWriter(out, "llama")
    w.add_name(f"random llama {n_layer}x{n_embd}")
    w.add_block_count(n_layer)
    w.add_context_length(131072)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(1)
    for key, value in fields.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_uint32(key, int(value))
    rng = np.random.default_rng(0)
    pool: dict[tuple[int, int], list[np.ndarray]] = {}

    def matrix(rows: int, cols: int, scale: float) -> np.ndarray:
        made = pool.setdefault((rows, cols), [])
        if len(made) < 3:
            made.append((rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float16))
            return made[-1]
        return made[int(rng.integers(len(made)))]

    w.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, 0.5))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", matrix(n_head * head, n_embd, 0.02))
        w.add_tensor(p + "attn_k.weight", matrix(n_head_kv * head, n_embd, 0.02))
        w.add_tensor(p + "attn_v.weight", matrix(n_head_kv * head, n_embd, 0.02))
        w.add_tensor(p + "attn_output.weight", matrix(n_embd, n_head * head, 0.02))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", matrix(n_ff, n_embd, 0.02))
        w.add_tensor(p + "ffn_up.weight", matrix(n_ff, n_embd, 0.02))
        w.add_tensor(p + "ffn_down.weight", matrix(n_embd, n_ff, 0.02))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    shape = tuple(int(x) for x in sys.argv[3:8]) or ONE_B
    write(sys.argv[1], sys.argv[2], *shape)
    print("wrote", sys.argv[2], "shape", shape, flush=True)
