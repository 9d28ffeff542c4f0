"""LoRA adapters: loaded once for a model, set on a context per decode."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiollama.errors import ModelLoadError
from aiollama.native.binding import ffi, lib
from aiollama.native.handle import Handle
from aiollama.native.model import Model, with_model


class LoraAdapter(Handle):
    """A LoRA adapter file for ``model`` (a GGUF of ``general.type`` "adapter"), which it keeps
    alive until closed. Raises ModelLoadError for a file llama.cpp cannot read as an adapter of
    this model (another architecture, shapes that do not fit)."""

    _kind = "lora adapter"

    def __init__(self, model: Model, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        ptr = with_model(model, lambda model_ptr: lib.llama_adapter_lora_init(model_ptr, os.fsencode(self.path)),
                         lambda why: ModelLoadError(f"llama.cpp could not load the LoRA adapter {self.path}: {why}"))
        self._own(ptr)
        self.model = model

    def _free(self, ptr: Any) -> None:
        lib.llama_adapter_lora_free(ptr)
        self.model._release()


def set_adapters(ctx_ptr: Any, adapters: Sequence[tuple[LoraAdapter, float]]) -> None:
    """Make ``adapters`` (with their scales) the ones the context's next decodes apply."""
    handles = ffi.new("struct llama_adapter_lora *[]", [a._get() for a, _ in adapters] or [ffi.NULL])
    scales = ffi.new("float[]", [float(s) for _, s in adapters] or [0.0])
    if lib.llama_set_adapters_lora(ctx_ptr, handles, len(adapters), scales) != 0:
        raise ModelLoadError("llama.cpp refused the LoRA adapters for this context")
