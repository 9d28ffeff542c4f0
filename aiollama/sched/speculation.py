"""Speculative decoding without a draft model: n-gram (prompt-lookup) drafts. Pure.

A generation that repeats what its history holds (a summary quoting its input, code edited in
place, a list copied with changes) can be decoded several tokens a step. The draft is what followed
the latest earlier occurrence of the history's last few tokens; the step evaluates the pending token
and the draft together, with logits for each, and the stream's own sampler chooses token after token
while it agrees with the draft. Every token is sampled from the logits of the true history, one
random draw each, in order, so the text (greedy, or seeded) is the text without drafts; a draft
only saves steps. Drafts come from the conversation's own history, so a fork drafts from its
parent's tokens too.

The draft length adapts per stream: it doubles (up to the limit) when the whole draft was taken,
halves when nothing was, so a stream that does not copy soon costs one extra row a step, and
after a partly taken draft offers two more than were taken.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

NGRAM_SIZES = (4, 3, 2)  # the longest match that has a continuation wins
WINDOW = 8192  # how far back a match is looked for


def draft(tokens: Sequence[int], limit: int) -> tuple[int, ...]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the history's last
    n-gram (longest n first); empty when there is none."""
    if limit <= 0 or len(tokens) < 2:
        return ()
    start = max(0, len(tokens) - WINDOW)
    window = array("i", tokens[start:])
    data = window.tobytes()
    size = window.itemsize
    n_tokens = len(window)
    for n in NGRAM_SIZES:
        if n_tokens <= n:
            continue
        needle = data[-n * size:]
        end = len(data) - size  # the match must end before the history's last token
        while True:
            at = data.rfind(needle, 0, end)
            if at < 0:
                break
            if at % size == 0:  # on a token boundary
                first = at // size + n
                if first < n_tokens:
                    found = tuple(window[first:first + limit])
                    # an image's placeholders are no tokens to draft: the draft stops before them
                    return found if min(found) >= 0 else found[:next(i for i, t in enumerate(found) if t < 0)]
                break
            end = at + n * size - 1  # a misaligned hit: look further back
    return ()


PAST_TAKEN = 2  # after a partly taken draft, the next one offers this many more than were taken


# A stream whose one-token drafts are rejected (or whose first draft is, none of its tokens taken
# yet) stops drafting for this many of its decodes, PAUSE_GROWTH times as many after each further
# rejected probe (up to PAUSE_MAX), and probes with one token after them. Where each row costs its
# own compute (SmolLM2 on a 2-core CPU: a step of one row 7.8 ms, of two 14.2 ms), every probe
# costs nearly a token: growing by 2, a draft that never agrees tried 6 tokens in a 96-token reply;
# by 4 and pausing at once, 4.
PAUSE_MIN = 8
PAUSE_GROWTH = 4
PAUSE_MAX = 256
START = 2  # a stream's first draft: it doubles from there while drafts are taken whole


class DraftLength:
    """A stream's draft length: starts short, doubles after a fully accepted draft, halves after a
    rejected one,
    and follows what was taken after a partly taken one (each draft row costs a row of compute on
    a CPU: on the copying benchmark prompt this offered 86 rows instead of 96 for the same 67
    taken tokens and 18 steps). A rejected one-token draft, or a rejected first draft, stops
    drafting for a pause (0: off), longer after each rejected probe, so that drafts which never
    agree cost nearly nothing; an accepted token ends the pauses and the length grows again."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.current = min(limit, START)
        self.drafted = 0
        self.accepted = 0
        self.paused = 0  # decodes left without drafting
        self.pause = PAUSE_MIN  # the next pause's length

    def record(self, offered: int, taken: int) -> None:
        """A draft of ``offered`` tokens had ``taken`` of them accepted."""
        self.drafted += offered
        self.accepted += taken
        if taken:
            self.pause = PAUSE_MIN
        if taken == offered:
            self.current = min(self.limit, max(1, self.current) * 2)
        elif taken == 0 and (self.current <= 1 or not self.accepted):  # one token, or anything yet, rejected: pause
            self.current, self.paused = 0, self.pause
            self.pause = min(PAUSE_MAX, self.pause * PAUSE_GROWTH)
        elif taken == 0:
            self.current = max(1, self.current // 2)
        else:  # the copy broke off inside the draft: offer about as much as was taken
            self.current = min(self.limit, taken + PAST_TAKEN)

    def worth(self, share: float) -> int:
        """How many draft tokens pay where a row takes ``share`` of a step (see
        :mod:`aiollama.sched.rowcost`): the k-th is taken with about p**k, p this stream's rate so
        far (a prior of one taken and one not); 0 where not even the first pays."""
        if share <= 0.0:
            return self.limit
        p = (self.accepted + 1) / (self.drafted + 2)
        k = 0
        while k < self.limit and p ** (k + 1) > share:
            k += 1
        return k

    def offer(self) -> int:
        """How many tokens this decode may draft (counting down a pause; 1, a probe, after it)."""
        if self.current == 0:
            self.paused -= 1
            if self.paused <= 0:
                self.current = 1
            return 0
        return self.current
