"""The exceptions aiollama raises, in one tree.

Everything derives from :class:`AiollamaError`. Errors about the caller's input also derive from
:class:`ValueError`, so code that already catches ``ValueError`` keeps working::

    AiollamaError
    ├── Overloaded              the engine's queue is full; retry later            (act on it)
    ├── ContextFull             a conversation is longer than the context can hold (act on it)
    ├── ClosedError             something was used after it was closed
    │   ├── EngineClosed            the engine was closed
    │   └── ConversationClosed      the conversation was closed
    ├── EngineDead              the decode thread failed; every stream gets this   (engine gone)
    ├── WrongEventLoop          an Engine used outside the event loop that started it
    ├── ModelLoadError          the model file is missing, not GGUF, truncated or unsupported
    ├── InvalidRequestError     bad input, refused before it reaches llama.cpp (also ValueError)
    │   ├── InvalidBatchError       batch too large, empty, position gaps
    │   ├── InvalidSeqIdError       seq id outside [0, n_seq_max)
    │   ├── InvalidTokenError       token id outside the vocabulary
    │   ├── InvalidOutputError      sampling a batch row that produced no logits
    │   └── GrammarError            a GBNF grammar that does not parse, or a token it rejects
    └── DecodeError             llama.cpp failed to decode (compute or allocation failure)

Input errors leave the native state untouched: the caller can fix the input and go on.
``Overloaded`` and ``ContextFull`` concern one request; the engine keeps serving everyone else.
``EngineDead`` means the engine is gone: every waiting stream and every later call gets it.
A ``DecodeError`` means the context may hold partial results of the failed call.
"""

from __future__ import annotations


class AiollamaError(Exception):
    """Base class of every error aiollama raises on purpose."""


class ClosedError(AiollamaError, RuntimeError):
    """A handle was used after it was closed."""


class EngineClosed(ClosedError):
    """The engine was closed (or never started)."""


class ConversationClosed(ClosedError):
    """The conversation was closed with ``aclose()``."""


class EngineDead(AiollamaError):
    """The decode thread stopped on a fatal error; the engine cannot serve anymore."""


class WrongEventLoop(AiollamaError, RuntimeError):
    """An ``Engine`` (or its conversations) used from another event loop or a plain thread.

    An ``Engine`` belongs to the event loop that started it; plain threads use ``SyncEngine``.
    """


class Overloaded(AiollamaError):
    """More generations are queued than ``max_queued`` allows. Nothing was queued; retry later."""


class ContextFull(AiollamaError):
    """The conversation's history alone is as long as the context: nothing can be generated."""


class ModelLoadError(AiollamaError, ValueError):
    """A model file could not be loaded: not GGUF, truncated, or not supported by llama.cpp."""


class InvalidRequestError(AiollamaError, ValueError):
    """Input that llama.cpp would reject or abort on, refused beforehand."""


class InvalidBatchError(InvalidRequestError):
    """A batch that llama.cpp cannot take: empty, larger than n_batch, or with a position gap."""


class InvalidSeqIdError(InvalidRequestError):
    """A sequence id outside ``[0, n_seq_max)``."""


class InvalidTokenError(InvalidRequestError):
    """A token id outside the model's vocabulary."""


class InvalidOutputError(InvalidRequestError):
    """A batch index that produced no logits in the last decode."""


class GrammarError(InvalidRequestError):
    """A GBNF grammar that does not parse, or a token the grammar cannot accept."""


class DecodeError(AiollamaError):
    """llama_decode failed with a fatal status; the context may hold partial results."""


class ConversationBusy(InvalidRequestError):
    """``stream()`` while the conversation's previous stream is neither finished nor cancelled."""


class ChatTemplateError(InvalidRequestError):
    """A malformed chat message, a role holding special-token text, or messages the model's chat
    template refuses (it called ``raise_exception``)."""
