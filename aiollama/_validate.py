"""The checks every layer applies to numbers it is given, in one place.

Each returns the value (an ``int`` or a ``float``) or raises ``InvalidRequestError`` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from aiollama.errors import InvalidRequestError

MAX_SEQ = 256  # LLAMA_MAX_SEQ at the pinned tag: the most sequences a context can hold
SEED_MAX = 2**32 - 2  # LLAMA_DEFAULT_SEED (2**32 - 1) means "pick a random seed"


def _param(name: str) -> str | None:
    """The parameter a check names, where its name is one (``max_tokens``, not ``lora scale of 'a'``)."""
    head = name.split()[0]
    return head if head.isidentifier() else None


def integer(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]`` (either bound may be open)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an int, got {value!r}", param=_param(name))
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            bound = f">= {low}"
        elif low is None:
            bound = f"<= {high}"
        else:
            bound = f"in [{low}, {high}]"
        raise InvalidRequestError(f"{name} must be an int {bound}, got {value!r}", param=_param(name))
    return value


def number(name: str, value: object, *, low: float | None = None, high: float | None = None,
           low_open: bool = False) -> float:
    """``value`` as a finite float in ``[low, high]``; ``low_open`` excludes ``low`` itself."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=_param(name))
    if low is not None and (value < low or (low_open and value == low)):
        raise InvalidRequestError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}", param=_param(name))
    if high is not None and value > high:
        raise InvalidRequestError(f"{name} must be <= {high}, got {value!r}", param=_param(name))
    return float(value)


def lora_set(lora: Any, loaded: Mapping[str, Any]) -> tuple[tuple[str, float], ...]:
    """A conversation's adapters, ``{name: scale}``, as the scheduler keys them (sorted, scale 0
    left out); InvalidRequestError for a name the engine did not load or a scale that is no number."""
    if not lora:
        return ()
    if not isinstance(lora, Mapping):
        raise InvalidRequestError(f"lora must map adapter names to scales, got {lora!r}")
    out = []
    for name, scale in lora.items():
        if name not in loaded:
            known = ", ".join(sorted(loaded)) or "none"
            raise InvalidRequestError(f"no LoRA adapter {name!r} was loaded with this engine (loaded: {known})")
        number(f"lora scale of {name!r}", scale, low=-100.0, high=100.0)
        if scale:
            out.append((str(name), float(scale)))
    return tuple(sorted(out))
