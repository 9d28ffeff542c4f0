"""What crosses the thread boundary: commands into the decode thread, deltas out of it.

Everything here is immutable. Commands go through one FIFO queue, so a conversation's commands take
effect in the order its caller issued them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiollama.sampling import SamplingParams


@dataclass(frozen=True)
class Delta:
    """One step's output for one stream: new text and tokens, and how it ended, if it did."""

    text: str = ""
    tokens: tuple[int, ...] = ()
    finish_reason: str | None = None  # "eog", "stop", "length", "cancelled"
    error: BaseException | None = None


class Portal(Protocol):
    """Runs a callback in the consumer's context (its event loop, or at once for threads).

    ``send`` never blocks the decode thread; it returns False when nobody can receive any more (the
    event loop is closed). ``owner`` is the event loop (or trio token) it delivers into.
    """

    owner: Any

    def send(self, callback: Callable[[], None]) -> bool: ...


class Sink(Protocol):
    """Where a stream's deltas go. ``deliver`` runs through ``portal``, in the consumer's context."""

    portal: Portal

    def deliver(self, delta: Delta) -> None: ...


@dataclass(frozen=True)
class NewConversation:
    conv: int
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class Prompt:
    conv: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Fork:
    parent: int
    child: int


@dataclass(frozen=True)
class Generate:
    conv: int
    params: SamplingParams
    sink: Sink


@dataclass(frozen=True)
class Cancel:
    """End the conversation's generation, if any, with finish_reason "cancelled"."""

    conv: int


@dataclass(frozen=True)
class Close:
    """Cancel, then free the conversation's seq id and cells; ``ack`` hears when it is done."""

    conv: int
    ack: Sink | None = None


@dataclass(frozen=True)
class Shutdown:
    pass


Command = NewConversation | Prompt | Fork | Generate | Cancel | Close | Shutdown
