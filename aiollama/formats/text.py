"""Turning token pieces into stream text: whole UTF-8 characters only, stop strings never emitted.

Pure Python; the decode thread feeds it the bytes of each sampled token.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence


class TextAssembler:
    """Assembles the text of one generation from token pieces.

    A piece may end inside a UTF-8 character; those bytes wait for the rest. Text that could be the
    start of a stop string is held back until it is known not to be one, so no part of a stop string
    is ever emitted. Invalid UTF-8 becomes U+FFFD.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._stop = tuple(s for s in stop if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = ""  # decoded text not yet emitted: a possible stop-string prefix
        self.stopped = False
        self.matched: str | None = None  # the stop string found

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to emit.

        After a stop string is found, :attr:`stopped` is True and the text before it is returned.
        """
        if self.stopped:
            return ""
        self._held += self._decoder.decode(piece)
        return self._release()

    def finish(self) -> str:
        """End of generation: return whatever is still held (an incomplete character becomes U+FFFD)."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(b"", final=True)
        out = self._release()
        if self.stopped:
            return out
        out += self._held
        self._held = ""
        return out

    def _release(self) -> str:
        held = self._held
        if not self._stop:
            self._held = ""
            return held
        first = -1
        for stop in self._stop:
            i = held.find(stop)
            if i >= 0 and (first < 0 or i < first):
                first, self.matched = i, stop
        if first >= 0:
            self.stopped = True
            self._held = ""
            return held[:first]
        cut = len(held) - partial_tail(held, self._stop)
        self._held = held[cut:]
        return held[:cut]


def partial_tail(text: str, markers: Iterable[str]) -> int:
    """How long the end of ``text`` is that could still grow into one of ``markers`` (the longest
    tail that is a proper prefix of one): what a stream holds back until it knows."""
    keep = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), keep, -1):
            if text.endswith(marker[:k]):
                keep = k
                break
    return keep
