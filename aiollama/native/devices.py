"""The devices llama.cpp computes on, and fitting a model to their memory.

:func:`fit` is llama.cpp's own fitting (``common/fit.cpp``, what ``llama-server -ngl auto`` runs),
compiled into builds with a GPU backend: it measures the model and a context of the given shape
without allocating them, and offloads as many layers as leave ``margin`` bytes free on each device.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from aiollama.native.binding import ffi, lib

log = logging.getLogger("aiollama")

_KINDS = {lib.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu", lib.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
          lib.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu", lib.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel"}

# what fitting leaves free on each device, as llama-server's --fit-target does by default
FIT_MARGIN = 1024 * 2**20


@dataclass(frozen=True)
class Device:
    """A device of llama.cpp's: ``name`` as llama.cpp calls it (``CPU``, ``CUDA0``), ``description``
    (the product), ``kind`` (cpu, gpu, igpu, accel), and its memory in bytes."""

    name: str
    description: str
    kind: str
    free: int
    total: int


def devices() -> list[Device]:
    """Every device the build's backends found on this machine."""
    out = []
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        lib.ggml_backend_dev_memory(dev, free, total)
        out.append(Device(ffi.string(lib.ggml_backend_dev_name(dev)).decode(),
                          ffi.string(lib.ggml_backend_dev_description(dev)).decode(),
                          _KINDS.get(lib.ggml_backend_dev_type(dev), "other"), int(free[0]), int(total[0])))
    return out


def gpus() -> list[Device]:
    """The devices layers can be offloaded to (none in a CPU build, or on a machine without one)."""
    return [d for d in devices() if d.kind in ("gpu", "igpu")]


@dataclass(eq=False)
class Fitted:
    """Where fitting put the model: ``n_gpu_layers`` (-1: all of them), and the tensor split and
    overrides llama.cpp chose, which :meth:`apply` hands to a model's parameters."""

    n_gpu_layers: int
    _params: Any = field(default=None, repr=False)
    _buffers: tuple[Any, ...] = field(default=(), repr=False)  # kept alive while the model loads

    def apply(self, params: Any) -> None:
        params.n_gpu_layers = self.n_gpu_layers
        if self._params is not None:
            params.tensor_split = self._params.tensor_split
            params.tensor_buft_overrides = self._params.tensor_buft_overrides


def fit(path: str | os.PathLike[str], cparams: Any, margin: int = FIT_MARGIN) -> Fitted:
    """The placement that fits ``path`` with a context of ``cparams`` (a ``llama_context_params``)
    into the free memory of the GPUs: every layer when it fits, fewer otherwise, none without a
    GPU. Never raises for a model that does not fit: it then runs on the CPU."""
    if not gpus():
        return Fitted(0)
    mparams = ffi.new("struct llama_model_params *", lib.llama_model_default_params())
    context = ffi.new("struct llama_context_params *", cparams)
    split = ffi.new("float[]", max(1, lib.llama_max_devices()))
    overrides = ffi.new("struct llama_model_tensor_buft_override[]", max(1, lib.llama_max_tensor_buft_overrides()))
    status = lib.aiollama_fit(os.fsencode(path), mparams, context, split, overrides, margin)
    if status == -1:  # a GPU backend without the fitting compiled in: offload everything
        return Fitted(-1)
    if status != 0:
        log.warning("llama.cpp found no placement of %s that fits the free device memory; it runs on "
                    "the CPU (give n_gpu_layers to choose)", os.fspath(path))
        return Fitted(0)
    return Fitted(int(mparams.n_gpu_layers), mparams, (mparams, split, overrides))


def placement(n_gpu_layers: int, n_layer: int) -> str:
    """Where the weights (and with them the KV cache) of a model of ``n_layer`` layers are, given
    the layers offloaded: ``CPU``, ``CUDA0``, or ``CUDA0 (20 of 31 layers), CPU``."""
    on_gpus = "+".join(d.name for d in gpus())
    total = n_layer + 1  # the output layer counts too
    layers = total if n_gpu_layers < 0 else min(n_gpu_layers, total)
    if not on_gpus or layers == 0:
        return "CPU"
    if layers == total:
        return on_gpus
    return f"{on_gpus} ({layers} of {total} layers), CPU"
