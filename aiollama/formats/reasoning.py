"""Thinking blocks of reasoning models. Pure: no engine, no I/O.

Reasoning models (Qwen3, DeepSeek-R1 and their kin) think between ``<think>`` and ``</think>``
before they answer. Some templates open the block in the generation prompt, so the generated text
starts inside it and only the closing marker appears; :func:`opened` tells that case from the
prompt's end. :func:`split` divides generated text into the reasoning and the answer (OpenAI's
``reasoning_content`` and ``content``, as llama-server and vLLM emit them).
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def opened(prompt_tail: str) -> bool:
    """Whether a prompt ending with ``prompt_tail`` leaves the model inside a thinking block."""
    return prompt_tail.rstrip().endswith(START)


def split(text: str, *, inside: bool = False) -> tuple[str, str]:
    """``(reasoning, content)`` of generated text: the thinking block at its start, and the rest.
    ``inside``: the prompt opened the block, so the text starts in it. Text with a closing marker
    and no opening one is read that way too."""
    stripped = text.lstrip()
    if stripped.startswith(START) and not inside:
        stripped = stripped[len(START):]
    elif not inside and (END not in text or START in text):
        return "", text
    reasoning, closed, content = stripped.partition(END)
    if not closed:
        return reasoning.strip(), ""
    return reasoning.strip(), content.lstrip()


def pending(text: str, *, inside: bool = False) -> bool:
    """Whether streamed text is still in its thinking block, or too short to say: hold its
    content back until this is False."""
    stripped = text.lstrip()
    if inside or stripped.startswith(START):
        return END not in stripped
    return START.startswith(stripped)
