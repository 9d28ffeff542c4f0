"""The file a saved conversation lives in: bytes in, bytes out, and one helper that writes them
to a file whole or not at all.

Layout, little-endian::

    magic "AIOLLAMA-CONV\\n" | u32 version | u32 header length | header (JSON) |
    tokens (i32 each) | state (the cells of the first n_cached tokens) | picture rows | sha256 of all before

A history with pictures (version 2) also holds each picture's embedding rows (float32, in the
order the header lists them, with the number its placeholders carry and the picture's sha256), so
that it loads into any engine of the same model: the numbers are that engine's own once loaded.

The header holds the fingerprint of the model and cache layout the state was copied from, the
counts, and what the conversation kept of its chat. A file that is cut, altered or not ours raises
``ConversationFileError``; one from another model raises ``ModelMismatch``, before anything changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiollama.errors import ConversationFileError, ModelMismatch
from aiollama.formats.images import image_row

MAGIC = b"AIOLLAMA-CONV\n"
VERSION = 2  # 1: no pictures (still written for a history without them, and read)
_U32 = struct.Struct("<I")
_DIGEST = 32


@dataclass(frozen=True)
class Saved:
    tokens: tuple[int, ...]
    n_cached: int
    state: bytes
    chat: dict[str, Any] | None
    fingerprint: Mapping[str, Any]
    images: tuple[tuple[int, bytes, np.ndarray], ...] = ()  # (number, sha256 of the picture, rows)


def dump(saved: Saved) -> bytes:
    fields: dict[str, Any] = {"fingerprint": dict(saved.fingerprint), "n_tokens": len(saved.tokens),
                              "n_cached": saved.n_cached, "state_bytes": len(saved.state), "chat": saved.chat}
    rows = [np.ascontiguousarray(r, dtype=np.float32) for _, _, r in saved.images]
    if saved.images:
        fields["images"] = [{"number": n, "sha256": d.hex(), "shape": list(r.shape)}
                            for (n, d, _), r in zip(saved.images, rows)]
    header = json.dumps(fields).encode()
    body = b"".join([MAGIC, _U32.pack(VERSION if saved.images else 1), _U32.pack(len(header)), header,
                     struct.pack(f"<{len(saved.tokens)}i", *saved.tokens), saved.state, *(r.tobytes() for r in rows)])
    return body + hashlib.sha256(body).digest()


def load(data: bytes, fingerprint: Mapping[str, Any]) -> Saved:
    """Parse and check a saved conversation against the engine's ``fingerprint``."""
    if not data.startswith(MAGIC):
        raise ConversationFileError("not a saved aiollama conversation (wrong magic)")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if len(data) < len(MAGIC) + 8 + _DIGEST or hashlib.sha256(body).digest() != digest:
        raise ConversationFileError("the saved conversation is damaged (its checksum does not match)")
    at = len(MAGIC)
    (version,) = _U32.unpack_from(body, at)
    if version not in (1, VERSION):
        raise ConversationFileError(f"saved conversation format {version}; this version reads 1 and {VERSION}")
    (n_header,) = _U32.unpack_from(body, at + 4)
    at += 8
    try:
        header = json.loads(body[at:at + n_header])
        n_tokens, n_cached, n_state = int(header["n_tokens"]), int(header["n_cached"]), int(header["state_bytes"])
        theirs: dict[str, Any] = dict(header["fingerprint"])
        pictures = [(int(p["number"]), bytes.fromhex(p["sha256"]), int(p["shape"][0]), int(p["shape"][1]))
                    for p in header.get("images", [])]
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConversationFileError(f"the saved conversation's header is malformed: {exc}") from None
    at += n_header
    n_rows = sum(4 * rows * width for _, _, rows, width in pictures)
    if len(body) != at + 4 * n_tokens + n_state + n_rows or not 0 <= n_cached <= n_tokens or n_tokens < 0 \
            or any(rows < 1 or width < 1 for _, _, rows, width in pictures):
        raise ConversationFileError("the saved conversation's sizes do not add up")
    differ = sorted(k for k in set(theirs) | set(fingerprint) if theirs.get(k) != fingerprint.get(k))
    if differ:
        raise ModelMismatch(f"the conversation was saved from another model or cache layout (differs in: "
                            f"{', '.join(differ)}; saved from {theirs.get('model')!r})")
    tokens = struct.unpack_from(f"<{n_tokens}i", body, at)
    at += 4 * n_tokens
    state = body[at:at + n_state]
    at += n_state
    images = []
    for number, digest, rows, width in pictures:
        images.append((number, digest, np.frombuffer(body, np.float32, rows * width, at).reshape(rows, width).copy()))
        at += 4 * rows * width
    return Saved(tuple(tokens), n_cached if state else 0, bytes(state), header.get("chat"), theirs, tuple(images))


def check_tokens(tokens: Sequence[int], n_vocab: int, images: Mapping[int, Any] | None = None) -> None:
    """Every token is in the vocabulary, or a placeholder of a picture whose rows ``images`` holds
    (by number)."""
    for t in tokens:
        if t < 0 and images is not None:
            number, row = image_row(t)
            if number in images and row < len(images[number]):
                continue
            raise ConversationFileError("the saved conversation holds a picture's row it has no rows for")
        if not 0 <= t < n_vocab:
            raise ConversationFileError("the saved conversation holds token ids outside this vocabulary")


def write_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file, then a rename)."""
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
