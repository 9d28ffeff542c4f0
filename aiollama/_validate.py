"""The checks every layer applies to numbers it is given, in one place.

Each returns the value (an ``int`` or a ``float``) or raises ``InvalidRequestError`` naming it.
"""

from __future__ import annotations

import math

from aiollama.errors import InvalidRequestError

MAX_SEQ = 256  # LLAMA_MAX_SEQ at the pinned tag: the most sequences a context can hold
SEED_MAX = 2**32 - 2  # LLAMA_DEFAULT_SEED (2**32 - 1) means "pick a random seed"


def integer(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]`` (either bound may be open)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an int, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            bound = f">= {low}"
        elif low is None:
            bound = f"<= {high}"
        else:
            bound = f"in [{low}, {high}]"
        raise InvalidRequestError(f"{name} must be an int {bound}, got {value!r}")
    return value


def number(name: str, value: object, *, low: float | None = None, high: float | None = None,
           low_open: bool = False) -> float:
    """``value`` as a finite float in ``[low, high]``; ``low_open`` excludes ``low`` itself."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise InvalidRequestError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise InvalidRequestError(f"{name} must be <= {high}, got {value!r}")
    return float(value)
