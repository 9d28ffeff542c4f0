"""aiollama: many concurrent llama.cpp conversations from async Python.

``Engine`` multiplexes any number of ``Conversation`` objects onto one llama.cpp context driven by
one decode thread (continuous batching); ``SyncEngine`` does the same for plain threads. The native
layer underneath is :mod:`aiollama.native`.

Names are imported on first use, so that importing a pure module (``aiollama.sched.scheduler``) does not
load llama.cpp or anyio.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

logging.getLogger("aiollama").addHandler(logging.NullHandler())

__version__ = "0.1.0"

_EXPORTS = {
    "Chunk": "aiollama.api.conversation",
    "Completion": "aiollama.api.conversation",
    "Conversation": "aiollama.api.conversation",
    "Stream": "aiollama.api.conversation",
    "SyncConversation": "aiollama.api.blocking",
    "SyncStream": "aiollama.api.blocking",
    "EngineConfig": "aiollama.config",
    "FinishReason": "aiollama.core.outputs",
    "GenerationStats": "aiollama.core.outputs",
    "Statistics": "aiollama.core.outputs",
    "TokenLogprob": "aiollama.core.outputs",
    "Engine": "aiollama.api.engine",
    "ModelEntry": "aiollama.api.model_set",
    "ModelSet": "aiollama.api.model_set",
    "ModelStatus": "aiollama.api.model_set",
    "models_in": "aiollama.api.model_set",
    "Plan": "aiollama.api.plan",
    "plan": "aiollama.api.plan",
    "Image": "aiollama.api.images",
    "SyncEngine": "aiollama.api.blocking",
    "SamplingParams": "aiollama.sampling",
    "Device": "aiollama.native.devices",
    "devices": "aiollama.native.devices",
    "cache_dir": "aiollama.models",
    "default_model": "aiollama.models",
    "pull": "aiollama.models",
    "AiollamaError": "aiollama.errors",
    "ChatTemplateError": "aiollama.errors",
    "ModelBusy": "aiollama.errors",
    "ModelNotLoaded": "aiollama.errors",
    "UnknownModel": "aiollama.errors",
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
    "ImageError": "aiollama.errors",
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

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 - a list, built from the lazy table


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
    from aiollama.api.blocking import (
        SyncConversation as SyncConversation,
    )
    from aiollama.api.blocking import (
        SyncEngine as SyncEngine,
    )
    from aiollama.api.blocking import (
        SyncStream as SyncStream,
    )
    from aiollama.api.conversation import (
        Chunk as Chunk,
    )
    from aiollama.api.conversation import (
        Completion as Completion,
    )
    from aiollama.api.conversation import (
        Conversation as Conversation,
    )
    from aiollama.api.conversation import (
        Stream as Stream,
    )
    from aiollama.api.engine import (
        Engine as Engine,
    )
    from aiollama.api.images import (
        Image as Image,
    )
    from aiollama.api.model_set import ModelEntry as ModelEntry
    from aiollama.api.model_set import ModelSet as ModelSet
    from aiollama.api.model_set import ModelStatus as ModelStatus
    from aiollama.api.model_set import models_in as models_in
    from aiollama.api.plan import Plan as Plan
    from aiollama.api.plan import plan as plan
    from aiollama.config import EngineConfig as EngineConfig
    from aiollama.core.outputs import (
        FinishReason as FinishReason,
    )
    from aiollama.core.outputs import (
        GenerationStats as GenerationStats,
    )
    from aiollama.core.outputs import (
        Statistics as Statistics,
    )
    from aiollama.core.outputs import (
        TokenLogprob as TokenLogprob,
    )
    from aiollama.errors import (
        AiollamaError as AiollamaError,
    )
    from aiollama.errors import (
        ChatTemplateError as ChatTemplateError,
    )
    from aiollama.errors import (
        ClosedError as ClosedError,
    )
    from aiollama.errors import (
        ContextCreateError as ContextCreateError,
    )
    from aiollama.errors import (
        ContextFull as ContextFull,
    )
    from aiollama.errors import (
        ConversationBusy as ConversationBusy,
    )
    from aiollama.errors import (
        ConversationClosed as ConversationClosed,
    )
    from aiollama.errors import (
        ConversationFileError as ConversationFileError,
    )
    from aiollama.errors import (
        DecodeError as DecodeError,
    )
    from aiollama.errors import (
        EngineClosed as EngineClosed,
    )
    from aiollama.errors import (
        EngineDead as EngineDead,
    )
    from aiollama.errors import (
        GrammarError as GrammarError,
    )
    from aiollama.errors import (
        ImageError as ImageError,
    )
    from aiollama.errors import (
        InvalidBatchError as InvalidBatchError,
    )
    from aiollama.errors import (
        InvalidOutputError as InvalidOutputError,
    )
    from aiollama.errors import (
        InvalidRequestError as InvalidRequestError,
    )
    from aiollama.errors import (
        InvalidSeqIdError as InvalidSeqIdError,
    )
    from aiollama.errors import (
        InvalidTokenError as InvalidTokenError,
    )
    from aiollama.errors import (
        LogitsProcessorError as LogitsProcessorError,
    )
    from aiollama.errors import ModelBusy as ModelBusy
    from aiollama.errors import (
        ModelIsADirectory as ModelIsADirectory,
    )
    from aiollama.errors import (
        ModelLoadError as ModelLoadError,
    )
    from aiollama.errors import (
        ModelMismatch as ModelMismatch,
    )
    from aiollama.errors import (
        ModelNotFound as ModelNotFound,
    )
    from aiollama.errors import ModelNotLoaded as ModelNotLoaded
    from aiollama.errors import (
        Overloaded as Overloaded,
    )
    from aiollama.errors import (
        StateRestoreError as StateRestoreError,
    )
    from aiollama.errors import UnknownModel as UnknownModel
    from aiollama.errors import (
        UnsupportedModel as UnsupportedModel,
    )
    from aiollama.errors import (
        WrongEventLoop as WrongEventLoop,
    )
    from aiollama.models import (
        cache_dir as cache_dir,
    )
    from aiollama.models import (
        default_model as default_model,
    )
    from aiollama.models import (
        pull as pull,
    )
    from aiollama.native.devices import (
        Device as Device,
    )
    from aiollama.native.devices import (
        devices as devices,
    )
    from aiollama.sampling import (
        SamplingParams as SamplingParams,
    )
