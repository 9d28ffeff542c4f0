"""The file of one sequence state in the disk tier (:mod:`aiollama.core.diskcache`).

``MAGIC``, a 4-byte little-endian header length, the header (JSON: the namespace, the salt, how many
tokens, how many bytes of state, and the SHA-256 of the tokens and the state), the tokens (int32,
little-endian), then the state as ``llama_state_seq_get_data`` copied it. The file's name is a
digest of the namespace, the salt and the tokens: a file is found by what it holds, and a file whose
contents do not match its name is damaged.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import BinaryIO

import numpy as np

MAGIC = b"AIOLLAMA-KV\x00"
FORMAT = 1
SUFFIX = ".kv"
_PREFIX = len(MAGIC) + 4

# what a damaged file raises while it is parsed
Damaged = (ValueError, KeyError, TypeError, struct.error)


def file_name(namespace: str, tokens: Sequence[int], salt: str | None) -> str:
    """The name (without ``SUFFIX``) of the file of ``tokens`` under ``salt``."""
    digest = hashlib.sha256(namespace.encode() + b"\0" + (b"s" + salt.encode("utf-8", "surrogatepass")
                                                          if salt is not None else b"n") + b"\0" + _token_bytes(tokens))
    return digest.hexdigest()[:40]


def encode(namespace: str, tokens: Sequence[int], salt: str | None, data: bytes) -> list[bytes]:
    """The file's bytes, in pieces to write one after the other."""
    body = _token_bytes(tokens)
    header = json.dumps({"namespace": namespace, "salt": salt, "n_tokens": len(tokens),
                         "n_bytes": len(data), "sha256": _digest(body, data)}).encode()
    return [MAGIC + struct.pack("<I", len(header)) + header, body, data]


def read_head(f: BinaryIO) -> bytes:
    """The bytes of an open file up to its state: enough to index it."""
    head = f.read(_PREFIX)
    if len(head) < _PREFIX or not head.startswith(MAGIC):
        return head
    (n_header,) = struct.unpack_from("<I", head, len(MAGIC))
    header = f.read(n_header)
    n_tokens = int(json.loads(header).get("n_tokens", 0)) if header else 0
    return head + header + f.read(4 * n_tokens)


def parse(namespace: str, name: str, raw: bytes, size: int,
          data: bytes | None = None) -> tuple[tuple[int, ...], str | None, bytes] | None:
    """The tokens, salt and state of a file of ``size`` bytes, from its head (:func:`read_head`) and
    with ``data``, the rest of it (then checked against its digest; without, the state is empty).
    None for a file of another namespace; raises one of ``Damaged`` for a damaged one."""
    if len(raw) < _PREFIX or not raw.startswith(MAGIC):
        raise ValueError("not a state file")
    (n_header,) = struct.unpack_from("<I", raw, len(MAGIC))
    start = _PREFIX + n_header
    header = json.loads(raw[_PREFIX:start])
    if header.get("namespace") != namespace:
        return None
    n_tokens, n_bytes, salt = int(header["n_tokens"]), int(header["n_bytes"]), header["salt"]
    body_end = start + 4 * n_tokens
    if len(raw) != body_end or size != body_end + n_bytes or (data is not None and len(data) != n_bytes):
        raise ValueError("truncated, or longer than its header says")
    tokens = tuple(int(t) for t in np.frombuffer(raw[start:body_end], dtype="<i4"))
    if file_name(namespace, tokens, salt) != name:
        raise ValueError("its tokens do not match its name")
    if data is not None and _digest(raw[start:body_end], data) != header["sha256"]:
        raise ValueError("its digest does not match")
    return tokens, salt, data or b""


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def _digest(body: bytes, data: bytes) -> str:
    h = hashlib.sha256(body)
    h.update(data)
    return h.hexdigest()
