"""gpt-oss's Harmony format in generated text. Pure: no engine, no I/O.

llama.cpp shows ``<|start|>``, ``<|channel|>``, ``<|message|>`` and ``<|constrain|>`` as text (it
makes them user-defined tokens for gpt-oss), ``<|end|>`` as nothing, and ``<|return|>`` and
``<|call|>`` end the generation. After the template's generation prompt (``<|start|>assistant``)
a reply therefore reads::

    <|channel|>analysis<|message|>THOUGHT<|start|>assistant<|channel|>final<|message|>ANSWER
    <|channel|>analysis<|message|>THOUGHT<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS

:func:`split` reads the ``analysis`` channel as the reasoning and the ``final`` channel (and
``commentary`` without a recipient, a preamble) as the content; a message to ``functions.NAME`` is
a tool call, written into the content in the Hermes form (``<tool_call>{"name", "arguments"}
</tool_call>``) that :func:`aiollama.formats.toolcalls.parse` reads.
"""

from __future__ import annotations

import json
import re

from aiollama.formats.text import partial_tail

CHANNEL, START, MESSAGE, CONSTRAIN = "<|channel|>", "<|start|>", "<|message|>", "<|constrain|>"
_MARKERS = (CHANNEL, START, MESSAGE, CONSTRAIN)
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def is_harmony(text: str) -> bool:
    """Whether generated text is in the Harmony format (it opens with a channel)."""
    return text.lstrip().startswith(CHANNEL)


def _complete(text: str) -> str:
    """``text`` less a tail that could be the start of a marker (while it streams)."""
    return text[:len(text) - partial_tail(text, _MARKERS)]


def split(text: str) -> tuple[str, str, bool]:
    """``(reasoning, content, pending)`` of a Harmony reply; ``pending``: it is still in its
    analysis, or a message's header is not complete (hold the content back)."""
    thoughts: list[str] = []
    content: list[str] = []
    pending = False
    for part in _complete(text).split(START):
        if not part.strip():
            continue
        head, has_body, body = part.partition(MESSAGE)
        channel = _CHANNEL.search(head)
        if not has_body or channel is None:
            pending = True  # the header is still coming
            continue
        recipient = _RECIPIENT.search(head)
        pending = channel.group(1) == "analysis"
        if channel.group(1) == "analysis":
            thoughts.append(body)
        elif recipient is not None and recipient.group(1).startswith("functions."):
            name = recipient.group(1)[len("functions."):]
            content.append(f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {body.strip() or "{}"}}}\n'
                           "</tool_call>")
        else:
            content.append(body)
    return "\n".join(t.strip() for t in thoughts), "".join(content).strip(), pending
