"""The fast model: random weights, width 256, 4 layers, SmolLM2's 49k vocabulary (F32).

Its steps are short (about 5 ms for 8 streams on 2 cores), so per-step overhead shows as it will
on a GPU. Written once into the cache with the ``gguf`` package, from SmolLM2's tokenizer.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_model import tiny_model  # noqa: E402

import aiollama  # noqa: E402

SHAPE = {"n_embd": 256, "n_layer": 4, "n_head": 4, "n_head_kv": 2, "n_ff": 768}


def path() -> Path:
    """The fast model's file, written on first use."""
    return tiny_model(aiollama.cache_dir() / "test-models", aiollama.pull(), **SHAPE)
