"""The KV cells of a unified llama.cpp cache as a radix tree of the tokens they hold. Pure Python.

In a unified cache ``seq_cp(src, dst, 0, n)`` makes ``dst`` share ``src``'s cells for positions
``[0, n)``; a cell is freed once no sequence holds it. :class:`KVCells` models exactly that as a tree
of spans: each sequence's cells are the path from its tail span to a root, and a span's ``refs``
counts the sequences whose path passes through it. Sequences that pass through a span hold the same
tokens there, so each span keeps them and the tree is a radix tree of every cached prefix: finding
the longest cached prefix of a prompt walks down from the roots, comparing spans, not sequences.
Each root belongs to a ``salt`` (None: the common one): a prefix is found only under roots of the
same salt, so conversations of different salts never share cells.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists (of one type: a list never equals a tuple),
    comparing slices at C speed."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Span:
    """Consecutive positions ``[start, end)`` held by the same set of sequences, and their tokens."""

    __slots__ = ("parent", "start", "tokens", "refs", "children", "salt")
    salt: str | None  # of its root: a prefix is found only by holders of the same salt

    def __init__(self, parent: Span | None, start: int, tokens: list[int], refs: int,
                 salt: str | None = None) -> None:
        self.salt = salt if parent is None else parent.salt
        self.parent = parent
        self.start = start
        self.tokens = tokens
        self.refs = refs
        self.children: dict[int, list[Span]] = {}  # first token -> the spans that continue this one

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def below(self) -> Iterator[Span]:
        """This span and every span under it."""
        stack = [self]
        while stack:
            span = stack.pop()
            yield span
            for spans in span.children.values():
                stack.extend(spans)

    def __repr__(self) -> str:
        return f"Span([{self.start}, {self.end}) refs={self.refs})"


def cached(tail: Span | None) -> int:
    """How many positions a sequence with this tail holds."""
    return 0 if tail is None else tail.end


class KVCells:
    """The cells in use as sequences grow, share prefixes, shrink and disappear, and their tokens."""

    def __init__(self, n_cells: int) -> None:
        self.n_cells = n_cells
        self.used = 0
        self.roots: dict[str | None, dict[int, list[Span]]] = {}  # salt -> first token -> root spans

    @property
    def free(self) -> int:
        return self.n_cells - self.used

    def _siblings(self, span: Span) -> dict[int, list[Span]]:
        return self.roots.setdefault(span.salt, {}) if span.parent is None else span.parent.children

    def _attach(self, span: Span) -> None:
        self._siblings(span).setdefault(span.tokens[0], []).append(span)

    def _detach(self, span: Span) -> None:
        siblings = self._siblings(span)
        spans = siblings[span.tokens[0]]
        spans.remove(span)
        if not spans:
            del siblings[span.tokens[0]]
            if not siblings and span.parent is None:
                del self.roots[span.salt]

    def extend(self, tail: Span | None, tokens: Sequence[int], salt: str | None = None) -> Span | None:
        """A sequence appended ``tokens``; return its new tail (a new root: of ``salt``)."""
        if not tokens:
            return tail
        self.used += len(tokens)
        if tail is not None and tail.refs == 1 and not tail.children:
            tail.tokens.extend(tokens)  # nobody else passes through the tail: grow it in place
            return tail
        span = Span(tail, cached(tail), list(tokens), 1, salt)
        self._attach(span)
        return span

    def _span_at(self, tail: Span, n: int) -> Span:
        """The span on ``tail``'s path that ends exactly at ``n`` (0 < n <= tail.end), splitting one."""
        span = tail
        while span.start >= n:
            assert span.parent is not None
            span = span.parent
        if span.end > n:
            k = n - span.start
            head = Span(span.parent, span.start, span.tokens[:k], span.refs, span.salt)
            siblings = self._siblings(span)[span.tokens[0]]
            siblings[siblings.index(span)] = head
            head.children = {span.tokens[k]: [span]}
            span.parent, span.start, span.tokens = head, n, span.tokens[k:]
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
                self._detach(span)
            span = span.parent
        return keep

    def release(self, tail: Span | None) -> None:
        """The sequence drops everything it holds."""
        self.truncate(tail, 0)

    def find(self, tokens: Sequence[int], limit: int, salt: str | None = None) -> tuple[Span | None, int]:
        """The span where the longest cached prefix of ``tokens`` (at most ``limit`` long, under
        roots of ``salt``) ends, and that prefix's length. Every sequence whose path passes through
        that span holds it.

        Spans of one level rarely share a first token (only cells computed apart, not shared); when
        they do, each is followed."""
        found: tuple[Span | None, int] = (None, 0)
        stack: list[tuple[dict[int, list[Span]], int]] = [(self.roots.get(salt, {}), 0)]
        while stack:
            level, pos = stack.pop()
            if pos >= limit:
                continue
            for span in level.get(tokens[pos], ()):
                m = common_prefix(span.tokens, tokens[pos:pos + span.length])
                if m and min(pos + m, limit) > found[1]:
                    found = (span, min(pos + m, limit))
                if m == span.length:
                    stack.append((span.children, pos + m))
        return found
