"""A conversation's chat: the messages given to ``chat()``, the replies streamed back, and where each
turn's tokens begin in the history.

Each turn renders the messages so far plus the new ones and appends only what follows the previous
reply (the end of that reply's turn, the new messages and the generation prompt), so earlier turns
are never evaluated again. Knowing where each turn begins keeps ``messages`` true when the
conversation is rewound: cutting a reply shortens it, cutting to where a reply began lets the next
stream generate it again, cutting to where a turn began removes that turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiollama.api.client import EngineClient
from aiollama.api.media import pictures
from aiollama.api.stream import Collector
from aiollama.decoder.outputs import FinishReason
from aiollama.errors import ChatTemplateError
from aiollama.formats.chat import (
    IMAGE,
    REPLY,
    Messages,
    normalize,
    protect,
    segments,
    template_text,
)
from aiollama.formats.toolcalls import describe


@dataclass(frozen=True)
class _Turn:
    start: int  # the history's length before this turn's tokens
    reply_start: int  # its length after them: where the reply begins
    n_given: int  # messages given before this turn's (the reply before it not counted)
    previous: Collector | None  # the reply before this turn


class ChatTurns:
    def __init__(self) -> None:
        self.given: list[dict[str, str]] | None = None  # messages so far; None before the first turn
        self.reply: Collector | None = None  # the latest turn's reply, as it streams
        self.turns: list[_Turn] = []
        self.broken = False  # rewound into the middle of a turn's prompt

    @property
    def messages(self) -> list[dict[str, str]]:
        out = [dict(m) for m in self.given or ()]
        if self.reply is not None:
            out.append({"role": "assistant", "content": self.reply.text})
        return out

    def render(self, core: EngineClient, messages: Messages, *, first: bool,
               tools: list[dict[str, Any]] | None = None,
               kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[dict[str, Any]], dict[int, Any]]:
        """The tokens of a new turn holding ``messages`` (offering ``tools``, the template given
        ``kwargs``), and the messages normalized. A template without a place for tools gets them described in a system message,
        and earlier tool calls written as JSON, as llama-server does."""
        if self.broken:
            raise ChatTemplateError("the conversation was rewound into the middle of a chat turn; rewind "
                                    "to where a turn or a reply begins, or start a new conversation")
        messages, images = pictures(messages)
        new = normalize(messages)
        for message in new:
            for text in template_text(message):
                core.check_template_text(text)
        template = core.chat_template
        if tools and not template.supports_tools:
            new = tools_as_text(new, tools, first=self.given is None)
            tools = None
        protected, contents = protect(new)
        if self.given is None:
            rendered = template.render(protected, True, tools, kwargs)
        else:
            history = self.messages
            if self.reply is None:
                history.append({"role": "assistant", "content": ""})
            previous = history[:-1] + [{"role": "assistant", "content": REPLY}]
            full = template.render(previous + protected, True, tools, kwargs)
            at = full.rfind(REPLY)
            if at < 0:
                raise ChatTemplateError("the chat template drops the previous assistant reply, so a turn "
                                        "cannot be appended; start a new conversation with all messages")
            rendered = full[at + len(REPLY):]
            if self.reply is not None and self.reply.finish_reason is FinishReason.EOG:
                # the reply's end-of-generation token is already in the conversation
                rendered = next((rendered[len(t):] for t in template.eog_texts if rendered.startswith(t)),
                                rendered)
        parts = segments(rendered, contents)
        if sum(p.text.count(IMAGE) for p in parts if not p.template) != len(images):
            raise ChatTemplateError("the chat template dropped or repeated a message's picture")
        encoded = [core.images.tokens(image) for image in images]
        tokens = core.chat_tokens(parts, first=first, images=[t for t, _ in encoded])
        if not tokens:
            raise ChatTemplateError("the chat template rendered nothing for these messages")
        return tokens, new, {n: r for _, rows in encoded for n, r in rows.items()}

    def appended(self, start: int, n_tokens: int, new: list[dict[str, str]]) -> None:
        """A turn of ``n_tokens`` was appended at history length ``start``."""
        n_given = len(self.given or ())
        history = self.messages
        if self.given is not None and self.reply is None:
            history.append({"role": "assistant", "content": ""})  # as render() put it
        self.turns.append(_Turn(start, start + n_tokens, n_given, self.reply))
        self.given, self.reply = history + new, None

    def streaming(self, history_len: int, result: Collector) -> None:
        """A stream starts at ``history_len``: where a reply is awaited, it is that reply."""
        if self.turns and self.reply is None and history_len == self.turns[-1].reply_start:
            self.reply = result

    def rewound(self, keep: int, detokenize: Callable[[Sequence[int]], str]) -> None:
        """The history was cut to its first ``keep`` tokens."""
        while self.turns and keep <= self.turns[-1].start:
            turn = self.turns.pop()
            self.given = self.given[:turn.n_given] if self.turns and self.given is not None else None
            self.reply = turn.previous
        if not self.turns:
            return
        turn = self.turns[-1]
        if keep < turn.reply_start:
            self.broken, self.reply = True, None
        elif self.reply is not None and keep < turn.reply_start + len(self.reply.tokens) + 1:
            kept = self.reply.tokens[:keep - turn.reply_start]
            self.reply = Collector([detokenize(kept)], kept, FinishReason.LENGTH) if kept else None

    def copy(self) -> ChatTurns:
        """For a fork: the same chat; a reply still streaming stops where the fork branched."""
        twin = ChatTurns()
        twin.given = [dict(m) for m in self.given] if self.given is not None else None
        reply = self.reply
        if reply is not None and not reply.done:
            reply = Collector(list(reply.parts), list(reply.tokens))
        twin.reply, twin.turns, twin.broken = reply, list(self.turns), self.broken
        return twin

    def state(self) -> dict[str, Any] | None:
        """What a saved conversation keeps of its chat (None: no chat)."""
        if self.given is None:
            return None
        return {"given": self.given, "broken": self.broken, "reply": _reply_state(self.reply),
                "turns": [[t.start, t.reply_start, t.n_given, _reply_state(t.previous)] for t in self.turns]}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> ChatTurns:
        """The chat of a saved conversation (see :meth:`state`); KeyError/TypeError/ValueError if
        the state is malformed."""
        chat = cls()
        if state is not None:
            chat.given, chat.broken = [dict(m) for m in state["given"]], bool(state["broken"])
            chat.reply = _reply_of(state["reply"])
            chat.turns = [_Turn(int(a), int(b), int(n), _reply_of(r)) for a, b, n, r in state["turns"]]
        return chat


def _reply_state(reply: Collector | None) -> dict[str, Any] | None:
    if reply is None:
        return None
    return {"text": reply.text, "tokens": reply.tokens, "finish_reason": str(reply.finish_reason or "length")}


def _reply_of(state: dict[str, Any] | None) -> Collector | None:
    if state is None:
        return None
    return Collector([str(state["text"])], [int(t) for t in state["tokens"]], FinishReason(state["finish_reason"]))


def tools_as_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, first: bool) -> list[dict[str, Any]]:
    """Messages for a template without a place for tools: earlier calls written as JSON in their
    message, and (``first``: the conversation's first turn) the tools described in the system
    message, as llama-server does."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message["tool_calls"]]
            text = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            message = {"role": message["role"], "content": (message["content"] + "\n" + text).strip()}
        out.append(message)
    if first:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + describe(tools)}
        else:
            out.insert(0, {"role": "system", "content": describe(tools)})
    return out
