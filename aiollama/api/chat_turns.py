"""A conversation's chat: the messages given to ``chat()``, the replies streamed back, and where each
turn's tokens begin in the history.

Each turn renders the messages so far plus the new ones and appends only what follows the previous
reply (the end of that reply's turn, the new messages and the generation prompt), so earlier turns
are never evaluated again. Knowing where each turn begins keeps ``messages`` true when the
conversation is rewound: cutting a reply shortens it, cutting to where a reply began lets the next
stream generate it again, cutting to where a turn began removes that turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiollama.api.client import EngineClient
from aiollama.api.images import pictures
from aiollama.api.stream import Collector
from aiollama.core.outputs import FinishReason
from aiollama.errors import ChatTemplateError, InvalidRequestError
from aiollama.formats.chat import Rendered
from aiollama.formats.messages import IMAGE, REPLY, Messages, normalize
from aiollama.formats.reply import ReplyReader
from aiollama.formats.toolcalls import call_schema
from aiollama.sampling import SamplingParams


@dataclass(frozen=True)
class _Turn:
    start: int  # the history's length before this turn's tokens
    reply_start: int  # its length after them: where the reply begins
    n_given: int  # messages given before this turn's (the reply before it not counted)
    previous: Collector | None  # the reply before this turn
    prefill: str = ""  # the assistant text this turn's reply continues (continue_final_message)


class ChatTurns:
    def __init__(self) -> None:
        self.given: list[dict[str, Any]] | None = None  # messages so far; None before the first turn
        self.reply: Collector | None = None  # the latest turn's reply, as it streams
        self.turns: list[_Turn] = []
        self.broken = False  # rewound into the middle of a turn's prompt

    @property
    def messages(self) -> list[dict[str, Any]]:
        out = self._with_reply()
        if self.reply is None and not (self.turns and self.turns[-1].prefill):
            out.pop()
        return out

    def _with_reply(self) -> list[dict[str, Any]]:
        """The messages so far and the latest turn's reply (empty while none was generated)."""
        out = [dict(m) for m in self.given or ()]
        prefill = self.turns[-1].prefill if self.turns else ""
        out.append({"role": "assistant", "content": prefill + (self.reply.text if self.reply is not None else "")})
        return out

    def render(self, core: EngineClient, messages: Messages, *, first: bool,
               **options: Any) -> tuple[list[int], Rendered, dict[int, Any]]:
        """The tokens of a new turn holding ``messages`` (``options``: those of
        :meth:`aiollama.formats.chat.ChatTemplate.render`), the rendering (its messages, and what
        the reply is parsed and constrained by), and the pictures' rows by image number."""
        if self.broken:
            raise ChatTemplateError("the conversation was rewound into the middle of a chat turn; rewind "
                                    "to where a turn or a reply begins, or start a new conversation")
        messages, images = pictures(messages)
        new = normalize(messages)
        template = core.chat_template
        if self.given is None:
            rendered = template.render(new, **options)
            start = 0
        else:
            previous = self._with_reply()[:-1] + [{"role": "assistant", "content": REPLY}]
            rendered = template.render(previous + new, describe_tools=False, **options)
            at = rendered.text.rfind(REPLY)
            if at < 0:
                raise ChatTemplateError("the chat template drops the previous assistant reply, so a turn "
                                        "cannot be appended; start a new conversation with all messages")
            start = at + len(REPLY)
            if self.reply is not None and self.reply.finish_reason is FinishReason.EOG:
                # the reply's end-of-generation token is already in the conversation
                start += next((len(t) for t in template.eog_texts if rendered.text.startswith(t, start)), 0)
        parts = rendered.parts(start)
        if sum(p.text.count(IMAGE) for p in parts) != len(images):
            raise ChatTemplateError("the chat template dropped or repeated a message's picture")
        encoded = [core.images.tokens(image) for image in images]
        tokens = core.chat_tokens(parts, first=first, images=[t for t, _ in encoded])
        if not tokens:
            raise ChatTemplateError("the chat template rendered nothing for these messages")
        return tokens, rendered, {n: r for _, rows in encoded for n, r in rows.items()}

    def appended(self, start: int, n_tokens: int, rendered: Rendered) -> None:
        """A turn of ``n_tokens`` was appended at history length ``start``."""
        n_given = len(self.given or ())
        history = self._with_reply() if self.given is not None else []
        new = rendered.messages[len(history):]
        prefill = ""
        if rendered.continuation:
            content = new.pop()["content"]
            prefill = content if isinstance(content, str) else "".join(p["text"] for p in content or ())
        self.turns.append(_Turn(start, start + n_tokens, n_given, self.reply, prefill))
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
                "turns": [[t.start, t.reply_start, t.n_given, _reply_state(t.previous), t.prefill] for t in self.turns]}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> ChatTurns:
        """The chat of a saved conversation (see :meth:`state`); KeyError/TypeError/ValueError if
        the state is malformed."""
        chat = cls()
        if state is not None:
            chat.given, chat.broken = [dict(m) for m in state["given"]], bool(state["broken"])
            chat.reply = _reply_of(state["reply"])
            chat.turns = [_Turn(int(a), int(b), int(n), _reply_of(r), str(p[0]) if p else "")
                          for a, b, n, r, *p in state["turns"]]
        return chat


def _reply_state(reply: Collector | None) -> dict[str, Any] | None:
    if reply is None:
        return None
    return {"text": reply.text, "tokens": reply.tokens, "finish_reason": str(reply.finish_reason or "length")}


def _reply_of(state: dict[str, Any] | None) -> Collector | None:
    if state is None:
        return None
    return Collector([str(state["text"])], [int(t) for t in state["tokens"]], FinishReason(state["finish_reason"]))


TOOL_CONSTRAINT = ("tool_choice 'required' or a named function constrains the output; give no other constraint "
                   "(response_format, grammar, json_schema, regex, lark) with it")


def check_turn(params: dict[str, Any], tool_choice: Any) -> None:
    """Refuse a chat turn's stream parameters before the turn is appended: a bad one must not
    leave half a turn behind."""
    SamplingParams.from_kwargs(**{k: v for k, v in params.items() if k not in STREAM_ONLY})
    if tool_choice not in (None, "auto", "none") and any(params.get(k) is not None for k in CONSTRAINTS):
        raise InvalidRequestError(TOOL_CONSTRAINT, param="tool_choice")


def reader_for(core: EngineClient, turn: Rendered) -> ReplyReader:
    """The reader of a chat turn's reply, in its model's format."""
    return ReplyReader(core.chat_template.parser(turn), described=turn.described if turn.parse_tool_calls else ())


def reply_params(turn: Rendered, params: dict[str, Any]) -> dict[str, Any]:
    """A chat turn's stream parameters: its model's marker tokens shown in the text, the format's
    own stop strings and thinking markers, and the constraint a required or named tool call asks
    for (llama.cpp's grammar, which begins with the generation prompt; a JSON schema where the
    tools were described)."""
    out = dict(params)
    formats = turn.params
    out["preserved_tokens"] = tuple(formats.get("preserved_tokens") or ())
    if formats.get("thinking_start_tag") and formats.get("thinking_end_tags"):
        out["thinking_tags"] = (formats["thinking_start_tag"], formats["thinking_end_tags"][0])
    extra = formats.get("additional_stops") or []
    if extra:
        given = out.get("stop") or ()
        out["stop"] = (*([given] if isinstance(given, str) else given), *extra)
    schema = call_schema(turn.described, turn.tool_choice) if turn.described else None
    if turn.grammar is not None or schema is not None:
        if any(out.get(k) is not None for k in CONSTRAINTS):
            raise InvalidRequestError(TOOL_CONSTRAINT, param="tool_choice")
        if schema is not None:
            out["json_schema"] = schema
        else:
            out["grammar"], out["grammar_prefill"] = turn.grammar, formats.get("generation_prompt", "")
    return out


CONSTRAINTS = ("grammar", "json_schema", "regex", "lark")
STREAM_ONLY = ("guidance", "guidance_scale", "lora")  # stream() parameters that are not sampling parameters
