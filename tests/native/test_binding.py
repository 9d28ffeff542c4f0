"""The cdef in build_ffi.py is checked by the C compiler against llama.h, and the check bites."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

import aiollama
from aiollama.native.binding import ffi, lib, verify_declarations

ROOT = Path(__file__).resolve().parents[2]


def _build_ffi() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_ffi", ROOT / "build_ffi.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _llama_cpp_dir() -> Path:
    root = Path(os.environ.get("LLAMA_CPP_DIR") or ROOT / "llama.cpp")
    if not (root / "include" / "llama.h").is_file():
        pytest.skip(f"no llama.cpp source tree at {root}")
    return root


def _compile(cdef: str, tmp_path: Path) -> None:
    """Compile ``cdef`` against llama.h, load it, and let cffi check every declaration."""
    src = _llama_cpp_dir()
    libdir = str(Path(aiollama.__file__).parent)  # the installed package holds libllama.so
    builder = _build_ffi().make_builder(
        cdef,
        include_dirs=[str(src / "include"), str(src / "ggml" / "include"), str(src / "tools" / "mtmd"),
                      str(ROOT / "cmake")],
        library_dirs=[libdir],
        libraries=[":libllama.so", ":libmtmd.so", ":libaiollama_chat.so"],
        extra_link_args=[f"-Wl,-rpath,{libdir}"],
    )
    so = builder.compile(tmpdir=str(tmp_path), verbose=False)
    spec = importlib.util.spec_from_file_location("aiollama._llama_cffi", so)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    verify_declarations(module.ffi, module.lib)


def test_cdef_matches_header(tmp_path: Path) -> None:
    _compile(_build_ffi().CDEF, tmp_path)


def test_installed_module_matches_its_header() -> None:
    verify_declarations(ffi, lib)


@pytest.mark.parametrize(
    ("original", "drifted"),
    [
        # a parameter type changed
        ("int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);",
         "int32_t llama_decode(struct llama_context * ctx, struct llama_batch * batch);"),
        # a return type changed
        ("llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);",
         "float * llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);"),
        # a struct field changed type
        ("    llama_seq_id ** seq_id;\n", "    float ** seq_id;\n"),
        # a struct lost a field: its size no longer matches
        ("    bool sorted;\n", ""),
        # an enum constant that the header does not have
        ("LLAMA_LOAD_MODE_MMAP,", "LLAMA_LOAD_MODE_MMAP, LLAMA_LOAD_MODE_TELEPATHY,"),
        # a function that the header does not have
        ("void llama_backend_free(void);", "void llama_backend_free(void);\nvoid llama_no_such_function(void);"),
    ],
)
def test_drift_fails_to_compile(tmp_path: Path, original: str, drifted: str) -> None:
    cdef = _build_ffi().CDEF
    assert original in cdef
    with pytest.raises(Exception):  # noqa: B017 - compile errors and layout errors differ in type
        _compile(cdef.replace(original, drifted, 1), tmp_path)
