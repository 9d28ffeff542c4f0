"""The native layer: small typed owners of llama.cpp's C handles.

Each owner frees its handle in ``close()`` (idempotent, also via ``with``). A child keeps its parent
alive: a context or a grammar sampler keeps its model's memory until it is closed itself. Misuse that
would abort the process inside llama.cpp raises an :mod:`aiollama.errors` exception instead.
Nothing here is thread-safe: one context belongs to one thread at a time.
"""

from aiollama.native.batch import Batch
from aiollama.native.context import Context, DecodeStatus
from aiollama.native.handle import open_handles
from aiollama.native.lora import LoraAdapter
from aiollama.native.model import Model, Vocab
from aiollama.native.projector import Projector
from aiollama.native.sampler_chain import SamplerChain, sample_rows
from aiollama.native.threads import available_cpus, math_cpus

__all__ = ["Batch", "Context", "DecodeStatus", "LoraAdapter", "Model", "Projector", "SamplerChain", "Vocab",
           "available_cpus", "math_cpus", "open_handles", "sample_rows"]
