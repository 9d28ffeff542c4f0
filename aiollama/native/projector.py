"""Projector: libmtmd's image encoder beside a text model (an ``mmproj`` GGUF file).

It reads a picture (PNG, JPEG, BMP, GIF...: what stb_image reads) and gives what the text model
takes in its place: the text tokens the model's format puts around an image, and the image's
embedding rows, one per position, each as wide as the text model's embeddings.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aiollama._validate import integer
from aiollama.errors import ImageError, ModelLoadError, UnsupportedModel
from aiollama.native.binding import clear_recent_errors, ffi, lib, recent_errors
from aiollama.native.handle import Handle
from aiollama.native.model import Model, with_model
from aiollama.native.threads import math_cpus

MARKER = b"<__media__>"


@dataclass(frozen=True)
class Encoded:
    """A picture as the text model takes it: text tokens and image rows, in order. Each part is a
    list of token ids or a float32 array of ``(rows, n_embd)``."""

    parts: tuple[list[int] | np.ndarray, ...]
    width: int  # the picture as read, in pixels
    height: int


class Projector(Handle):
    """libmtmd's context for ``path``, an image projector made for ``model``, which it keeps alive
    until closed. ``encode`` may be called from any thread (one at a time runs). ``n_threads`` None
    takes a thread per physical core this process may use.

    Raises InvalidRequestError for ``n_threads`` below 1, ModelLoadError for a file libmtmd cannot
    load for this model, UnsupportedModel for one that needs what the engine does not do (audio
    only, or M-RoPE positions).
    """

    _kind = "projector"

    def __init__(self, model: Model, path: str | os.PathLike[str], *, n_threads: int | None = None,
                 use_gpu: bool = False) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()  # one encode at a time, and none while it is freed
        if not self.path.is_file():
            raise ModelLoadError(f"no projector file at {self.path}")
        params = lib.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.warmup = False
        # libmtmd's own default is 4 threads whatever the machine
        params.n_threads = math_cpus() if n_threads is None else integer("n_threads", n_threads, low=1)
        self._marker = ffi.new("char[]", MARKER)
        params.media_marker = self._marker
        ptr = with_model(model, lambda model_ptr: lib.mtmd_init_from_file(os.fsencode(self.path), model_ptr, params),
                         lambda why: ModelLoadError(f"libmtmd could not load the projector {self.path}: {why}"))
        self._own(ptr)
        self.model = model
        self.n_embd = model.n_embd
        # a picture decoded without causal attention: all its rows in one ubatch
        self.non_causal = bool(lib.mtmd_decode_use_non_causal(ptr, ffi.NULL))
        self.max_rows: int | None = None  # the most rows a picture may take (the executor's ubatch, where it must fit one)
        why = ("it takes no images" if not lib.mtmd_support_vision(ptr)
               else "its images take M-RoPE positions" if lib.mtmd_decode_use_mrope(ptr) else "")
        if why:
            self.close()
            raise UnsupportedModel(f"the projector {self.path.name} is not supported yet: {why}")

    def _free(self, ptr: Any) -> None:
        with self._lock:  # an encode on another thread ends first
            lib.mtmd_free(ptr)
        self.model._release()

    def encode(self, data: bytes) -> Encoded:
        """The parts that stand for the picture in ``data`` (a file's bytes). Raises ImageError for
        bytes that are no picture libmtmd can read."""
        if not isinstance(data, (bytes, bytearray, memoryview)) or not len(data):
            raise ImageError("an image must be a non-empty bytes object (a PNG, JPEG, BMP or GIF file)")
        with self._lock:
            ptr = self._get()
            clear_recent_errors()
            wrapper = lib.mtmd_helper_bitmap_init_from_buf(ptr, bytes(data), len(data), False,
                                                           lib.mtmd_helper_init_opt_default())
            bitmap = wrapper.bitmap
            if bitmap == ffi.NULL:
                raise ImageError("the image could not be read: " + ("; ".join(recent_errors()) or "unknown format"))
            chunks = lib.mtmd_input_chunks_init()
            try:
                if lib.mtmd_bitmap_is_audio(bitmap):
                    raise ImageError("that file is audio, not a picture")
                size = lib.mtmd_bitmap_get_nx(bitmap), lib.mtmd_bitmap_get_ny(bitmap)
                text = ffi.new("mtmd_input_text *", {"text": self._marker, "text_len": len(MARKER),
                                                     "add_special": False, "parse_special": True})
                bitmaps = ffi.new("mtmd_bitmap *[1]", [bitmap])
                if lib.mtmd_tokenize(ptr, chunks, text, bitmaps, 1) != 0:
                    raise ImageError("libmtmd could not prepare the image: " + "; ".join(recent_errors()))
                parts = tuple(self._part(ptr, lib.mtmd_input_chunks_get(chunks, i))
                              for i in range(lib.mtmd_input_chunks_size(chunks)))
            finally:
                lib.mtmd_input_chunks_free(chunks)
                lib.mtmd_bitmap_free(bitmap)
        return Encoded(tuple(p for p in parts if len(p)), *size)

    def _part(self, ptr: Any, chunk: Any) -> list[int] | np.ndarray:
        if lib.mtmd_input_chunk_get_type(chunk) == lib.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ffi.new("size_t *")
            tokens = lib.mtmd_input_chunk_get_tokens_text(chunk, n)
            return [tokens[i] for i in range(n[0])]
        if lib.mtmd_input_chunk_get_type(chunk) != lib.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            raise ImageError("libmtmd gave a part that is neither text nor image")
        if lib.mtmd_encode_chunk(ptr, chunk) != 0:
            raise ImageError("libmtmd could not encode the image: " + "; ".join(recent_errors()))
        rows = lib.mtmd_input_chunk_get_n_tokens(chunk)
        out = lib.mtmd_get_output_embd(ptr)
        return np.frombuffer(ffi.buffer(out, rows * self.n_embd * 4), dtype=np.float32).reshape(rows, self.n_embd).copy()
