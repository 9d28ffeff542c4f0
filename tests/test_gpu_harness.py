"""The GPU benchmark's CPU mode: benchmarks/gpu/bench.py runs end to end on a tiny model (aiollama's
contenders and the steady-state rounds; llama.cpp's tools need a build of their own), so that the
script a GPU run depends on cannot rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_benchmark_runs_in_cpu_mode(tiny_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "bench.py"), str(tiny_path), "--cpu",
                           "--levels", "1,3", "--tokens", "4", "--rounds", "2", "--threads", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    r = json.loads(out.read_text())
    for variant in ("aiollama", "split", "split+backend"):
        got = r["aiollama"][variant]
        assert set(got["levels"]) == {"1", "3"}
        assert all(level["tps"] > 0 and level["step_ms"] >= level["decode_ms"] > 0 for level in got["levels"].values())
        assert len(got["rounds"]) == 2 and got["device"] == "CPU"
    assert "| 3 |" in done.stdout and "Steady state" in done.stdout


def test_the_model_writer_makes_a_loadable_model(tiny_path: Path, tmp_path: Path) -> None:
    from aiollama.native import Model

    out = tmp_path / "random.gguf"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "model.py"), str(tiny_path), str(out),
                    "2", "128", "4", "2", "256"], check=True, capture_output=True, timeout=120, cwd=tmp_path)
    with Model(out) as model:
        assert (model.n_layer, model.n_embd) == (2, 128)


def test_the_sampling_probe_runs(tiny_path: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "sampling.py"), str(tiny_path),
                           "--streams", "2", "--steps", "3", "--n-gpu-layers", "0", "--threads", "2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 4 and all("ms/step" in line for line in lines)
