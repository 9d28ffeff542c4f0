"""A streamed reply's text as its parser needs to see it, kept short: what keeps a streamed reply's
reading linear in its length.

llama.cpp's parsers read a reply whole, so a reader that parses the text so far at every chunk (as
llama-server does) does quadratic work: a reply of 4,000 tokens is parsed 4,000 times, each time
longer. Most of a long reply is a *run*: reasoning, or content, that the parser copies into one
field unchanged. :class:`Spliced` cuts the middle of each settled run out of the text it hands the
parser, keeping ``KEEP`` characters on each side of the cut so that every marker around it reads as
before, and puts the cut text back into the parsed field. The parser then reads the reply's markers
and the text since the last cut, never the long runs again.

A cut is checked at every parse: the characters on both sides of it must still be next to each
other in the same field. When they are not (the parser read the text otherwise, which a marker
within a run could make it do), the cuts are given up and the whole text is parsed, as before:
correct first, fast where it can be. Tool calls' arguments are not cut (their text is JSON, not
copied unchanged). Pure: no engine, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KEEP = 64  # characters kept on each side of a cut: longer than any format's marker
MIN_CUT = 256  # a run is cut only where that takes this many characters out
FIELDS = ("content", "reasoning_content")

Parse = Callable[[str], dict[str, Any]]


@dataclass
class _Cut:
    field: str
    at: int  # where in the document the text was cut out
    text: str  # what was cut out
    value_at: int  # where in the whole field's value it goes back


class Spliced:
    """The text of one streamed reply, fed chunk by chunk and parsed with ``parse`` (partial)."""

    def __init__(self, parse: Parse) -> None:
        self._parse = parse
        self._doc = ""  # the reply less its cuts: what the parser reads
        self._cuts: list[_Cut] = []
        self.cut_chars = 0  # characters the parser no longer reads (for tests and measurements)

    def feed(self, text: str, reply: str) -> dict[str, Any]:
        """The parse of the whole reply so far (``reply``, its owner's), ``text`` its latest part.
        ValueError where the parser cannot read it yet."""
        self._doc += text
        if self._cuts:
            parsed = self._parse(self._doc)
            whole = self._restore(parsed)
            if whole is None:  # a cut no longer falls within one run: read the whole text again
                self._cuts, self._doc, self.cut_chars = [], reply, 0
                whole = parsed = self._parse(self._doc)
        else:
            whole = parsed = self._parse(self._doc)
        self._cut(parsed)
        return whole

    def _restore(self, parsed: dict[str, Any]) -> dict[str, Any] | None:
        """``parsed`` (of the document) with the cut text put back, or None where a cut's sides are
        no longer next to each other in its field."""
        whole = dict(parsed)
        for name in FIELDS:
            cuts = [c for c in self._cuts if c.field == name]
            if not cuts:
                continue
            value, out, taken, before = parsed[name], [], 0, 0
            for cut in cuts:  # in the order of the text, as they were made
                at = cut.value_at - before  # where the cut falls in the document's value
                left, right = self._doc[max(0, cut.at - KEEP):cut.at], self._doc[cut.at:cut.at + KEEP]
                if value[max(0, at - len(left)):at] != left or value[at:at + len(right)] != right:
                    return None
                out += [value[taken:at], cut.text]
                taken, before = at, before + len(cut.text)
            whole[name] = "".join(out) + value[taken:]
        return whole

    def _cut(self, parsed: dict[str, Any]) -> None:
        """Cut the middle of the run the document ends with, if it is long enough."""
        doc = self._doc
        for name in FIELDS:
            value = parsed[name]
            m = _common_suffix(doc, value)
            a, b = len(doc) - m + KEEP, len(doc) - KEEP
            if b - a < MIN_CUT:
                continue
            inside = [c for c in self._cuts if a <= c.at <= b]
            if any(c.field != name for c in inside):
                return  # the run spans another field's cut: leave it
            before = sum(len(c.text) for c in self._cuts if c.field == name and c.at < a)
            value_at = len(value) - m + KEEP + before
            text, pos = [], a  # the cut text: the document's, with the cuts inside it put back
            for c in inside:
                text += [doc[pos:c.at], c.text]
                pos = c.at
            text.append(doc[pos:b])
            cut = _Cut(name, a, "".join(text), value_at)
            self._cuts = [c for c in self._cuts if c not in inside]
            for c in self._cuts:
                if c.at > b:
                    c.at -= b - a
            self._cuts.append(cut)
            self._cuts.sort(key=lambda c: c.at)
            self._doc = doc[:a] + doc[b:]
            self.cut_chars += b - a
            return


def _common_suffix(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` end with in common."""
    n = min(len(a), len(b))
    if n == 0 or a[-1] != b[-1]:
        return 0
    lo, hi = 1, n  # the suffix of length lo is common; find the longest (common suffixes nest)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[-mid:] == b[-mid:]:
            lo = mid
        else:
            hi = mid - 1
    return lo
