"""The embedding rows of the pictures in the conversations' histories, by image number (see
:mod:`aiollama.formats.images`).

A conversation holds the images its prompts brought, and a fork its parent's, until it is closed:
whatever evaluates its history again (a preemption that dropped its cells, a rewind, a failed step)
finds the rows here. An image goes when no conversation holds it. Cache entries hold none: their
cells keep what the rows gave, and a prompt that shares them brings its own rows for what it has to
evaluate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aiollama.formats.images import image_row


class ImageStore:
    def __init__(self) -> None:
        self.rows: dict[int, Any] = {}  # image number -> its rows (a float32 array)
        self._held: dict[int, set[int]] = {}  # conversation -> the image numbers it holds
        self._holders: dict[int, int] = {}  # image number -> how many conversations hold it

    def add(self, conv: int, images: Mapping[int, Any]) -> None:
        held = self._held.setdefault(conv, set())
        for number, rows in images.items():
            if number not in held:
                held.add(number)
                self._holders[number] = self._holders.get(number, 0) + 1
                self.rows.setdefault(number, rows)

    def fork(self, parent: int, child: int) -> None:
        self.add(child, {n: self.rows[n] for n in self._held.get(parent, ())})

    def drop(self, conv: int) -> None:
        for number in self._held.pop(conv, ()):
            self._holders[number] -= 1
            if not self._holders[number]:
                del self._holders[number], self.rows[number]

    def held(self, conv: int) -> frozenset[int]:
        return frozenset(self._held.get(conv, ()))


def whole(tokens: Sequence[int], start: int, end: int) -> int:
    """Where a slice ``tokens[start:end]`` may end so that it cuts no picture before its last row
    (pictures decoded with attention over all their rows need them in one decode): ``end``, or an
    earlier position, ``start`` when the slice begins in the picture it would cut."""
    if end <= start or end >= len(tokens) or tokens[end - 1] >= 0 or tokens[end] >= 0:
        return end
    (image, row), following = image_row(tokens[end - 1]), image_row(tokens[end])
    if following != (image, row + 1):
        return end
    return max(start, end - 1 - row)


def whole_take(tokens: Sequence[int], pos: int, take: int, room: int) -> int:
    """The tokens a prompt slice from ``pos`` takes, ``take`` asked, so that it cuts no picture: it
    stops before a picture it cannot finish, or, where one starts at ``pos``, takes it whole if the
    step has ``room`` for it (else nothing this step)."""
    end = whole(tokens, pos, pos + take)
    if end > pos:
        return end - pos
    image, row = image_row(tokens[pos])
    stop = pos + 1
    while stop < len(tokens) and tokens[stop] < 0 and image_row(tokens[stop]) == (image, row + stop - pos):
        stop += 1
    return stop - pos if stop - pos <= room else 0
