"""aiollama: many concurrent llama.cpp conversations from async Python.

``Engine`` multiplexes any number of ``Conversation`` objects onto one llama.cpp context driven by
one decode thread (continuous batching); ``SyncEngine`` does the same for plain threads. The native
layer underneath is :mod:`aiollama.native`.

Names are imported on first use, so that importing a pure module (``aiollama.scheduler``) does not
load llama.cpp or anyio.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

logging.getLogger("aiollama").addHandler(logging.NullHandler())

__version__ = "0.1.0"

_EXPORTS = {
    "Chunk": "aiollama.conversation",
    "Completion": "aiollama.conversation",
    "Conversation": "aiollama.conversation",
    "Stream": "aiollama.conversation",
    "SyncConversation": "aiollama.conversation",
    "SyncStream": "aiollama.conversation",
    "EngineConfig": "aiollama.boundary",
    "FinishReason": "aiollama.boundary",
    "GenerationStats": "aiollama.boundary",
    "Statistics": "aiollama.boundary",
    "Engine": "aiollama.engine",
    "SyncEngine": "aiollama.engine",
    "SamplingParams": "aiollama.sampling",
    "Device": "aiollama.native.devices",
    "devices": "aiollama.native.devices",
    "cache_dir": "aiollama.models",
    "default_model": "aiollama.models",
    "pull": "aiollama.models",
    "AiollamaError": "aiollama.errors",
    "ChatTemplateError": "aiollama.errors",
    "ClosedError": "aiollama.errors",
    "ContextCreateError": "aiollama.errors",
    "ContextFull": "aiollama.errors",
    "ConversationFileError": "aiollama.errors",
    "ConversationBusy": "aiollama.errors",
    "ConversationClosed": "aiollama.errors",
    "DecodeError": "aiollama.errors",
    "EngineClosed": "aiollama.errors",
    "EngineDead": "aiollama.errors",
    "GrammarError": "aiollama.errors",
    "InvalidBatchError": "aiollama.errors",
    "InvalidOutputError": "aiollama.errors",
    "InvalidRequestError": "aiollama.errors",
    "InvalidSeqIdError": "aiollama.errors",
    "InvalidTokenError": "aiollama.errors",
    "LogitsProcessorError": "aiollama.errors",
    "ModelIsADirectory": "aiollama.errors",
    "ModelLoadError": "aiollama.errors",
    "ModelMismatch": "aiollama.errors",
    "ModelNotFound": "aiollama.errors",
    "Overloaded": "aiollama.errors",
    "StateRestoreError": "aiollama.errors",
    "UnsupportedModel": "aiollama.errors",
    "WrongEventLoop": "aiollama.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiollama' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:  # tests/test_layers.py checks that this block and _EXPORTS agree
    from aiollama.boundary import (
        EngineConfig as EngineConfig,
        FinishReason as FinishReason,
        GenerationStats as GenerationStats,
        Statistics as Statistics,
    )
    from aiollama.conversation import (
        Chunk as Chunk,
        Completion as Completion,
        Conversation as Conversation,
        Stream as Stream,
        SyncConversation as SyncConversation,
        SyncStream as SyncStream,
    )
    from aiollama.engine import (
        Engine as Engine,
        SyncEngine as SyncEngine,
    )
    from aiollama.errors import (
        AiollamaError as AiollamaError,
        ChatTemplateError as ChatTemplateError,
        ClosedError as ClosedError,
        ContextCreateError as ContextCreateError,
        ContextFull as ContextFull,
        ConversationFileError as ConversationFileError,
        ConversationBusy as ConversationBusy,
        ConversationClosed as ConversationClosed,
        DecodeError as DecodeError,
        EngineClosed as EngineClosed,
        EngineDead as EngineDead,
        GrammarError as GrammarError,
        InvalidBatchError as InvalidBatchError,
        InvalidOutputError as InvalidOutputError,
        InvalidRequestError as InvalidRequestError,
        InvalidSeqIdError as InvalidSeqIdError,
        InvalidTokenError as InvalidTokenError,
        LogitsProcessorError as LogitsProcessorError,
        ModelIsADirectory as ModelIsADirectory,
        ModelLoadError as ModelLoadError,
        ModelMismatch as ModelMismatch,
        ModelNotFound as ModelNotFound,
        Overloaded as Overloaded,
        StateRestoreError as StateRestoreError,
        UnsupportedModel as UnsupportedModel,
        WrongEventLoop as WrongEventLoop,
    )
    from aiollama.native.devices import (
        Device as Device,
        devices as devices,
    )
    from aiollama.models import (
        cache_dir as cache_dir,
        default_model as default_model,
        pull as pull,
    )
    from aiollama.sampling import (
        SamplingParams as SamplingParams,
    )
