"""Loads the compiled cffi module, initializes the llama.cpp backend once, and bridges its log.

Only the native layer imports this module. llama.cpp's log goes to the ``aiollama.llama_cpp``
logger. The package installs a ``NullHandler``, so nothing is printed unless the application
configures logging. Messages below :func:`set_log_level` are dropped in C, before any GIL is taken.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
from typing import Any

try:
    from aiollama._llama_cffi import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on how the package was installed
    if isinstance(exc, ModuleNotFoundError):
        raise ImportError(
            "aiollama's native extension is missing. Install the package (pip install .) and run it "
            "from outside the source tree: with the repository root on sys.path (python -m pytest), "
            "Python imports the uncompiled sources instead of the installed package."
        ) from exc
    # the extension is there but a library it needs is not (a GPU runtime, say)
    raise ImportError(f"aiollama's native extension could not be loaded: {exc}") from exc

__all__ = ["ffi", "lib", "recent_errors", "set_log_level"]

log = logging.getLogger("aiollama.llama_cpp")

_LEVELS = {
    1: logging.DEBUG,    # GGML_LOG_LEVEL_DEBUG
    2: logging.INFO,     # GGML_LOG_LEVEL_INFO
    3: logging.WARNING,  # GGML_LOG_LEVEL_WARN
    4: logging.ERROR,    # GGML_LOG_LEVEL_ERROR
}
_GGML_LEVEL = {logging.DEBUG: 1, logging.INFO: 2, logging.WARNING: 3, logging.ERROR: 4}

# The last error lines llama.cpp logged, so that a failure that only returns NULL
# (a model that fails to load, a context that cannot be created) can say why.
_errors: collections.deque[str] = collections.deque(maxlen=8)
_errors_lock = threading.Lock()


@ffi.def_extern()  # type: ignore[untyped-decorator]
def aiollama_log_py(level: int, text: Any) -> None:
    message = ffi.string(text).decode("utf-8", "replace").rstrip("\n")
    if not message:
        return
    py_level = _LEVELS.get(level, logging.DEBUG)
    if py_level >= logging.ERROR:
        with _errors_lock:
            _errors.append(message)
    log.log(py_level, "%s", message)


def recent_errors() -> list[str]:
    """Return the error lines llama.cpp logged most recently, oldest first."""
    with _errors_lock:
        return list(_errors)


def clear_recent_errors() -> None:
    with _errors_lock:
        _errors.clear()


def set_log_level(level: int) -> None:
    """Forward llama.cpp messages at ``level`` (a ``logging`` level) and above; default WARNING."""
    ggml_level = 4
    for py_level, value in sorted(_GGML_LEVEL.items()):
        if level <= py_level:
            ggml_level = value
            break
    lib.aiollama_log_install(ggml_level)


def verify_declarations(ffi: Any, lib: Any) -> None:
    """Touch every declared type and function, so that cffi compares each with what the C compiler
    saw in llama.h. Raises ``ffi.error`` on drift, for example a struct of another size."""
    typedefs, structs, unions = ffi.list_types()
    names = list(typedefs) + [f"struct {n}" for n in structs] + [f"union {n}" for n in unions]
    for name in names:
        if name.split()[-1] in _OPAQUE:
            continue
        ffi.sizeof(name)
    for name in dir(lib):
        getattr(lib, name)


_OPAQUE = {"llama_vocab", "llama_model", "llama_context", "llama_sampler", "llama_adapter_lora", "llama_memory_i",
           "ggml_backend_device",
           "ggml_backend_reg", "ggml_backend_buffer_type",
           "mtmd_context", "mtmd_bitmap", "mtmd_input_chunk", "mtmd_input_chunks", "mtmd_helper_video",
           "aiollama_chat", "aiollama_chat_parser", "llama_batch_ext"}


def _shutdown() -> None:
    # Callbacks into Python during interpreter teardown crash; put llama.cpp back on stderr first.
    lib.llama_log_set(ffi.NULL, ffi.NULL)


def _load_backends() -> None:
    """Set up ggml's backends on the importing thread, before any other call: a portable build
    (``AIOLLAMA_PORTABLE``) has them as libraries beside this package, one per CPU variant (and
    GPU), and ggml loads the best for this machine; other builds link them in, and asking for their
    count registers them (a GPU backend initializes its runtime then), so that a decode thread
    later finds them ready."""
    if lib.ggml_backend_reg_count() == 0:
        lib.ggml_backend_load_all_from_path(os.fsencode(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


verify_declarations(ffi, lib)
lib.aiollama_log_install(3)
_load_backends()
lib.llama_backend_init()
atexit.register(_shutdown)
