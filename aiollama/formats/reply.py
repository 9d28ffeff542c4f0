"""A chat reply read as it streams: its reasoning, its content and its tool calls.

The reading is llama.cpp's: the parser of the model's format (:class:`aiollama.formats.chat.
ReplyParser`, from the chat turn's rendering) reads the text so far at each chunk, as llama-server
does, less the middles of its long runs of reasoning or content (:mod:`aiollama.formats.splice`,
so that a long reply costs linear time), and :class:`ReplyReader` turns what changed into deltas that concatenate to the
final message: text is sent once the parser has settled it, and a tool call's name and id go out
whole, before its arguments stream. No marker text reaches the content.

Where a template has no place for tools, aiollama describes them in a system message and the model
answers with a JSON call (:func:`aiollama.formats.toolcalls.json_calls`); content that may be such a
call is held back until the reply ends. Pure: no engine, no I/O.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiollama.formats.chat import ReplyParser
from aiollama.formats.splice import Spliced
from aiollama.formats.toolcalls import ToolCall, json_calls, might_be_call


@dataclass(frozen=True)
class CallDelta:
    """A piece of tool call ``index``: its id and name (sent once, whole), or more of its arguments."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class ReplyDelta:
    """What a chunk added to the message: reasoning, content, or pieces of tool calls."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[CallDelta, ...] = ()


@dataclass(frozen=True)
class Message:
    """A whole reply: its content, its reasoning and its tool calls."""

    content: str
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ReplyReader:
    """Reads one reply. ``described``: the tools a template without a place for them was told of
    (their calls are JSON in the content)."""

    def __init__(self, parser: ReplyParser, *, described: Sequence[Mapping[str, Any]] = (),
                 splice: bool = True) -> None:
        self.parser = parser
        self.text = ""
        # splice: the parser reads the reply less the middles of its long runs (linear time); else
        # the whole text at every chunk, as llama-server does (quadratic; for comparisons)
        self._spliced = Spliced(lambda doc: parser.parse(doc, partial=True)) if splice else None
        self._names = {t["function"]["name"]: t["function"].get("parameters") or {} for t in described}
        self._parsed: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
        self._sent = {"reasoning_content": "", "content": ""}
        self._calls: list[list[str]] = []  # per call sent: [id, name, arguments sent]
        self._final: Message | None = None

    def feed(self, text: str) -> list[ReplyDelta]:
        """The deltas for ``text`` added to the reply."""
        self.text += text
        try:
            if self._spliced is not None:
                parsed = self._spliced.feed(text, self.text)
            else:
                parsed = self.parser.parse(self.text, partial=True)
        except ValueError:
            return []  # the parser cannot read the text yet: wait for more
        self._parsed = parsed
        return self._deltas(parsed, final=False)

    def finish(self) -> list[ReplyDelta]:
        """The last deltas, once the reply has ended; :attr:`message` is then the whole message.
        Again, it gives nothing."""
        if self._final is not None:
            return []
        try:
            parsed = self.parser.parse(self.text, partial=False)
        except ValueError:  # not the model's format after all: the reply is content
            parsed = {**self._parsed, "content": self._parsed["content"] or self.text}
            if not self._parsed["content"] and not self._parsed["reasoning_content"] and not self._calls:
                parsed = {"content": self.text, "reasoning_content": "", "tool_calls": []}
        calls = [ToolCall(c["name"], c["arguments"] or "{}", self._call_id(i, c))
                 for i, c in enumerate(parsed["tool_calls"])]
        content = parsed["content"]
        if self._names and not calls:
            found = json_calls(content.strip(), self._names)
            if found:
                content, calls = "", found
        self._final = Message(content, parsed["reasoning_content"], calls)
        parsed = {"content": content, "reasoning_content": parsed["reasoning_content"],
                  "tool_calls": [{"name": c.name, "arguments": c.arguments, "id": c.id} for c in calls]}
        return self._deltas(parsed, final=True)

    def read(self, text: str) -> Message:
        """The whole message of a reply that has ended, read at once."""
        if self._final is None:
            self.text = text
            self.finish()
        return self.message

    @property
    def message(self) -> Message:
        """The message so far (whole after :meth:`finish`)."""
        if self._final is not None:
            return self._final
        p = self._parsed
        return Message(p["content"], p["reasoning_content"],
                       [ToolCall(c["name"], c["arguments"], self._call_id(i, c)) for i, c in enumerate(p["tool_calls"])])

    def _call_id(self, i: int, call: Mapping[str, Any]) -> str:
        if i < len(self._calls):
            return self._calls[i][0]
        return str(call.get("id") or "") or _new_id()

    def _deltas(self, parsed: Mapping[str, Any], *, final: bool) -> list[ReplyDelta]:
        out = []
        for key in ("reasoning_content", "content"):
            text, sent = parsed[key], self._sent[key]
            if key == "content" and self._names and not final and might_be_call(text):
                continue  # may be a JSON call: held until the end
            if len(text) > len(sent) and text.startswith(sent):
                self._sent[key] = text
                delta = text[len(sent):]
                out.append(ReplyDelta(reasoning=delta) if key == "reasoning_content" else ReplyDelta(content=delta))
        calls = self._call_deltas(parsed["tool_calls"], final)
        if calls:
            out.append(ReplyDelta(calls=tuple(calls)))
        return out

    def _call_deltas(self, calls: Sequence[Mapping[str, Any]], final: bool) -> list[CallDelta]:
        """A call's id and name go out once the name is whole: when its arguments have begun, a
        call follows it, or the reply ended. Then its arguments, as far as they extend what was
        sent."""
        out = []
        for i, call in enumerate(calls):
            settled = final or i + 1 < len(calls) or bool(call["arguments"])
            if i == len(self._calls):
                if not call["name"] or not settled:
                    break
                self._calls.append([str(call.get("id") or "") or _new_id(), call["name"], ""])
                out.append(CallDelta(i, self._calls[i][0], call["name"]))
            sent = self._calls[i][2]
            args = call["arguments"] or ("{}" if final else "")
            if len(args) > len(sent) and args.startswith(sent):
                self._calls[i][2] = args
                out.append(CallDelta(i, arguments=args[len(sent):]))
        return out
