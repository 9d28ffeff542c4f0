"""Pictures in prompts: :class:`Image`, and the engine's side of them (:class:`ImageEncoder`).

An engine given a projector (``EngineConfig(mmproj=...)``) reads a picture with libmtmd and encodes
it into embedding rows, one per position it takes in the history. The history holds placeholders
for those rows (:mod:`aiollama.formats.images`), numbered by the picture's content, so that two
prompts with the same picture share its cells. Encodings are kept (the latest few), so a picture
sent again is not encoded again; ``await engine.encode_images(...)`` encodes on a worker thread
ahead of a prompt, so that an event loop never waits for the encoder.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aiollama.errors import ChatTemplateError, ImageError
from aiollama.formats.images import (
    MAX_IMAGE_ROWS,
    MAX_IMAGES,
    image_row,
    placeholder,
    placeholders,
)
from aiollama.formats.messages import IMAGE, Messages

KEPT_ENCODINGS = 32  # pictures whose encodings are kept for the next prompt that sends them


class Image:
    """A picture for a prompt: the bytes of a PNG, JPEG, BMP or GIF file, or the path of one.

    Raises ImageError for a path that cannot be read or empty bytes; whether the bytes are a
    picture is known when an engine reads them.
    """

    __slots__ = ("data", "digest")

    def __init__(self, source: bytes | bytearray | memoryview | str | os.PathLike[str]) -> None:
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
        elif isinstance(source, (str, os.PathLike)):
            try:
                data = Path(source).read_bytes()
            except OSError as exc:
                raise ImageError(f"cannot read the image {source}: {exc.strerror or exc}") from exc
        else:
            raise ImageError(f"an image is a file's bytes or its path, got {type(source).__name__}")
        if not data:
            raise ImageError("an image must not be empty")
        self.data = data
        self.digest = hashlib.sha256(data).digest()

    @classmethod
    def from_url(cls, url: object) -> Image:
        """The picture of a ``data:`` URL (``data:image/png;base64,...``). Raises ImageError for any
        other URL: fetching one is the caller's choice (``serve --fetch-images``)."""
        if not isinstance(url, str) or not url.startswith("data:"):
            raise ImageError("only data: URLs are read here (data:image/png;base64,...)")
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageError("a data: URL image must be base64 (data:image/png;base64,...)")
        try:
            return cls(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"the data: URL holds no valid base64: {exc}") from exc

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Image) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"Image({len(self.data)} bytes, sha256 {self.digest.hex()[:12]}...)"


class ImageEncoder:
    """One engine's pictures: their numbers by content, and their latest encodings. Thread-safe."""

    def __init__(self, projector: Any) -> None:
        self.projector = projector  # aiollama.native.Projector, or None: the engine takes no images
        self._numbers: dict[bytes, int] = {}
        self._digests: dict[int, bytes] = {}
        self._kept: OrderedDict[bytes, tuple[list[int], dict[int, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def tokens(self, image: Image) -> tuple[list[int], dict[int, Any]]:
        """The history tokens of ``image`` (the format's text tokens around it and one placeholder
        per row) and its rows by image number. Encodes it unless it was encoded lately."""
        if not isinstance(image, Image):
            raise ImageError(f"expected an aiollama.Image, got {type(image).__name__}")
        if self.projector is None:
            raise ImageError("this engine takes no images: give it the model's projector (mmproj)")
        with self._lock:
            kept = self._kept.get(image.digest)
            if kept is not None:
                self._kept.move_to_end(image.digest)
                return kept
        encoded = self.projector.encode(image.data)  # outside the lock: the projector has its own
        tokens: list[int] = []
        rows: dict[int, Any] = {}
        with self._lock:
            number = self._number(image.digest)
            for part in encoded.parts:
                if isinstance(part, list):
                    tokens += part
                    continue
                limit = min(MAX_IMAGE_ROWS, self.projector.max_rows or MAX_IMAGE_ROWS)
                if len(part) > limit or number in rows:
                    raise ImageError(f"the image takes {len(part)} rows, more than the {limit} one picture may take")
                rows[number] = part
                tokens += placeholders(number, len(part))
            self._kept[image.digest] = (tokens, rows)
            while len(self._kept) > KEPT_ENCODINGS:
                self._kept.popitem(last=False)
        return tokens, rows

    def _number(self, digest: bytes) -> int:
        """The picture's number in this engine. The table grows by one entry per distinct picture;
        numbers wrap after MAX_IMAGES, so a picture could take the number of one seen 262,144
        pictures earlier, and match cells of it the cache still held."""
        number = self._numbers.get(digest)
        if number is None:
            number = self._numbers[digest] = len(self._numbers) % MAX_IMAGES
            self._digests[number] = digest
        return number

    def saved(self, images: Mapping[int, Any]) -> tuple[tuple[int, bytes, Any], ...]:
        """The pictures of a conversation being saved: (number, sha256 of the picture, rows)."""
        with self._lock:
            return tuple((n, self._digests[n], rows) for n, rows in sorted(images.items()))

    def loaded(self, tokens: Sequence[int], images: Sequence[tuple[int, bytes, Any]]) -> tuple[list[int], dict[int, Any]]:
        """A saved history's tokens and pictures, renumbered as this engine numbers those pictures."""
        if images and self.projector is None:
            raise ImageError("the saved conversation holds pictures, and this engine takes none: give it the "
                             "model's projector (mmproj)")
        with self._lock:
            numbers = {n: self._number(digest) for n, digest, _ in images}
        rows = {numbers[n]: r for n, _, r in images}
        out = []
        for t in tokens:
            if t < 0:
                number, row = image_row(t)
                t = placeholder(numbers[number], row)
            out.append(t)
        return out, rows


def pictures(messages: Messages) -> tuple[Messages, list[Image]]:
    """Chat messages whose contents may be lists of parts, with each picture made a marker part
    (``{"type": "media_marker", "text": IMAGE}``, as llama.cpp's chat layer takes them) and each
    text part ``{"type": "text", "text": ...}``; and the pictures in order.

    A part is text (a str, or ``{"type": "text", "text": ...}``), an :class:`Image`,
    ``{"type": "image", "image": Image}``, or OpenAI's ``{"type": "image_url", "image_url": {"url":
    "data:..."}}``."""
    if isinstance(messages, (str, bytes, bytearray)) or not isinstance(messages, (Mapping, Sequence)):
        return messages, []
    found: list[Image] = []
    out: list[Any] = []
    message: Any
    for message in [messages] if isinstance(messages, Mapping) else messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str) and IMAGE in content:
            raise ChatTemplateError("message content holds U+E003, which aiollama reserves")
        if isinstance(content, (list, tuple)):
            message = {**message, "content": [_part(p, found) for p in content]}
        out.append(message)
    return out, found


def _part(part: Any, found: list[Image]) -> dict[str, str]:
    if isinstance(part, Mapping):
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            part = part["text"]
        elif kind == "image":
            part = part.get("image")
        elif kind == "image_url":
            url = part.get("image_url")
            part = Image.from_url(url.get("url") if isinstance(url, Mapping) else url)
    if isinstance(part, str):
        if IMAGE in part:
            raise ChatTemplateError("message content holds U+E003, which aiollama reserves")
        return {"type": "text", "text": part}
    if isinstance(part, Image):
        found.append(part)
        return {"type": "media_marker", "text": IMAGE}
    raise ChatTemplateError(f"a content part is text or an image, got {part!r:.80}")
