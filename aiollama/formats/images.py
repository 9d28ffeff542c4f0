"""Images in a token history: each row of an image's embedding stands in the history as a
*placeholder*, a negative id that names the image and the row.

The engine's layers see token lists only. A placeholder is a token no vocabulary has, so the prefix
tree, forks, rewinds and the cache work on images unchanged: two prompts with the same picture hold
the same placeholders (the image's number comes from its content) and share its cells. Only the
executor looks behind a placeholder, for the embedding row it decodes instead of a token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

ROW_BITS = 13
MAX_IMAGE_ROWS = 1 << ROW_BITS  # rows (tokens) one image may take
MAX_IMAGES = 1 << (31 - ROW_BITS)  # image numbers: placeholders stay 32-bit ids


def placeholder(image: int, row: int) -> int:
    """The id that stands for row ``row`` of image number ``image``."""
    return -1 - ((image << ROW_BITS) | row)


def placeholders(image: int, n_rows: int) -> list[int]:
    return [placeholder(image, row) for row in range(n_rows)]


def image_row(token: int) -> tuple[int, int]:
    """(image number, row) of a placeholder."""
    value = -1 - token
    return value >> ROW_BITS, value & (MAX_IMAGE_ROWS - 1)


def has_images(tokens: Sequence[int]) -> bool:
    return bool(tokens) and min(tokens) < 0


def runs(tokens: Sequence[int]) -> Iterator[tuple[int, int, bool]]:
    """``(start, end, is_image)`` for each maximal run of text tokens or of placeholders."""
    start = 0
    for i in range(1, len(tokens) + 1):
        if i == len(tokens) or (tokens[i] < 0) != (tokens[start] < 0):
            yield start, i, tokens[start] < 0
            start = i


def text_only(tokens: Sequence[int]) -> list[int]:
    """The text tokens of a history, without its placeholders."""
    return [t for t in tokens if t >= 0]
