"""Thinking blocks of reasoning models. Pure: no engine, no I/O.

Reasoning models (Qwen3, DeepSeek-R1 and their kin) think between ``<think>`` and ``</think>``
before they answer. Some templates open the block in the generation prompt, so the generated text
starts inside it and only the closing marker appears; :func:`opened` tells that case from the
prompt's end. :func:`split` divides generated text into the reasoning and the answer (OpenAI's
``reasoning_content`` and ``content``, as llama-server and vLLM emit them). gpt-oss's Harmony
channels are read the same way (:mod:`aiollama.formats.harmony`). A :class:`Budget` closes a
thinking block that has run for its number of tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from aiollama.formats import harmony

START, END = "<think>", "</think>"
ANALYSIS = harmony.CHANNEL + "analysis" + harmony.MESSAGE  # how a Harmony reply opens its thinking


def opened(prompt_tail: str, start: str = START) -> bool:
    """Whether a prompt ending with ``prompt_tail`` leaves the model inside a thinking block (that
    ``start`` opens)."""
    return prompt_tail.rstrip().endswith(start)


def split(text: str, *, inside: bool = False) -> tuple[str, str]:
    """``(reasoning, content)`` of generated text: the thinking block at its start, and the rest.
    ``inside``: the prompt opened the block, so the text starts in it. Text with a closing marker
    and no opening one is read that way too. Harmony replies: the analysis channel, and the rest."""
    if harmony.is_harmony(text):
        thought, content, _ = harmony.split(text)
        return thought, content
    stripped = text.lstrip()
    if stripped.startswith(START) and not inside:
        stripped = stripped[len(START):]
    elif not inside and (END not in text or START in text):
        return "", text
    reasoning, closed, content = stripped.partition(END)
    if not closed:
        return reasoning.strip(), ""
    return reasoning.strip(), content.lstrip()


def parts(text: str, *, inside: bool = False) -> tuple[str, str, bool]:
    """``split`` and ``pending`` at once (a Harmony reply is read once for both)."""
    if harmony.is_harmony(text):
        return harmony.split(text)
    return (*split(text, inside=inside), pending(text, inside=inside))


def pending(text: str, *, inside: bool = False) -> bool:
    """Whether streamed text is still in its thinking block, or too short to say: hold its
    content back until this is False."""
    if harmony.is_harmony(text):
        return harmony.split(text)[2]
    stripped = text.lstrip()
    if inside or stripped.startswith(START):
        return END not in stripped
    return START.startswith(stripped) or harmony.CHANNEL.startswith(stripped)


class Budget:
    """A thinking budget for one generation: once ``limit`` tokens have been generated inside its
    thinking block, the tokens of ``closing`` (a message, then the closing marker) are forced, one
    a step, and the model answers after them. ``inside``: the prompt opened the block. A Harmony
    reply's analysis channel counts the same way and is closed by ``harmony_closing`` (a message,
    the end of the message and the header of the final channel). A generation that starts with
    something other than a thinking block is not touched. ``start`` and ``end`` are the markers of
    the model's own thinking block (a chat format's: ``[THINK]``, ``<|channel>thought``...).
    """

    def __init__(self, limit: int, closing: Sequence[int], *, inside: bool, harmony_closing: Sequence[int] = (),
                 start: str = START, end: str = END) -> None:
        self.left = limit
        self.closing = list(closing)
        self.harmony_closing = list(harmony_closing)
        self.start = start
        self.end = end.strip() or end  # what closes the block the generation is in
        self.inside = inside
        self.done = False  # the block closed (by the model or by force), or there was none
        self.forced: deque[int] = deque()
        self._text = ""  # generated so far, until the block is known to be open (or not)
        if inside:
            self._enter()

    def _enter(self) -> None:
        self.inside = True
        self._text = ""
        if self.left <= 0:
            self.forced.extend(self.closing)

    @property
    def forcing(self) -> int | None:
        """The token the next step must take, if any."""
        return self.forced[0] if self.forced else None

    def took(self, piece: bytes) -> None:
        """The generation took a token whose text is ``piece``."""
        if self.forced:
            self.forced.popleft()
            self.done = not self.forced
            return
        if self.done:
            return
        self._text += piece.decode("utf-8", "replace")
        if not self.inside:
            head = self._text.lstrip()
            if head.startswith(self.start):
                self._enter()
            elif head.startswith(ANALYSIS) and self.harmony_closing:
                self.closing, self.end = self.harmony_closing, harmony.START
                self._enter()
            elif not (self.start.startswith(head) or ANALYSIS.startswith(head)):
                self.done = True
            return
        self._text = self._text[-len(self.end) * 4:]
        if self.end in self._text:
            self.done = True
            return
        self.left -= 1
        if self.left <= 0:
            self.forced.extend(self.closing)
