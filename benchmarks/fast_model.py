"""The fast models: random weights, width 256, 4 layers (F32), with SmolLM2's 49k vocabulary or
Gemma 4's 262k one (the vocabularies of today's models: sampling over a row grows with it).

Their steps are short (about 5 ms for 8 streams on 2 cores with the 49k vocabulary), so per-step
overhead shows as it will on a GPU. Written once into the cache with the ``gguf`` package, from
SmolLM2's tokenizer or from the Gemma 4 vocabulary file of the pinned llama.cpp tree.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_model import cached, tiny_model, write_tiny_model  # noqa: E402
from tools import source_dir  # noqa: E402

import aiollama  # noqa: E402

SHAPE = {"n_embd": 256, "n_layer": 4, "n_head": 4, "n_head_kv": 2, "n_ff": 768}
VOCABULARIES = ("49k", "262k")


def path(vocab: str = "49k") -> Path:
    """The fast model's file with this vocabulary, written on first use."""
    cache = aiollama.cache_dir() / "test-models"
    if vocab == "49k":
        return tiny_model(cache, aiollama.pull(), **SHAPE)
    if vocab != "262k":
        raise ValueError(f"vocab must be one of {VOCABULARIES}, got {vocab!r}")
    gemma = source_dir() / "models" / "ggml-vocab-gemma-4.gguf"
    tag = "-".join(f"{k}{v}" for k, v in sorted(SHAPE.items()))
    return cached(cache / f"fast-gemma4-vocab-v1-{tag}.gguf", lambda p: write_tiny_model(p, gemma, **SHAPE))
