"""A tiny random-weight image projector (an mmproj GGUF) for the tiny text models.

The layout is the one ``clip.cpp`` loads for LLaVA's "mlp" projector: a ViT (patch embedding,
position embeddings, pre-norm blocks of attention and a GELU feed-forward) whose patch rows go
through a two-layer MLP into the text model's width. A 32x32 input in 8x8 patches gives 16 image
tokens. The weights are random, so what it "sees" is noise, but it is deterministic: the same
picture always gives the same embedding rows.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from tiny_model import cached, finish

IMAGE_SIZE = 32
PATCH_SIZE = 8
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2


def projector(cache: Path, n_embd_text: int = 64, kind: str = "mlp") -> Path:
    """The tiny projector for a text model of width ``n_embd_text``, written on first use. ``kind``
    "gemma3": Gemma 3's layout instead, whose pictures are decoded with attention over all their
    rows, between text markers: a 64x64 input in 8x8 patches, pooled 2x2 into 16 rows."""
    return cached(cache / f"tiny-mmproj-{kind}-{n_embd_text}.gguf", lambda p: write_projector(p, n_embd_text, kind))


def write_projector(path: Path, n_embd_text: int, kind: str = "mlp", *, n_embd: int = 32, n_ff: int = 64,
                    n_head: int = 2, n_layer: int = 2, seed: int = 7, image_size: int = IMAGE_SIZE,
                    patch_size: int = PATCH_SIZE) -> None:
    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tmp = path.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    gemma3 = kind == "gemma3"
    image_size = 2 * image_size if gemma3 else image_size
    writer.add_string("clip.projector_type", kind)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", patch_size)
    writer.add_uint32("clip.vision.embedding_length", n_embd)
    writer.add_uint32("clip.vision.feed_forward_length", n_ff)
    writer.add_uint32("clip.vision.projection_dim", n_embd_text)
    writer.add_uint32("clip.vision.block_count", n_layer)
    writer.add_uint32("clip.vision.attention.head_count", n_head)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    n_patches = (image_size // patch_size) ** 2
    if gemma3:
        writer.add_uint32("clip.vision.projector.scale_factor", 2)
    writer.add_tensor("v.patch_embd.weight", weight(n_embd, 3, patch_size, patch_size).astype(np.float16))
    writer.add_tensor("v.patch_embd.bias", weight(n_embd))
    writer.add_tensor("v.position_embd.weight", weight(n_patches, n_embd))
    writer.add_tensor("v.pre_ln.weight", np.ones(n_embd, np.float32))
    writer.add_tensor("v.pre_ln.bias", np.zeros(n_embd, np.float32))
    for il in range(n_layer):
        p = f"v.blk.{il}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(p + name + ".weight", weight(n_embd, n_embd))
            writer.add_tensor(p + name + ".bias", weight(n_embd))
        for name in ("ln1", "ln2"):
            writer.add_tensor(p + name + ".weight", np.ones(n_embd, np.float32))
            writer.add_tensor(p + name + ".bias", np.zeros(n_embd, np.float32))
        writer.add_tensor(p + "ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(p + "ffn_up.bias", weight(n_ff))
        writer.add_tensor(p + "ffn_down.weight", weight(n_embd, n_ff))
        writer.add_tensor(p + "ffn_down.bias", weight(n_embd))
    if gemma3:
        writer.add_tensor("v.post_ln.weight", np.ones(n_embd, np.float32))
        writer.add_tensor("v.post_ln.bias", np.zeros(n_embd, np.float32))
        writer.add_tensor("mm.soft_emb_norm.weight", np.ones(n_embd, np.float32))
        writer.add_tensor("mm.input_projection.weight", weight(n_embd, n_embd_text))
    else:
        writer.add_tensor("mm.0.weight", weight(n_embd_text, n_embd))
        writer.add_tensor("mm.0.bias", weight(n_embd_text))
        writer.add_tensor("mm.2.weight", weight(n_embd_text, n_embd_text))
        writer.add_tensor("mm.2.bias", weight(n_embd_text))
    finish(writer, tmp, path)


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A random RGB picture as PNG bytes (written by hand: no imaging package needed)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
