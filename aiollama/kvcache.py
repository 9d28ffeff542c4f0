"""Bookkeeping of KV cells shared between sequences, mirroring a unified llama.cpp KV cache.

In a unified cache ``seq_cp(src, dst, 0, n)`` makes ``dst`` share ``src``'s cells for positions
``[0, n)``; a cell is freed once no sequence holds it. This module models exactly that as a tree of
spans: each sequence's cache is the path from its tail span to the root, and a span's ``refs`` counts
the sequences whose path passes through it. Pure Python, no llama.cpp.
"""

from __future__ import annotations


class Span:
    """Consecutive positions ``[start, end)`` held by the same set of sequences."""

    __slots__ = ("parent", "start", "length", "refs")

    def __init__(self, parent: Span | None, start: int, length: int, refs: int) -> None:
        self.parent = parent
        self.start = start
        self.length = length
        self.refs = refs

    @property
    def end(self) -> int:
        return self.start + self.length

    def __repr__(self) -> str:
        return f"Span([{self.start}, {self.end}) refs={self.refs})"


def cached(tail: Span | None) -> int:
    """How many positions a sequence with this tail holds."""
    return 0 if tail is None else tail.end


class KVCells:
    """Counts the cells in use as sequences grow, share prefixes, shrink and disappear."""

    def __init__(self, n_cells: int) -> None:
        self.n_cells = n_cells
        self.used = 0

    @property
    def free(self) -> int:
        return self.n_cells - self.used

    def extend(self, tail: Span | None, count: int) -> Span | None:
        """A sequence appended ``count`` positions; return its new tail."""
        if count <= 0:
            return tail
        self.used += count
        if tail is not None and tail.refs == 1:
            tail.length += count  # nobody else passes through the tail: grow it in place
            return tail
        return Span(tail, cached(tail), count, 1)

    def _span_at(self, tail: Span, n: int) -> Span:
        """The span on ``tail``'s path that ends exactly at ``n`` (0 < n <= tail.end), splitting one."""
        span = tail
        while span.start >= n:
            assert span.parent is not None
            span = span.parent
        if span.end > n:
            head = Span(span.parent, span.start, n - span.start, span.refs)
            span.parent = head
            span.length -= head.length
            span.start = n
            span = head
        return span

    def share(self, src: Span | None, n: int) -> Span | None:
        """A new sequence shares the first ``n`` positions of ``src``'s path; return its tail."""
        if src is None or n <= 0:
            return None
        if n > src.end:
            raise ValueError(f"cannot share {n} positions of a sequence that holds {src.end}")
        span: Span | None = self._span_at(src, n)
        tail = span
        while span is not None:
            span.refs += 1
            span = span.parent
        return tail

    def truncate(self, tail: Span | None, n: int) -> Span | None:
        """The sequence keeps only its first ``n`` positions; return its new tail."""
        if tail is None or n >= tail.end:
            return tail
        keep = self._span_at(tail, n) if n > 0 else None
        span: Span | None = tail
        while span is not keep:
            assert span is not None
            span.refs -= 1
            if span.refs == 0:
                self.used -= span.length
            span = span.parent
        return keep

    def release(self, tail: Span | None) -> None:
        """The sequence drops everything it holds."""
        self.truncate(tail, 0)
