"""aiollama: many concurrent llama.cpp conversations from async Python.

This release carries the foundation: the pinned llama.cpp, its cffi binding, and the native layer
(:mod:`aiollama.native`) of typed owners for models, contexts, batches and sampler chains.
"""

import logging

from aiollama.errors import (
    AiollamaError,
    ClosedError,
    DecodeError,
    GrammarError,
    InvalidBatchError,
    InvalidOutputError,
    InvalidRequestError,
    InvalidSeqIdError,
    InvalidTokenError,
    ModelLoadError,
)
from aiollama.models import cache_dir, default_model, pull

logging.getLogger("aiollama").addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "AiollamaError",
    "ClosedError",
    "DecodeError",
    "GrammarError",
    "InvalidBatchError",
    "InvalidOutputError",
    "InvalidRequestError",
    "InvalidSeqIdError",
    "InvalidTokenError",
    "ModelLoadError",
    "cache_dir",
    "default_model",
    "pull",
]
