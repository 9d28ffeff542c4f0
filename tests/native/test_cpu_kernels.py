"""The CPU build runs on the CPU it finds: the extra buffer types ggml's CPU backend offers for
weights (repacked layouts; AMX tiles where the build has them) give the logits of plain weights.

At b11434 the AMX kernels crashed on the first decode on AMX CPUs, so the default build leaves
them out (``AIOLLAMA_CPU_AMX`` brings them back). Each case runs in a process of its own, so that
a kernel that crashes fails its case instead of the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_model import quantized_model

import aiollama
from aiollama.native.binding import ffi, lib

HERE = Path(__file__).resolve().parents[1]  # the tests' helpers
WIDE = dict(n_embd=256, n_ff=768, n_head=4, n_head_kv=2, n_layer=4)  # rows that every kernel takes
KINDS = ["q4_0", "q8_0", "q4_k_m"]  # types with repacked (and AMX) kernels


def extra_buffer_types() -> list[str]:
    names = ffi.new("const char *[16]")
    n = lib.aiollama_extra_bufts(names, 16)
    return [ffi.string(names[i]).decode() for i in range(min(n, 16))]


def run(model: Path, out: Path, mode: str) -> list[str]:
    done = subprocess.run([sys.executable, str(HERE / "buft_logits.py"), str(model), str(out), mode],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (f"{model.name} with {mode} weights ended with {done.returncode} "
                                  f"(a negative number is the signal that killed it):\n{done.stderr[-3000:]}")
    buffers: list[str] = json.loads(done.stdout.strip().splitlines()[-1])["buffers"]
    return buffers


@pytest.mark.parametrize("kind", KINDS)
def test_extra_buffer_types_give_the_logits_of_plain_weights(smollm2_path: Path, tmp_path: Path, kind: str) -> None:
    model = quantized_model(aiollama.cache_dir() / "test-models", smollm2_path, kind, **WIDE)
    plain = run(model, tmp_path / "plain.npy", "plain")
    extra = run(model, tmp_path / "repack.npy", "repack")
    assert not set(plain) & set(extra_buffer_types()), plain
    a, b = np.load(tmp_path / "plain.npy"), np.load(tmp_path / "repack.npy")
    assert a.shape == b.shape
    # the same weights: the kernels differ in their order of summation, and in how they round the
    # activations they quantize (an int8 one off now and then, which a random model amplifies)
    scale = float(np.abs(a).max())
    worst = float(np.abs(a - b).max())
    assert worst <= 5e-2 * scale, f"{kind}: extra buffer types {extra} change the logits by {worst} (of {scale})"
    assert (a.argmax(axis=1) == b.argmax(axis=1)).mean() >= 0.9


def test_every_extra_buffer_type_offered_takes_weights(smollm2_path: Path, tmp_path: Path) -> None:
    # so that the cases above exercise each of them
    offered = set(extra_buffer_types())
    took: set[str] = set()
    for kind in KINDS:
        model = quantized_model(aiollama.cache_dir() / "test-models", smollm2_path, kind, **WIDE)
        took |= set(run(model, tmp_path / f"{kind}.npy", "repack"))
    assert offered <= took, f"offered {sorted(offered)}, weights went to {sorted(took)} only"


def test_the_default_build_has_no_amx_kernels() -> None:
    # AIOLLAMA_CPU_AMX is off by default: whatever the CPU, no weight goes to the AMX buffer type
    assert "AMX" not in extra_buffer_types()
