"""Chat templates: the model's own Jinja template in a sandbox, llama.cpp's built-ins as a fallback.

Caller text never becomes control tokens. A template is rendered with a placeholder in place of
each message's content, so the special tokens the template itself wrote can be told apart from
text that merely looks like one. The rendered text is then split only at the template's special
tokens, and everything between them (template text and contents together) is tokenized in one
piece as plain text: the tokens are exactly those of tokenizing the whole rendered prompt with
special tokens parsed, as llama-server does, whenever the contents hold no special-token text.
Roles may not contain special-token text at all.

Multi-turn chat appends: each turn renders the messages so far plus the new ones, and only the text
after the previous assistant reply (the end of that reply's turn, the new messages and the
generation prompt) is appended, so earlier turns are never evaluated again.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from aiollama.errors import ChatTemplateError
from aiollama.formats.tokens import SpecialToken, Tokenizer

_CONTENT = "\ue000{}\ue001"  # private-use characters: no tokenizer or template gives them meaning
_CONTENT_RE = re.compile("\ue000([0-9]+)\ue001")
REPLY = "\ue002"  # stands for the previous assistant reply, which is already in the conversation
IMAGE = "\ue003"  # stands for a picture in a message's content (its tokens come from the projector)

Messages = str | Mapping[str, Any] | Sequence[Mapping[str, Any]]

_ASCII_SPACE = " \t\n\v\f\r"  # what C's isspace() strips
log = logging.getLogger("aiollama.formats.chat")


def normalize(messages: Messages) -> list[dict[str, Any]]:
    """``messages`` as a list of {"role", "content"} dicts: a str is one user message. An assistant
    message may have ``tool_calls`` (and no content), a tool message ``tool_call_id`` and ``name``;
    arguments given as JSON text are passed to templates as objects, as they expect."""
    if isinstance(messages, str):
        messages = {"role": "user", "content": messages}
    if isinstance(messages, Mapping):
        messages = [messages]
    if not isinstance(messages, Sequence) or isinstance(messages, (bytes, bytearray)):
        raise ChatTemplateError(f"messages must be a str, a message or a list of messages, got "
                                f"{type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {i} must be a mapping with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        calls = message.get("tool_calls")
        if content is None and calls:
            content = ""
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise ChatTemplateError(f"message {i} needs a non-empty str 'role' and a str 'content'")
        if "\ue000" in content or "\ue001" in content or REPLY in content or REPLY in role:
            raise ChatTemplateError(f"message {i} holds characters U+E000..U+E002, which aiollama reserves")
        item: dict[str, Any] = {"role": role, "content": content}
        if calls:
            item["tool_calls"] = _tool_calls(i, calls)
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                item[key] = message[key]
        out.append(item)
    return out


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise ChatTemplateError(f"message {i}: tool_calls must be a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"message {i}: each tool call needs a function with a name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise ChatTemplateError(f"message {i}: tool call arguments are not JSON: {arguments!r}") from None
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def template_text(message: Mapping[str, Any]) -> list[str]:
    """The text of a message that templates write as is, not as caller content: the role and the
    tool calls (names and arguments). It must not hold special-token text."""
    parts = [message["role"]]
    for call in message.get("tool_calls", ()):
        parts += [call["function"]["name"], json.dumps(call["function"]["arguments"], ensure_ascii=False)]
    return parts


@dataclass(frozen=True)
class Segment:
    text: str
    template: bool  # True: the template's own text (special tokens parsed); False: caller content


def protect(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages with each content replaced by a placeholder (an empty one stays empty, for templates
    that test it), and the contents in order."""
    return ([{**m, "content": _CONTENT.format(i) if m["content"] else ""} for i, m in enumerate(messages)],
            [m["content"] for m in messages])


def segments(rendered: str, contents: list[str]) -> list[Segment]:
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


def chat_tokens(tokenizer: Tokenizer, parts: Sequence[Segment], *, first: bool,
                images: Sequence[list[int]] = ()) -> list[int]:
    """Token ids of rendered chat text: split at the special tokens of the template's own text only,
    and the text between them (template text and caller content alike) tokenized in one piece
    without parsing special tokens. ``first``: the conversation is new, so BOS comes first when the
    model asks for it (once, also when the template wrote it). ``images``: the tokens of the
    pictures that :data:`IMAGE` marks in the contents, in order."""
    template_text = "".join(p.text for p in parts if p.template)
    specials = [t for t in tokenizer.special_tokens() if t.control and t.text in template_text]
    fragments: list[str | SpecialToken] = []
    image_mark = SpecialToken(-1, IMAGE, control=False)
    for part in parts:
        for piece in _split(part.text, specials) if part.template else _split(part.text, [image_mark]):
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
        if frag is image_mark:
            tokens += next(pictures, [])
        elif isinstance(frag, SpecialToken):
            tokens.append(frag.id)
        elif frag:
            tokens += tokenizer.tokenize(frag, add_special=False, special=False)
    if first and tokenizer.add_bos and tokenizer.bos >= 0 and tokens[:1] != [tokenizer.bos]:
        tokens.insert(0, tokenizer.bos)
    return tokens


class ChatTemplate:
    """Renders messages to text with the model's template.

    ``source`` is the Jinja template from the GGUF metadata (``tokenizer.chat_template``); it is
    rendered in Jinja2's immutable sandbox with the variables Hugging Face passes. When there is
    none, or it does not compile, or rendering fails for a reason other than the template refusing
    the messages, ``builtin`` (llama.cpp's pattern-matched templates) renders instead.
    """

    def __init__(self, source: str | None, *, bos_token: str, eos_token: str,
                 builtin: Callable[[list[dict[str, str]], bool], str], eog_texts: Sequence[str] = ()) -> None:
        self.source = source
        self.eog_texts = [t for t in eog_texts if t]  # texts of the tokens that end a reply
        self._vars = {"bos_token": bos_token, "eos_token": eos_token}
        self._builtin = builtin
        self._jinja: Any = None
        self.kind = "builtin"
        if source:
            try:
                self._jinja = _compile(source)
                self.kind = "jinja"
            except Exception as exc:  # noqa: BLE001 - a template Jinja2 cannot compile: use the fallback
                log.warning("the model's chat template does not compile (%r); using llama.cpp's built-in "
                            "template", exc)
                self._jinja = None

    @property
    def supports_tools(self) -> bool:
        """Whether the template has a place for tools (else they are described in a system message)."""
        return self._jinja is not None and self.source is not None and "tools" in self.source

    def reads(self, name: str) -> bool:
        """Whether the model's own template reads the variable ``name``."""
        return self._jinja is not None and self.source is not None and \
            re.search(rf"\b{re.escape(name)}\b", self.source) is not None

    def check_kwargs(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """``chat_template_kwargs`` as the template gets them: each must be a variable the model's
        own template reads (``enable_thinking``, ``reasoning_effort``, ...), else ChatTemplateError,
        so a control the template cannot honour is never silently dropped."""
        if not kwargs:
            return {}
        if not isinstance(kwargs, Mapping):
            raise ChatTemplateError("chat_template_kwargs must be a mapping of names to values")
        for name in kwargs:
            if not isinstance(name, str) or name in _RESERVED:
                raise ChatTemplateError(f"chat_template_kwargs cannot set {name!r}")
            if not self.reads(name):
                raise ChatTemplateError(f"the model's chat template does not read {name!r}, so it cannot be set")
        return dict(kwargs)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None, kwargs: Mapping[str, Any] | None = None) -> str:
        extra = self.check_kwargs(kwargs)
        if self._jinja is not None:
            try:
                if tools is not None:
                    extra["tools"] = tools
                return str(self._jinja.render(**extra, messages=messages, add_generation_prompt=add_generation_prompt,
                                              **self._vars))
            except _Refused as exc:
                raise ChatTemplateError(f"the chat template refuses these messages: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - a template bug, not the caller's: fall back
                log.warning("the model's chat template failed (%r); using llama.cpp's built-in template", exc)
        return self._builtin([{"role": m["role"], "content": m["content"]} for m in messages], add_generation_prompt)


_RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})


class _Refused(Exception):
    """The template called raise_exception()."""


def _raise(message: str) -> None:
    raise _Refused(message)


def _compile(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda value, indent=None, ensure_ascii=False: json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii)
    return env.from_string(source)
