"""llama.cpp's chat layer: a model's chat templates and the parser of its replies.

Both are llama.cpp's own (``common/chat.h``), reached through the C shim ``cmake/aiollama_chat.h``
with JSON across it: templates are rendered by llama.cpp's Jinja engine with llama-server's handling
of messages, tools and switches, and replies are read by the parser of the model's family (or the
one llama.cpp derives from the template itself), so both come out as llama-server's do.

These objects hold C++ memory only (no context, no thread affinity), so they are freed when
garbage-collected. A renderer serializes its calls: llama.cpp does not promise that rendering one
template from several threads at once is safe.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

from aiollama.errors import ChatTemplateError, InvalidRequestError
from aiollama.native.binding import ffi, lib
from aiollama.native.model import Vocab


def _taken(ptr: Any) -> str:
    """The text of a string the shim returned, freed."""
    try:
        return str(ffi.string(ptr).decode("utf-8", "replace"))
    finally:
        lib.aiollama_chat_string_free(ptr)


def _call(fn: Any, *args: Any) -> tuple[Any, str | None]:
    """``fn(*args, &error)``: its result, and llama.cpp's message when it gave NULL."""
    error = ffi.new("char **")
    result = fn(*args, error)
    if result == ffi.NULL:
        return None, _taken(error[0]) if error[0] != ffi.NULL else "no reason given"
    return result, None


class ChatTemplates:
    """A model's chat templates (its own, and the "tool_use" variant where it has one), or the
    template text ``source`` given instead (then ``bos_token`` and ``eos_token`` are the texts it
    sees; from a vocabulary they are the model's own).

    Raises ChatTemplateError for a template llama.cpp cannot read.
    """

    def __init__(self, source: str | None = None, *, vocab: Vocab | None = None, bos_token: str = "",
                 eos_token: str = "") -> None:
        if source is not None and not isinstance(source, str):
            raise InvalidRequestError(f"a chat template is text, got {type(source).__name__}")
        if vocab is None and not source:
            raise InvalidRequestError("a chat template needs a model or a template text")
        src = source.encode() if source else ffi.NULL
        if vocab is not None:
            with vocab.pinned():
                ptr, why = _call(lib.aiollama_chat_init, vocab._model._alive(), src, bos_token.encode(),
                                 eos_token.encode())
        else:
            ptr, why = _call(lib.aiollama_chat_init, ffi.NULL, src, bos_token.encode(), eos_token.encode())
        if why is not None:
            raise ChatTemplateError(f"llama.cpp cannot read the chat template: {why}")
        self._ptr = ffi.gc(ptr, lib.aiollama_chat_free)
        self._lock = threading.Lock()
        described, why = _call(lib.aiollama_chat_describe, self._ptr)
        if why is not None:
            raise ChatTemplateError(f"llama.cpp cannot describe the chat template: {why}")
        info = json.loads(_taken(described))
        self.source: str = info["source"]
        self.tool_use_source: str = info["tool_use_source"]
        self.caps: dict[str, bool] = info["caps"]
        self.supports_thinking: bool = info["supports_thinking"]

    def apply(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Render a request (see ``aiollama_chat_apply``): the prompt, and how to constrain and
        parse the reply. Raises ChatTemplateError with llama.cpp's reason when it cannot."""
        try:
            text = json.dumps(inputs, ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:  # a lone surrogate: JSON can carry it, UTF-8 cannot
            before = exc.object[max(0, exc.start - 40):exc.start]
            raise ChatTemplateError(f"the request is not valid Unicode: a lone surrogate after {before!r}") from None
        with self._lock:
            out, why = _call(lib.aiollama_chat_apply, self._ptr, text)
        if why is not None:
            raise ChatTemplateError(why)
        result: dict[str, Any] = json.loads(_taken(out))
        return result

    def parser(self, params: Mapping[str, Any]) -> ChatParser:
        return ChatParser(params)


class ChatParser:
    """Reads replies in one rendering's format (``params``: its "format", "parser" and
    "generation_prompt", with "reasoning_format", "parse_tool_calls" and "is_continuation")."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        ptr, why = _call(lib.aiollama_chat_parser_init, json.dumps(params, ensure_ascii=False).encode())
        if why is not None:
            raise ChatTemplateError(f"llama.cpp cannot build the reply parser: {why}")
        self._ptr = ffi.gc(ptr, lib.aiollama_chat_parser_free)

    def parse(self, text: str, *, partial: bool) -> dict[str, Any]:
        """{"content", "reasoning_content", "tool_calls": [{"name", "arguments", "id"}]} of a reply
        (``partial``: more may follow). Raises ValueError where a whole reply does not match the
        format."""
        raw = text.encode("utf-8", "surrogatepass")
        out, why = _call(lib.aiollama_chat_parse, self._ptr, raw, len(raw), partial)
        if why is not None:
            raise ValueError(why)
        message: dict[str, Any] = json.loads(_taken(out))
        return message
