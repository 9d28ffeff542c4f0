"""What goes into the decode thread: the commands callers send through its one FIFO queue (so a
conversation's commands take effect in the order its caller issued them), the portal and sink
protocols through which its answers come back, and the one counter both sides share
(:class:`Admission`, locked). Commands are immutable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiollama.core.outputs import Ack, Delta, Item
from aiollama.sampling import SamplingParams


class Portal(Protocol):
    """Runs a callback in the consumer's context (its event loop, or at once for threads).

    ``send`` never blocks the decode thread; it returns False when nobody can receive any more (the
    event loop is closed). ``owner`` is the event loop (or trio token) it delivers into. What was
    sent runs once ``wake`` is called (the decode thread does so as its next decode starts, or
    before it waits), through the event loop's own thread-safe channel; a portal for plain threads
    delivers in ``send`` and its ``wake`` does nothing.
    """

    @property
    def owner(self) -> Any: ...

    def send(self, callback: Callable[[], None]) -> bool: ...

    def wake(self) -> None: ...

    def after_delivery(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` (it must be safe from any thread) once what was sent before it has
        been delivered and the consumers it woke have had their turn; False when nobody receives
        any more. Like what ``send`` sends, it runs after a ``wake``."""
        ...


class Sink(Protocol):
    """Where a stream's items go. ``deliver`` runs through ``portal``, in the consumer's context."""

    portal: Portal

    def deliver(self, item: Item) -> None: ...


@dataclass(frozen=True)
class NewConversation:
    conv: int
    tokens: tuple[int, ...] = ()
    salt: str | None = None  # shares cached cells only with conversations of the same salt
    lora: tuple[tuple[str, float], ...] = ()  # the LoRA adapters its decodes apply, by name, with scales


@dataclass(frozen=True)
class Prompt:
    """Append tokens; while the conversation generates, they wait until that generation ends."""

    conv: int
    tokens: tuple[int, ...]
    # image number -> the embedding rows its placeholders in ``tokens`` stand for
    images: Mapping[int, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Fork:
    """A new conversation ``child`` holding the first ``n_tokens`` tokens of ``parent``'s history."""

    parent: int
    child: int
    n_tokens: int


@dataclass(frozen=True)
class Generate:
    """Start generating; ``matcher`` is the compiled constraint (llguidance), if any; ``guide`` the
    conversation whose logits guide this one's (classifier-free guidance) with ``guidance_scale``;
    ``created``: when the caller asked (``time.perf_counter()``)."""

    conv: int
    params: SamplingParams
    sink: Sink
    matcher: Any = None
    guide: int | None = None
    guidance_scale: float = 1.0
    created: float = 0.0
    lora: tuple[tuple[str, float], ...] | None = None  # other adapters from this generation on; None: the same


@dataclass(frozen=True)
class Cancel:
    """End the conversation's generation, if any, with ``FinishReason.CANCELLED``."""

    conv: int


@dataclass(frozen=True)
class Close:
    """Cancel, then free the conversation's seq id and cells; ``ack`` gets an :class:`Ack`."""

    conv: int
    ack: Sink | None = None


@dataclass(frozen=True)
class Rewind:
    """Keep only the first ``n_tokens`` tokens of a conversation that does not generate."""

    conv: int
    n_tokens: int


@dataclass(frozen=True)
class Save:
    """Answer with a :class:`Snapshot` of the conversation."""

    conv: int
    sink: Sink


@dataclass(frozen=True)
class Load:
    """A new conversation ``conv`` holding ``tokens``, with the cells of the first ``n_cached``
    restored from ``state`` when they fit (evaluated again otherwise); answered with an Ack."""

    conv: int
    tokens: tuple[int, ...] = field(repr=False)
    n_cached: int
    state: bytes = field(repr=False)
    sink: Sink
    images: Mapping[int, Any] = field(default_factory=dict, repr=False)  # the rows of its pictures, by number


@dataclass(frozen=True)
class Embed:
    """Embed token lists; answered with :class:`Vectors` (or a Delta carrying the error)."""

    texts: tuple[tuple[int, ...], ...] = field(repr=False)
    normalize: bool
    sink: Sink


@dataclass(frozen=True)
class ClearCache:
    """Drop every cache entry and every parked state; ``ack`` gets an :class:`Ack`."""

    ack: Sink


@dataclass(frozen=True)
class Shutdown:
    pass


Command = (NewConversation | Prompt | Fork | Generate | Cancel | Close | Rewind | Save | Load | ClearCache
           | Embed | Shutdown)


class Admission:
    """The count of generations waiting for a seq id, shared by callers and the decode thread.

    A caller enters before sending ``Generate`` (or gets ``False``: the engine is overloaded); the
    decode thread leaves once the generation is admitted or ended.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._count = 0
        self._lock = threading.Lock()

    def enter(self) -> bool:
        with self._lock:
            if self._count >= self.limit:
                return False
            self._count += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._count -= 1



# What a command that will never be applied gets (the decode thread stopped before it): whoever
# waits for an answer is answered, with the error where an answer carries one.
_WHEN_GONE: dict[type, Callable[[Any, BaseException], tuple[Sink, Item] | None]] = {
    Generate: lambda c, error: (c.sink, Delta(error=error)),
    Close: lambda c, error: (c.ack, Ack()) if c.ack is not None else None,
    ClearCache: lambda c, error: (c.ack, Ack()),
    Embed: lambda c, error: (c.sink, Delta(error=error)),
    Save: lambda c, error: (c.sink, Delta(error=error)),
    Load: lambda c, error: (c.sink, Ack()),  # the conversation it made raises at its first use
}


def answer_when_gone(command: Command, error: BaseException) -> tuple[Sink, Item] | None:
    """The answer to ``command`` now that the engine will never apply it, and where it goes."""
    answer = _WHEN_GONE.get(type(command))
    return None if answer is None else answer(command, error)
