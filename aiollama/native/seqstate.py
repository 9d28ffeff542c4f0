"""Reading one sequence's saved KV state (``llama_state_seq_get_data``) to put its cells in position
order, or keep only its positions from some point on.

llama.cpp writes a sequence's cells in cell order and restores them into the free cells it finds,
in the same order. The engine's deterministic mode needs each sequence's cells in position order
(flash attention sums them cell by cell), and re-lays the cache from saved states where a restored
sequence shares its first positions with another one already put back: only the rest is restored.

The layout read here is llama.cpp's plain KV cache at the pinned tag (one stream)::

    u32 magic, i32 seq_id                     (the context's header)
    u32 n_stream
    u32 cell_count
    cell_count x (i32 pos, u32 n_seq_id, [12 bytes of cell extras], n_seq_id x i32 seq_id)
    u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v
    per layer:  i32 k_type, u64 k_row_bytes, cell_count rows
    per layer with V, not transposed:  i32 v_type, u64 v_row_bytes, cell_count rows
                      transposed:      i32 v_type, u32 v_el_bytes, u32 n_embd_v, n_embd_v x cell_count elements

A split cache's state names one stream per seq id, all empty but the sequence's own (:func:`restream`
re-frames it for a cache of another stream count).
Anything else (several streams, a sliding-window cache's second section, a recurrent memory) does
not parse to the blob's exact length and raises :class:`StateFormatError`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from aiollama.errors import AiollamaError

HEADER = 8  # magic and seq id, kept as they are
EXTRA_BYTES = (0, 12)  # a cell's extras (M-RoPE's 2D position, a token id) exist for some models only


class StateFormatError(AiollamaError):
    """A saved sequence state this module cannot read (another memory layout or llama.cpp version)."""


@dataclass(frozen=True)
class _Section:
    """At ``offset``: ``rows`` rows of ``width`` bytes, one per cell; for a transposed V, ``rows``
    lines of one ``width``-byte element per cell."""

    offset: int
    rows: int
    width: int


@dataclass(frozen=True)
class _Layout:
    cell_count: int
    meta: list[tuple[int, int, int]]  # per cell: (position, byte offset, byte length) of its record
    data_start: int  # where v_trans, n_layer, n_rot_k, n_rot_v begin
    n_layer: int
    transposed: bool  # V is stored as lines of one element per cell
    sections: list[tuple[int, int, _Section]]  # (header offset, header length, section): K layers, then V


def _read(fmt: str, data: bytes, at: int) -> tuple[tuple[int, ...], int]:
    size = struct.calcsize(fmt)
    if at + size > len(data):
        raise StateFormatError("the state ends early")
    return struct.unpack_from(fmt, data, at), at + size


def _parse(data: bytes, extra: int) -> _Layout:
    (n_stream, cell_count), at = _read("<II", data, HEADER)
    if n_stream != 1:
        raise StateFormatError(f"a state of {n_stream} streams")
    meta: list[tuple[int, int, int]] = []
    for _ in range(cell_count):
        start = at
        (pos, n_seq_id), at = _read("<iI", data, at)
        at += extra + 4 * n_seq_id
        meta.append((pos, start, at - start))
    data_start = at
    (v_trans, n_layer, _, _), at = _read("<IIII", data, at)
    sections: list[tuple[int, int, _Section]] = []
    for _ in range(n_layer):  # K
        head = at
        (_, row), at = _read("<iQ", data, at)
        sections.append((head, at - head, _Section(at, cell_count, row)))
        at += cell_count * row
    while at < len(data):  # V, for the layers that have one
        head = at
        if v_trans:
            (_, el, n_embd), at = _read("<iII", data, at)
            sections.append((head, at - head, _Section(at, n_embd, el)))
            at += n_embd * cell_count * el
        else:
            (_, row), at = _read("<iQ", data, at)
            sections.append((head, at - head, _Section(at, cell_count, row)))
            at += cell_count * row
    if at != len(data) or len(sections) > 2 * n_layer:
        raise StateFormatError("the state is not one plain KV cache")
    return _Layout(cell_count, meta, data_start, n_layer, bool(v_trans), sections)


def layout(data: bytes) -> _Layout:
    """Parse a state; StateFormatError if it is not one stream of a plain KV cache."""
    if len(data) < HEADER + 8:
        raise StateFormatError("the state is too short")
    for extra in EXTRA_BYTES:
        try:
            return _parse(data, extra)
        except StateFormatError:
            continue
    raise StateFormatError("the state is not one plain KV cache of a known layout")


def positions(data: bytes) -> list[int]:
    """The positions of a state's cells, in the order they are stored."""
    return [pos for pos, _, _ in layout(data).meta]


def ordered(data: bytes, start: int = 0) -> bytes:
    """The state with its cells in position order and only positions ``>= start`` kept; ``b""``
    when none are left. Raises StateFormatError for a state of another layout."""
    lay = layout(data)
    keep = sorted((pos, i) for i, (pos, _, _) in enumerate(lay.meta) if pos >= start)
    if not keep:
        return b""
    order = np.fromiter((i for _, i in keep), dtype=np.intp, count=len(keep))
    if len(keep) == lay.cell_count and bool(np.all(order[1:] > order[:-1])):
        return data  # already in order, nothing dropped
    buf = np.frombuffer(data, dtype=np.uint8)
    out = [data[:HEADER], struct.pack("<II", 1, len(keep))]
    out += [data[lay.meta[i][1]:lay.meta[i][1] + lay.meta[i][2]] for _, i in keep]
    out.append(data[lay.data_start:lay.data_start + 16])
    for k, (head, head_len, sec) in enumerate(lay.sections):
        out.append(data[head:head + head_len])
        if lay.transposed and k >= lay.n_layer:  # V lines: one element per cell
            block = buf[sec.offset:sec.offset + sec.rows * lay.cell_count * sec.width]
            out.append(block.reshape(sec.rows, lay.cell_count, sec.width)[:, order].tobytes())
        else:
            block = buf[sec.offset:sec.offset + sec.rows * sec.width]
            out.append(block.reshape(sec.rows, sec.width)[order].tobytes())
    return b"".join(out)


def restream(data: bytes, n_stream: int) -> bytes:
    """The state as a cache of ``n_stream`` streams would have written it: llama.cpp restores a
    sequence into its own stream whichever stream its cells were written under, so this moves the
    one non-empty stream to the front and writes empty ones (a zero cell count each) after it.
    Raises StateFormatError for a state of another layout."""
    (have,), at = _read("<I", data, HEADER)
    if have == n_stream:
        return data
    if have < 1 or n_stream < 1:
        raise StateFormatError(f"a state of {have} streams cannot become one of {n_stream}")
    empty = struct.pack("<I", 0)
    for index in range(have):  # noqa: B007 - the stream it stopped at is read after the loop
        (count,), after = _read("<I", data, at)
        if count:
            break
        at = after
    else:
        return data[:HEADER] + struct.pack("<I", n_stream) + empty * n_stream
    tail = 4 * (have - 1 - index)  # the streams after it, empty
    if data[len(data) - tail:] != empty * (have - 1 - index):
        raise StateFormatError("a state with cells in more than one stream")
    block = data[at:len(data) - tail]
    layout(data[:HEADER] + struct.pack("<I", 1) + block)  # one plain KV cache, or StateFormatError
    return data[:HEADER] + struct.pack("<I", n_stream) + block + empty * (n_stream - 1)
