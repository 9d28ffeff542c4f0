"""The exceptions aiollama raises, in one tree.

Everything derives from :class:`AiollamaError`. Errors about the caller's input also derive from
:class:`ValueError`, errors about a missing model file from the matching ``OSError``, so code that
already catches those keeps working::

    AiollamaError
    ├── Overloaded                  the engine's queue is full; retry later         (act on it)
    ├── ContextFull                 a history longer than the context can hold      (act on it)
    ├── LogitsProcessorError        a stream's logits processor raised (its __cause__)
    ├── ClosedError                 something was used after it was closed (also RuntimeError)
    │   ├── EngineClosed                the engine was closed, or not started
    │   └── ConversationClosed          the conversation was closed
    ├── EngineDead                  the decode thread failed; every stream gets it  (engine gone)
    ├── WrongEventLoop              an Engine used outside its event loop (also RuntimeError)
    ├── ModelBusy                   a model of a ModelSet is in use, and the caller would not wait
    ├── ModelLoadError              the model could not be loaded (also ValueError)
    │   ├── ModelNotFound               no file at the path (also FileNotFoundError)
    │   ├── ModelIsADirectory           the path is a folder (also IsADirectoryError)
    │   └── UnsupportedModel            a model this engine cannot serve in the mode asked
    ├── ContextCreateError          llama.cpp could not create a context (out of memory...)
    ├── StateRestoreError           a saved sequence state does not fit this context
    ├── InvalidRequestError         bad input, refused before it reaches llama.cpp (also ValueError)
    │   ├── ConversationBusy            stream() while the previous stream still runs
    │   ├── ChatTemplateError           malformed chat messages, or the template refuses them
    │   ├── ConversationFileError       a saved conversation that is damaged or not one
    │   │   └── ModelMismatch               saved from another model or cache layout
    │   ├── GrammarError                a GBNF grammar that does not parse, or a token it rejects
    │   ├── ImageError                  an image that is no picture, or one the engine cannot take
    │   ├── UnknownModel                a name no model of a ModelSet has (also LookupError)
    │   ├── ModelNotLoaded              a ModelSet's model not loaded, and loading on use is off
    │   ├── InvalidTokenError           a token id outside the vocabulary
    │   ├── InvalidBatchError           native layer only: batch too large, empty, position gaps
    │   ├── InvalidSeqIdError           native layer only: seq id outside [0, n_seq_max)
    │   └── InvalidOutputError          native layer only: sampling a row that has no logits
    └── DecodeError                 native layer only: llama_decode failed; reaches engine
                                    users as the __cause__ of EngineDead

Input errors leave every state untouched: the caller can fix the input and go on.
``Overloaded``, ``ContextFull`` and ``LogitsProcessorError`` concern one request; the engine keeps serving everyone else.
``EngineDead`` means the engine is gone: every waiting stream and every later call gets it.
``tests/test_errors.py`` keeps this tree complete and in the order of the classes below.
"""

from __future__ import annotations


class AiollamaError(Exception):
    """Base class of every error aiollama raises on purpose."""


class Overloaded(AiollamaError):
    """More generations are queued than ``max_queued`` allows. Nothing was queued; retry later."""


class ContextFull(AiollamaError):
    """The conversation's history alone is as long as the context: nothing can be generated.
    ``n_prompt_tokens`` and ``n_ctx`` say by how much, where known."""

    def __init__(self, message: str, *, n_prompt_tokens: int | None = None, n_ctx: int | None = None) -> None:
        super().__init__(message)
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx


class LogitsProcessorError(AiollamaError):
    """A logits processor of the stream raised; the exception it raised is the ``__cause__``. Only
    that stream ends."""


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


class ModelBusy(AiollamaError):
    """A model of a :class:`~aiollama.ModelSet` has requests or conversations, and its closing
    was asked not to wait for them. Nothing was closed."""


class ModelLoadError(AiollamaError, ValueError):
    """A model could not be loaded: missing, not GGUF, truncated, or not supported."""


class ModelNotFound(ModelLoadError, FileNotFoundError):
    """No file at the model path."""


class ModelIsADirectory(ModelLoadError, IsADirectoryError):
    """The model path names a folder, not a GGUF file."""


class UnsupportedModel(ModelLoadError):
    """A model the engine cannot serve in the mode asked: a recurrent or hybrid one in the
    deterministic mode or with drafts (its memory cannot drop a rejected draft), a sliding-window
    one in the deterministic mode."""


class ContextCreateError(AiollamaError):
    """llama.cpp could not create a context (out of memory, or parameters the backend refuses)."""


class StateRestoreError(AiollamaError):
    """A saved sequence state could not be restored: no room, or another model or layout."""


class InvalidRequestError(AiollamaError, ValueError):
    """Input that llama.cpp would reject or abort on, refused beforehand. ``param`` names the
    parameter at fault where one is (the server's 400s name it)."""

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class ConversationBusy(InvalidRequestError):
    """``stream()`` while the conversation's previous stream is neither finished nor cancelled."""


class ChatTemplateError(InvalidRequestError):
    """A malformed chat message, a role holding special-token text, or messages the model's chat
    template refuses (it called ``raise_exception``)."""


class ConversationFileError(InvalidRequestError):
    """A saved conversation that is damaged, cut short, of another format, or not one at all.
    Nothing was loaded."""


class ModelMismatch(ConversationFileError):
    """A saved conversation from another model or cache layout. Nothing was loaded."""


class GrammarError(InvalidRequestError):
    """A GBNF grammar that does not parse, or a token the grammar cannot accept."""


class ImageError(InvalidRequestError):
    """An image the engine cannot take: bytes that are no picture it can read, an engine without a
    projector (``mmproj``), or a picture of more rows than one step or image may hold."""


class UnknownModel(InvalidRequestError, LookupError):
    """A model name (or alias) that no model of the :class:`~aiollama.ModelSet` has."""


class ModelNotLoaded(InvalidRequestError):
    """A model of the :class:`~aiollama.ModelSet` that is not loaded, where loading on first use is
    off: load it first."""


class InvalidTokenError(InvalidRequestError):
    """A token id outside the model's vocabulary."""


class InvalidBatchError(InvalidRequestError):
    """A batch that llama.cpp cannot take: empty, larger than n_batch, or with a position gap."""


class InvalidSeqIdError(InvalidRequestError):
    """A sequence id outside ``[0, n_seq_max)``."""


class InvalidOutputError(InvalidRequestError):
    """A batch index that produced no logits in the last decode."""


class DecodeError(AiollamaError):
    """llama_decode failed with a fatal status; the context may hold partial results."""
