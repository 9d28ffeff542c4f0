"""Chat templates: the model's own template, rendered by llama.cpp, and caller text that never
becomes control tokens.

Rendering is llama.cpp's (:class:`ChatLayer`, implemented by :mod:`aiollama.native.chat`): its
Jinja engine reads every vendor template, and its chat layer handles each one as llama-server does
(a system message folded into the first turn where a template has no system role, tool-call
arguments as objects, the thinking switch on where a template has one, today's date, preserved
reasoning). It also derives what the reply needs: the parser of the model's format, the grammar
that constrains a tool call, the generation prompt. So a prompt is llama-server's for the same
request, with the defaults of llama-server's ``--jinja``.

Caller text never becomes control tokens. llama-server tokenizes the whole rendered prompt with
special tokens parsed, so a message holding ``<|im_end|>`` text would end its turn. Where no caller
text holds special-token text, aiollama evaluates exactly that prompt. Where some does, the request
is rendered again with a placeholder in place of each message's content, so that the special
tokens the template itself wrote can be told apart from text that merely looks like one; the text
is then split only at the template's special tokens, and everything between them (template text and
contents together) is tokenized in one piece as plain text. Roles, tool calls and tool definitions
may not hold special-token text at all.

Multi-turn chat appends: each turn renders the messages so far plus the new ones, and only the text
after the previous assistant reply (the end of that reply's turn, the new messages and the
generation prompt) is appended, so earlier turns are never evaluated again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiollama.config import REASONING_MODES
from aiollama.errors import ChatTemplateError, InvalidRequestError
from aiollama.formats.messages import (
    _CONTENT_RE,
    IMAGE,
    caller_texts,
    protect,
    template_texts,
    tools_as_text,
)
from aiollama.formats.tokens import SpecialToken, Tokenizer
from aiollama.formats.toolcalls import read_tool_choice

_ASCII_SPACE = " \t\n\v\f\r"  # what C's isspace() strips
REASONING_FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")  # llama-server's reasoning_format


class ReplyParser(Protocol):
    """Reads a reply in its model's format (:class:`aiollama.native.chat.ChatParser`)."""

    def parse(self, text: str, *, partial: bool) -> dict[str, Any]:
        """{"content", "reasoning_content", "tool_calls": [{"name", "arguments", "id"}]}; ValueError
        where a whole reply does not match the format."""
        ...


class ChatLayer(Protocol):
    """llama.cpp's chat templates of one model (:class:`aiollama.native.chat.ChatTemplates`)."""

    source: str
    tool_use_source: str
    caps: dict[str, bool]
    supports_thinking: bool

    def apply(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Render a request; ChatTemplateError where the template cannot."""
        ...

    def parser(self, params: Mapping[str, Any]) -> ReplyParser: ...


@dataclass(frozen=True)
class Segment:
    text: str
    template: bool  # True: the template's own text (special tokens parsed); False: caller content


def segments(rendered: str, contents: Sequence[str]) -> list[Segment]:
    """Split rendered text into template text and caller content (at the placeholders)."""
    out: list[Segment] = []
    pos = 0
    for match in _CONTENT_RE.finditer(rendered):
        if match.start() > pos:
            out.append(Segment(rendered[pos:match.start()], True))
        index = int(match.group(1))
        if index >= len(contents):
            raise ChatTemplateError("the chat template produced a placeholder it was not given")
        if contents[index]:
            out.append(Segment(contents[index], False))
        pos = match.end()
    if pos < len(rendered):
        out.append(Segment(rendered[pos:], True))
    return out


def _split(text: str, specials: Sequence[SpecialToken]) -> list[str | SpecialToken]:
    """``text`` cut at every occurrence of the given special tokens, trying them in order (longest
    first), as llama.cpp's tokenizer partitions text before tokenizing the pieces."""
    parts: list[str | SpecialToken] = [text]
    for special in specials:
        out: list[str | SpecialToken] = []
        for part in parts:
            if isinstance(part, str) and special.text in part:
                pieces = part.split(special.text)
                for i, piece in enumerate(pieces):
                    if i:
                        out.append(special)
                    if piece:
                        out.append(piece)
            else:
                out.append(part)
        parts = out
    return parts


_IMAGE_MARK = SpecialToken(-1, IMAGE, control=False)


def chat_tokens(tokenizer: Tokenizer, parts: Sequence[Segment], *, first: bool,
                images: Sequence[list[int]] = ()) -> list[int]:
    """Token ids of rendered chat text: split at the special tokens of the template's own text only,
    and the text between them (template text and caller content alike) tokenized in one piece
    without parsing special tokens. ``first``: the conversation is new, so BOS comes first when the
    model asks for it (once, also when the template wrote it). ``images``: the tokens of the
    pictures that :data:`IMAGE` marks, in order."""
    template_text = "".join(p.text for p in parts if p.template)
    specials = [t for t in tokenizer.special_tokens() if t.control and t.text in template_text]
    fragments: list[str | SpecialToken] = []
    for part in parts:
        pieces = _split(part.text, [*specials, _IMAGE_MARK] if part.template else [_IMAGE_MARK])
        for piece in pieces:
            if isinstance(piece, str) and fragments and isinstance(fragments[-1], str):
                fragments[-1] += piece
            else:
                fragments.append(piece)
    for i, frag in enumerate(fragments):  # llama.cpp drops whitespace beside lstrip/rstrip tokens
        if isinstance(frag, SpecialToken):
            before = fragments[i - 1] if i > 0 else None
            after = fragments[i + 1] if i + 1 < len(fragments) else None
            if frag.lstrip and isinstance(before, str):
                fragments[i - 1] = before.rstrip(_ASCII_SPACE)
            if frag.rstrip and isinstance(after, str):
                fragments[i + 1] = after.lstrip(_ASCII_SPACE)
    tokens: list[int] = []
    pictures = iter(images)
    for frag in fragments:
        if frag is _IMAGE_MARK:
            tokens += next(pictures, [])
        elif isinstance(frag, SpecialToken):
            tokens.append(frag.id)
        elif frag:
            tokens += tokenizer.tokenize(frag, add_special=False, special=False)
    if first and tokenizer.add_bos and tokenizer.bos >= 0 and tokens[:1] != [tokenizer.bos]:
        tokens.insert(0, tokenizer.bos)
    return tokens


@dataclass(frozen=True)
class Rendered:
    """A request rendered: ``prompt`` is llama.cpp's text for it (what llama-server evaluates);
    ``text`` and ``contents`` what aiollama tokenizes (the same text where no caller text holds
    special-token text, else the protected rendering and the contents its placeholders stand
    for); ``params`` what llama.cpp derived for the reply (its format and parser, the grammar of a
    constrained call, the generation prompt, preserved tokens, thinking tags)."""

    prompt: str
    text: str
    contents: list[str]
    params: dict[str, Any] = field(repr=False)
    messages: list[dict[str, Any]] = field(repr=False)  # as rendered (tools described, where they are)
    parse_tool_calls: bool = False
    reasoning_format: str = "auto"
    continuation: bool = False
    described: tuple[dict[str, Any], ...] = ()  # tools described in a system message: calls are JSON
    tool_choice: Any = "auto"

    def parts(self, start: int = 0) -> list[Segment]:
        """The segments of ``text[start:]``."""
        return segments(self.text[start:], self.contents)

    @property
    def grammar(self) -> str | None:
        """The GBNF grammar a required or named tool call is held to (llama.cpp's, which begins with
        the generation prompt), or None."""
        grammar = self.params.get("grammar")
        return grammar if grammar and not self.params.get("grammar_lazy") else None

    def parser_params(self) -> dict[str, Any]:
        p = self.params
        return {"format": p["format"], "parser": p["parser"], "generation_prompt": p["generation_prompt"],
                "reasoning_format": self.reasoning_format, "parse_tool_calls": self.parse_tool_calls,
                "is_continuation": self.continuation}


class ChatTemplate:
    """A model's chat template, rendered by llama.cpp (``layer``).

    ``special_texts`` are the texts of the vocabulary's control tokens (caller text holding one is
    protected); ``eog_texts`` those of the tokens that end a reply. ``reasoning`` is llama-server's
    ``--reasoning``: "auto" thinks where the template has a thinking switch, "on" and "off" set it.
    """

    def __init__(self, layer: ChatLayer, *, special_texts: Sequence[str] = (), eog_texts: Sequence[str] = (),
                 reasoning: str = "auto") -> None:
        if reasoning not in REASONING_MODES:
            raise InvalidRequestError(f"reasoning must be one of {', '.join(REASONING_MODES)}, got {reasoning!r}")
        self.layer = layer
        self.source = layer.source
        self.eog_texts = [t for t in eog_texts if t]
        self.reasoning = reasoning
        texts = sorted({t for t in special_texts if t}, key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, texts))) if texts else None

    @classmethod
    def of(cls, tokenizer: Tokenizer, source: str | None = None, *, reasoning: str = "auto") -> ChatTemplate:
        """The chat template of a model's tokenizer: its own, or the template text ``source``."""
        texts = {t: tokenizer.token_text(t) for t in (tokenizer.eot, tokenizer.eos) if t >= 0}
        return cls(tokenizer.chat_layer(source), special_texts=special_texts(tokenizer),
                   eog_texts=[texts[t] for t in (tokenizer.eot, tokenizer.eos) if t in texts], reasoning=reasoning)

    @property
    def supports_tools(self) -> bool:
        """Whether the template has a place for tools (aiollama describes them otherwise)."""
        return bool(self.layer.caps.get("supports_tools"))

    @property
    def supports_thinking(self) -> bool:
        """Whether the template has a thinking switch (llama.cpp found a reasoning block in it)."""
        return self.layer.supports_thinking

    @property
    def caps(self) -> dict[str, bool]:
        return dict(self.layer.caps)

    def reads(self, name: str) -> bool:
        """Whether the model's own template reads the variable ``name``."""
        return any(re.search(rf"\b{re.escape(name)}\b", src) for src in (self.source, self.layer.tool_use_source) if src)

    def has_special_text(self, text: str) -> bool:
        return self._special is not None and self._special.search(text) is not None

    def check_kwargs(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """``chat_template_kwargs`` as the template gets them: each must be JSON and a variable the
        model's own template reads (``reasoning_effort``...), else ChatTemplateError, so a control
        the template cannot honour is never silently dropped. ``enable_thinking`` is llama.cpp's
        own switch (a bool), taken by every template: one without a thinking block does not think
        either way."""
        if not kwargs:
            return {}
        if not isinstance(kwargs, Mapping):
            raise ChatTemplateError("chat_template_kwargs must be a mapping of names to values")
        for name, value in kwargs.items():
            if not isinstance(name, str) or name in _RESERVED_KWARGS:
                raise ChatTemplateError(f"chat_template_kwargs cannot set {name!r}")
            if name == "enable_thinking":  # llama.cpp's own switch: a model without one thinks not at all
                if not isinstance(value, bool):
                    raise ChatTemplateError("chat_template_kwargs: enable_thinking must be a bool")
            elif not self.reads(name) and not (name == "reasoning_effort" and self.layer.caps.get(
                    "supports_reasoning_effort")):
                raise ChatTemplateError(f"the model's chat template does not read {name!r}, so it cannot be set")
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise ChatTemplateError(f"chat_template_kwargs: {name!r} must be a JSON value") from None
        return dict(kwargs)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = "auto",
               chat_template_kwargs: Mapping[str, Any] | None = None, reasoning_effort: str | None = None,
               continue_final_message: bool = False, reasoning_format: str = "auto",
               parallel_tool_calls: bool | None = None, describe_tools: bool = True) -> Rendered:
        """Render ``messages`` (:func:`aiollama.formats.messages.normalize`'s) with ``tools`` (OpenAI function tools) and
        ``tool_choice`` ("auto", "none", "required", or a named function, whose call llama.cpp's
        grammar then constrains), the template's variables ``chat_template_kwargs`` and
        ``reasoning_effort`` ("none" switches thinking off). ``continue_final_message``: the last message is the
        assistant's, and the reply continues it. A template with no place for tools gets them
        described in a system message (``describe_tools``: this is the conversation's first turn),
        where llama.cpp would leave them out; one that cannot write calls either is told to call
        in JSON, and its earlier calls are written so. Raises
        ChatTemplateError for what the template refuses or cannot render, with llama.cpp's
        reason."""
        if reasoning_format not in REASONING_FORMATS:
            raise InvalidRequestError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}")
        extra: dict[str, Any] = {"preserve_reasoning": True}  # llama-server's default
        enable_thinking = self.supports_thinking if self.reasoning == "auto" else self.reasoning == "on"
        if self.reasoning != "auto":
            extra["enable_thinking"] = enable_thinking
        extra.update(self.check_kwargs(chat_template_kwargs))
        if isinstance(extra.get("enable_thinking"), bool):
            enable_thinking = extra["enable_thinking"]
        if reasoning_effort is not None:
            if reasoning_effort == "none":
                enable_thinking = False
                extra.pop("reasoning_effort", None)
            elif not self.layer.caps.get("supports_reasoning_effort") and not self.reads("reasoning_effort"):
                raise ChatTemplateError("the model's chat template reads no reasoning_effort, so it cannot be set")
            else:
                extra["reasoning_effort"] = reasoning_effort
        names, choice = read_tool_choice(tools, tool_choice)
        described: tuple[dict[str, Any], ...] = ()
        if tools and not self.supports_tools:  # llama.cpp would leave them out: describe them instead
            native = bool(self.layer.caps.get("supports_tool_calls"))  # its calls have a syntax llama.cpp reads
            messages = tools_as_text(messages, tools, first=describe_tools, json_calls=not native)
            if not native:
                described, tools = tuple(map(dict, tools)), None
        for text in template_texts(messages, tools):
            if self.has_special_text(text):
                raise ChatTemplateError(f"{text[:80]!r} holds special-token text (a role, a tool call or a tool)")
        inputs: dict[str, Any] = {
            "messages": messages, "add_generation_prompt": add_generation_prompt and not continue_final_message,
            "continue_final_message": bool(continue_final_message), "reasoning_format": reasoning_format,
            "enable_thinking": enable_thinking, "chat_template_kwargs": extra,
            "tool_choice": "auto" if choice == "named" else choice,
            "parallel_tool_calls": bool(self.layer.caps.get("supports_parallel_tool_calls"))
            if parallel_tool_calls is None else bool(parallel_tool_calls)}
        if tools:
            inputs["tools"] = list(tools)
        result = self.layer.apply(inputs)
        params = result
        if choice == "named" and tools:  # the prompt offers every tool; the grammar and parser take the named one
            named = [t for t in tools or () if t["function"]["name"] == names[0]]
            params = self.layer.apply({**inputs, "tools": named, "tool_choice": "required"})
        text, contents = result["prompt"], []
        if any(self.has_special_text(t) for t in caller_texts(messages)):
            contents = caller_texts(messages)
            text = self.layer.apply({**inputs, "messages": protect(messages)})["prompt"]
        if choice == "required" and tools and not params.get("grammar"):
            raise ChatTemplateError("llama.cpp has no tool-call format for this chat template, so a required "
                                    "tool call cannot be constrained")
        return Rendered(result["prompt"], text, contents, params, messages,
                        parse_tool_calls=bool(tools or described) and choice != "none", reasoning_format=reasoning_format,
                        continuation=bool(continue_final_message), described=described, tool_choice=tool_choice)

    def parser(self, rendered: Rendered) -> ReplyParser:
        return self.layer.parser(rendered.parser_params())


_RESERVED_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})


def special_texts(tokenizer: Tokenizer) -> list[str]:
    """The texts of a vocabulary's control tokens: caller text holding one is protected."""
    return [t.text for t in tokenizer.special_tokens() if t.control]
