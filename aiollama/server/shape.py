"""OpenAI's shapes of generated output: messages and streamed deltas with reasoning, tool calls and
log-probabilities, for chat and for the legacy completions API."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from aiollama import Chunk, FinishReason
from aiollama.formats import reasoning
from aiollama.formats.text import partial_tail
from aiollama.formats.toolcalls import ToolCall, held_from, might_be_call, parse

FINISH = {FinishReason.EOG: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
          FinishReason.CANCELLED: "stop"}

TokenBytes = Callable[[int], bytes]


def chat_logprobs(chunk_logprobs: list[Any], token_bytes: TokenBytes) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries for some tokens."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
            for lp in chunk_logprobs]


def completion_logprobs(chunk_logprobs: list[Any], token_bytes: TokenBytes, offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for some tokens, their text starting at ``offset``;
    an entry of None (an echoed prompt's first token, which nothing scores) has its token's text
    and null log-probabilities."""
    tokens, offsets = [], []
    for lp in chunk_logprobs:
        text = token_bytes(lp.token if not isinstance(lp, int) else lp).decode("utf-8", "replace")
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [None if isinstance(lp, int) else lp.logprob for lp in chunk_logprobs],
            "top_logprobs": [None if isinstance(lp, int) else {token_bytes(t).decode("utf-8", "replace"): p
                                                               for t, p in lp.top}
                             for lp in chunk_logprobs],
            "text_offset": offsets}


def prompt_logprobs(scored: list[Any], token_bytes: TokenBytes, k: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each one a map of token
    ids (as strings) to ``logprob``, ``rank`` and ``decoded_token``: the token itself and the ``k``
    most likely alternatives."""
    def entry(token: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_bytes(token).decode("utf-8", "replace")}

    out: list[dict[str, Any] | None] = [None]
    for lp in scored:
        row = {str(t): entry(t, p, i + 1) for i, (t, p) in enumerate(lp.top[:k])}
        row[str(lp.token)] = entry(lp.token, lp.logprob, lp.rank)
        out.append(row)
    return out


class ChatChoice:
    """One chat choice as it streams: text between thinking markers goes to ``reasoning_content``;
    when tools are offered, text that may be a tool call is held back until the end, where it
    becomes ``tool_calls`` (finish reason "tool_calls") or content after all."""

    def __init__(self, index: int, tool_names: Collection[str], token_bytes: TokenBytes, *, in_thinking: bool = False) -> None:
        self.index = index
        self.tool_names = tool_names
        self.in_thinking = in_thinking  # the prompt opened a thinking block
        self.token_bytes = token_bytes
        self.raw = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.logprobs: list[dict[str, Any]] = []
        self.reasoning_tokens = 0  # tokens of chunks that thought (or closed the thinking)
        self._thought = 0

    def _parts(self) -> tuple[str, str, bool]:
        """(reasoning, content, reasoning still open or too early to tell) of the text so far."""
        return reasoning.parts(self.raw, inside=self.in_thinking)

    def feed(self, chunk: Chunk) -> list[dict[str, Any]]:
        """The deltas to send now for a chunk."""
        self.raw += chunk.text
        out: list[dict[str, Any]] = []
        thought, content, open_ = self._parts()
        if (open_ and thought) or len(thought) > self._thought:
            self.reasoning_tokens += len(chunk.tokens)
        self._thought = len(thought)
        if open_:  # hold back what could be the start of the closing marker
            thought = thought[:len(thought) - partial_tail(thought, (reasoning.END,))]
        if len(thought) > self.sent_reasoning:
            out.append({"reasoning_content": thought[self.sent_reasoning:]})
            self.sent_reasoning = len(thought)
        if not open_ and self.tool_names:  # text before a call streams; the call waits for the end
            content = "" if might_be_call(content) else content[:held_from(content)]
        if not open_ and len(content) > self.sent_content:
            out.append({"content": content[self.sent_content:]})
            self.sent_content = len(content)
        deltas = [self.delta(part) for part in out]
        if chunk.logprobs:
            entries = chat_logprobs(chunk.logprobs, self.token_bytes)
            self.logprobs += entries
            if not deltas:
                deltas.append(self.delta({}))
            deltas[-1]["logprobs"] = {"content": entries}
        return deltas

    def finish(self, reason: FinishReason | None) -> list[dict[str, Any]]:
        """The last deltas: what was held back, tool calls, and the finish reason."""
        thought, content, _ = self._parts()
        calls = self.calls(content)
        out = []
        if len(thought) > self.sent_reasoning:
            out.append(self.delta({"reasoning_content": thought[self.sent_reasoning:]}))
        if calls:
            before = parse(content, self.tool_names)[0]
            if len(before) > self.sent_content:
                out.append(self.delta({"content": before[self.sent_content:]}))
            out.append(self.delta({"tool_calls": [c.openai(i) for i, c in enumerate(calls)]}))
        elif len(content) > self.sent_content:
            out.append(self.delta({"content": content[self.sent_content:]}))
        out.append(self.delta({}, "tool_calls" if calls else FINISH.get(reason or FinishReason.EOG, "stop")))
        return out

    def calls(self, content: str) -> list[ToolCall]:
        return parse(content, self.tool_names)[1] if self.tool_names else []

    def message(self, reason: FinishReason | None) -> dict[str, Any]:
        """The whole choice, for a response that does not stream."""
        thought, content, _ = self._parts()
        calls = self.calls(content)
        message: dict[str, Any] = {"role": "assistant", "content": None if calls else content}
        if calls:
            message["content"] = parse(content, self.tool_names)[0] or None
            message["tool_calls"] = [c.openai() for c in calls]
        if thought:
            message["reasoning_content"] = thought
        return {"index": self.index, "message": message,
                "logprobs": {"content": self.logprobs} if self.logprobs else None,
                "finish_reason": "tool_calls" if calls else FINISH.get(reason or FinishReason.EOG, "stop")}

    def delta(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": finish}


class TextChoice:
    """One legacy completion choice: text, and log-probabilities in the legacy shape. With ``echo``
    (the prompt's text and tokens) the prompt comes first, and with log-probabilities asked
    (``scored``: the stream's scored prompt tokens, complete once its first chunk is read) its
    tokens have theirs, the first one's null."""

    def __init__(self, index: int, token_bytes: TokenBytes, *, echo: tuple[str, list[int]] | None = None,
                 scored: Callable[[], list[Any]] | None = None) -> None:
        self.index = index
        self.token_bytes = token_bytes
        self.text = ""
        self.logprobs: list[Any] = []
        self.echo = echo
        self.scored = scored

    def _echoed(self, chunk: Chunk) -> Chunk:
        """``chunk`` with the prompt before it, the first time."""
        if self.echo is None:
            return chunk
        text, tokens = self.echo
        self.echo = None
        logprobs: list[Any] = list(chunk.logprobs)
        if self.scored is not None:
            logprobs = [tokens[0], *self.scored(), *chunk.logprobs]
        return Chunk(text + chunk.text, tokens + chunk.tokens, chunk.finish_reason, chunk.stats, logprobs)

    def feed(self, chunk: Chunk) -> list[dict[str, Any]]:
        chunk = self._echoed(chunk)
        offset = len(self.text)
        self.text += chunk.text
        self.logprobs += chunk.logprobs
        if not chunk.text and not chunk.logprobs:
            return []
        lp = completion_logprobs(chunk.logprobs, self.token_bytes, offset) if chunk.logprobs else None
        return [{"index": self.index, "text": chunk.text, "logprobs": lp, "finish_reason": None}]

    def finish(self, reason: FinishReason | None) -> list[dict[str, Any]]:
        out = self.feed(Chunk("", [])) if self.echo is not None else []  # nothing was generated
        return out + [{"index": self.index, "text": "", "logprobs": None,
                       "finish_reason": FINISH.get(reason or FinishReason.EOG, "stop")}]

    def message(self, reason: FinishReason | None) -> dict[str, Any]:
        if self.echo is not None:
            self.feed(Chunk("", []))
        lp = completion_logprobs(self.logprobs, self.token_bytes, 0) if self.logprobs else None
        return {"index": self.index, "text": self.text, "logprobs": lp,
                "finish_reason": FINISH.get(reason or FinishReason.EOG, "stop")}
