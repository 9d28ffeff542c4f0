"""What a row of a decode costs, and so whether a draft token pays.

A decode step's time is fitted as ``fixed + per_row * rows`` by least squares over recent steps
that only decode (no prompt tokens), older steps weighing less. A draft token adds a row and is
taken with some probability p; it pays where p exceeds the share of a step's time its rows take,
``per_row * n / (fixed + per_row * n)`` for n rows: next to nothing where a step's time is fixed
(a GPU, reading the weights once for every row), nearly all of it where each row costs its own
compute (a CPU running a small model at several streams), where a rejected draft row only slows
the step. Until the steps differ enough in rows to tell the two apart, the share is not known
(:mod:`aiollama.sched.drafting` then adds a few draft rows every other step even to a full step,
so that they do).
"""

from __future__ import annotations

from collections.abc import Callable

DECAY = 0.98  # the weight of a step falls by this much with each later one
MIN_STEPS = 8
MIN_SPREAD = 0.5  # the weighted standard deviation of rows below which the fit cannot tell


class RowCost:
    """The online fit. ``add`` each decode-only step; ``shares`` for the rows of the next."""

    def __init__(self) -> None:
        self.steps = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, rows: int, seconds: float) -> None:
        d = DECAY
        self._w = self._w * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """``(fixed, per_row)`` seconds, neither below 0; None while the steps cannot tell (also
        once steps of one size have outweighed those that differed: the load may have changed
        since, and a few draft rows find out)."""
        if self.steps < MIN_STEPS:
            return None
        w, x = self._w, self._x
        var = self._xx * w - x * x
        if var < (MIN_SPREAD * w) ** 2:
            return None
        per_row = max(0.0, (w * self._xy - x * self._y) / var)
        return max(0.0, (self._y - per_row * x) / w), per_row

    def shares(self) -> Callable[[int], float] | None:
        """The share of a step of ``rows`` rows that its rows take (0 to 1), as a function of
        ``rows`` from the fit as it is now; None while the steps cannot tell."""
        got = self.fit()
        if got is None:
            return None
        fixed, per_row = got

        def share(rows: int) -> float:
            total = fixed + per_row * rows
            return per_row * rows / total if total > 0 and rows > 0 else 0.0
        return share
