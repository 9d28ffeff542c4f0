"""Where the engine computes: devices, the "auto" placement of layers, the KV cache's types and flash
attention, and what statistics and the CLI say of them."""

from __future__ import annotations

import argparse
import ctypes
import threading
from pathlib import Path

import anyio
import pytest
from tiny_model import tiny_model

import aiollama
from aiollama import Engine, EngineConfig, InvalidRequestError
from aiollama.core.loop import DECODE_STACK_BYTES
from aiollama.native.devices import placement
from aiollama.serve_command import layers, switch

GREEDY = dict(temperature=0.0, ignore_eos=True)
WIDE = dict(n_embd=256, n_ff=768, n_head=4, n_head_kv=2, n_layer=4)  # heads of 64: quantized cells need 32s


@pytest.fixture(scope="module")
def wide_path(smollm2_path: Path) -> Path:
    return tiny_model(aiollama.cache_dir() / "test-models", smollm2_path, **WIDE)


def test_devices_lists_the_cpu() -> None:
    found = aiollama.devices()
    assert any(d.kind == "cpu" for d in found)
    assert all(d.total >= d.free >= 0 for d in found)


def test_auto_is_the_default_and_runs_on_what_there_is(tiny_path: Path) -> None:
    assert EngineConfig().n_gpu_layers == "auto"
    on_gpu = any(d.kind in ("gpu", "igpu") for d in aiollama.devices())

    async def main() -> aiollama.Statistics:
        async with Engine(tiny_path, n_ctx=512, n_seq_max=2) as engine:
            await engine.conversation("Hello").stream(max_tokens=2, **GREEDY)
            return engine.statistics()

    stats = anyio.run(main)
    assert (stats.weights_device == "CPU") is not on_gpu
    assert stats.kv_device == stats.weights_device


def test_placement_names_the_devices() -> None:
    assert placement(0, 30) == "CPU"
    if not any(d.kind in ("gpu", "igpu") for d in aiollama.devices()):
        assert placement(-1, 30) == "CPU"  # nothing to offload to


@pytest.mark.parametrize("options", [
    {"n_gpu_layers": "some"}, {"n_gpu_layers": -2}, {"cache_type_k": "q3"}, {"cache_type_v": "int8"},
    {"cache_type_v": "q8_0", "flash_attn": False}, {"flash_attn": "yes"},
    {"deterministic": True, "n_gpu_layers": 4}, {"deterministic": True, "cache_type_k": "q8_0"},
])
def test_bad_device_options_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        EngineConfig(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize("k,v", [("q8_0", "q8_0"), ("q4_0", "f16"), ("f16", "q8_0")])
def test_a_quantized_kv_cache_decodes_close_to_f16(wide_path: Path, k: str, v: str) -> None:
    async def greedy(**options: object) -> list[int]:
        async with Engine(wide_path, n_ctx=512, n_seq_max=2, flash_attn=True, **options) as engine:
            return list((await engine.conversation("The capital of France is").stream(max_tokens=6, **GREEDY)).tokens)

    f16 = anyio.run(lambda: greedy())
    quantized = anyio.run(lambda: greedy(cache_type_k=k, cache_type_v=v))
    assert len(quantized) == 6
    if "q4_0" not in (k, v):  # 8 bits: the first token, from the prompt's own cells, stays
        assert quantized[0] == f16[0]


def test_a_saved_conversation_names_its_cache_types(wide_path: Path, tmp_path: Path) -> None:
    async def main() -> None:
        async with Engine(wide_path, n_ctx=512, n_seq_max=2, cache_type_k="q8_0", cache_type_v="q8_0",
                          flash_attn=True) as engine:
            conv = engine.conversation("Saved with a q8_0 cache")
            await conv.stream(max_tokens=2, **GREEDY)
            await conv.save(tmp_path / "c.conv")
        async with Engine(wide_path, n_ctx=512, n_seq_max=2) as engine:
            with pytest.raises(aiollama.ModelMismatch):
                await engine.load(tmp_path / "c.conv")

    anyio.run(main)


def test_the_cli_reads_layers_and_switches() -> None:
    assert layers("auto") == "auto" and layers("all") == -1 and layers("12") == 12
    for bad in ("-3", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            layers(bad)
    assert (switch("on"), switch("off"), switch("auto")) == (True, False, None)
    with pytest.raises(argparse.ArgumentTypeError):
        switch("maybe")


def _own_stack_size() -> int:
    """The calling thread's stack size, as pthreads gives it (glibc)."""
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong
    attr = ctypes.create_string_buffer(128)  # pthread_attr_t
    size = ctypes.c_size_t()
    assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
    try:
        assert libc.pthread_attr_getstacksize(attr, ctypes.byref(size)) == 0
    finally:
        libc.pthread_attr_destroy(attr)
    return size.value


def test_the_decode_thread_gets_a_deep_stack_and_others_keep_theirs(tiny_path: Path) -> None:
    seen: list[int] = []
    before = threading.stack_size()

    def on_the_decode_thread(tokens: tuple[int, ...], logits: object) -> None:
        if not seen:
            seen.append(_own_stack_size())

    async def main() -> None:
        async with Engine(tiny_path, n_ctx=512, n_seq_max=2) as engine:
            await engine.conversation("Hi").stream(max_tokens=2, logits_processors=[on_the_decode_thread], **GREEDY)

    anyio.run(main)
    assert seen and seen[0] >= DECODE_STACK_BYTES
    assert threading.stack_size() == before  # threads started later get the usual size
