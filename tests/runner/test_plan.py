"""A plan before loading (``aiollama.plan``, ``aiollama plan``) agrees with what the engine then
holds, as llama.cpp accounts both: the weights, the context's memory and its compute buffers."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from tiny_model import bert_model, lfm2_model, mamba_model
from tiny_mtp import bailing_mtp_model, mtp_model, nemotron_mtp_model, qwen35_mtp_model
from tiny_mtp_families import deepseek4_mtp_model, qwen4exp_mtp_model

import aiollama
from aiollama import Engine, ModelEntry, ModelSet, plan

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def close(planned: int, held: int) -> bool:
    return abs(planned - held) <= 0.1 * held


@pytest.fixture(scope="module")
def models(tiny_path: Path, smollm2_path: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    cache = aiollama.cache_dir() / "test-models"
    return {"chat": (tiny_path, {"n_ctx": 1024, "n_seq_max": 4}),
            "unified": (tiny_path, {"n_ctx": 2048, "n_seq_max": 2, "kv_unified": True, "cache_type_k": "f32",
                                    "cache_type_v": "f32"}),
            "embedding": (bert_model(cache, smollm2_path), {}),
            "recurrent": (mamba_model(cache, smollm2_path), {"n_ctx": 512, "n_seq_max": 2}),
            "hybrid drafts": (lfm2_model(cache, smollm2_path), {"n_ctx": 512, "n_seq_max": 2, "draft_tokens": 4}),
            "mtp": (mtp_model(cache, smollm2_path, agree=False), {"n_ctx": 1024, "n_seq_max": 2, "mtp": True}),
            "hybrid mtp": (qwen35_mtp_model(cache, smollm2_path, agree=False), {"n_ctx": 512, "n_seq_max": 2, "mtp": True}),
            "hybrid moe mtp": (qwen35_mtp_model(cache, smollm2_path, agree=False, arch="qwen35moe"),
                               {"n_ctx": 512, "n_seq_max": 2, "mtp": True}),
            "nemotron mtp": (nemotron_mtp_model(cache, smollm2_path, agree=False),
                             {"n_ctx": 512, "n_seq_max": 2, "mtp": True}),
            "bailing mtp": (bailing_mtp_model(cache, smollm2_path, agree=False),
                            {"n_ctx": 512, "n_seq_max": 2, "mtp": True}),
            "qwen4exp mtp": (qwen4exp_mtp_model(cache, smollm2_path, agree=False),
                             {"n_ctx": 512, "n_seq_max": 2, "mtp": True}),
            "deepseek4 mtp": (deepseek4_mtp_model(cache, smollm2_path, agree=False),
                              {"n_ctx": 512, "n_seq_max": 2, "mtp": True})}


HYBRID_MTP = ("hybrid mtp", "hybrid moe mtp", "nemotron mtp", "bailing mtp", "qwen4exp mtp", "deepseek4 mtp")


@pytest.mark.parametrize("name", ["chat", "unified", "embedding", "recurrent", "hybrid drafts", "mtp", "hybrid mtp",
                                  "hybrid moe mtp", "nemotron mtp", "bailing mtp", "qwen4exp mtp", "deepseek4 mtp"])
async def test_the_plan_agrees_with_what_the_engine_holds(models: dict[str, Any], name: str) -> None:
    path, options = models[name]
    planned = plan(path, **options)
    assert planned.buffers and planned.weights_bytes > 0 and planned.compute_bytes > 0
    async with Engine(path, **options) as engine:
        info = engine.model_info
    for key in ("weights_bytes", "memory_bytes", "compute_bytes"):
        assert close(getattr(planned, key), int(info[key])), (key, getattr(planned, key), info[key])
    if name in ("chat", "unified"):
        assert planned.memory_bytes > 0 and planned.kv_bytes_per_cell * planned.n_ctx >= planned.memory_bytes
        assert planned.kv_bytes_per_stream == planned.kv_bytes_per_cell * planned.n_ctx_seq
    if name == "mtp" or name in HYBRID_MTP:  # the MTP context's cells and compute buffers come on top
        alone = plan(path, **{**options, "mtp": False})
        assert planned.memory_bytes > alone.memory_bytes and planned.compute_bytes > alone.compute_bytes
    if name == "hybrid drafts" or name in HYBRID_MTP:  # the recurrent state keeps snapshots to roll drafts back
        assert planned.memory_bytes > plan(path, **{**options, "mtp": False, "draft_tokens": 0}).memory_bytes
    if name == "unified":  # f32 keys and values take twice f16's
        assert planned.kv_bytes_per_cell == 2 * plan(path, n_ctx=2048, n_seq_max=2).kv_bytes_per_cell


def test_what_a_memory_holds(models: dict[str, Any]) -> None:
    planned = plan(models["chat"][0], n_ctx=1024, n_seq_max=4)
    room = planned.weights_bytes + planned.compute_bytes + planned.kv_bytes_per_cell * 5000
    fits = planned.fits(room)
    assert fits == {"cells": 5000, "streams": 5000 // planned.n_ctx_seq, "context_per_stream": 1250}
    assert planned.fits(planned.weights_bytes)["cells"] == 0


def test_the_command_writes_the_plan(models: dict[str, Any]) -> None:
    path = models["chat"][0]
    done = subprocess.run([sys.executable, "-m", "aiollama", "plan", str(path), "-c", "1024", "-np", "4",
                           "--unified-cache", "--json", "--memory-gib", "1"], capture_output=True, text=True, check=False,
                          cwd=tempfile.gettempdir())  # the installed package, not the source tree
    assert done.returncode == 0, done.stderr
    written = json.loads(done.stdout)
    assert written["total_bytes"] == plan(path, n_ctx=1024, n_seq_max=4, kv_unified=True).total_bytes
    assert written["fits"]["memory_bytes"] == 2**30 and written["fits"]["cells"] > 1024
    text = subprocess.run([sys.executable, "-m", "aiollama", "plan", str(path), "-c", "1024"], capture_output=True,
                          text=True, check=False, cwd=tempfile.gettempdir())
    assert text.returncode == 0 and "KV:" in text.stdout and "CPU" in text.stdout


async def test_a_model_set_counts_a_model_by_its_plan_before_it_loads(models: dict[str, Any]) -> None:
    path, options = models["chat"]
    async with ModelSet([ModelEntry("chat", path, options)], memory_bytes=1 << 40) as models_set:
        await models_set.load("chat")
        [status] = models_set.status()
        assert close(plan(path, **options).total_bytes, status.bytes)
