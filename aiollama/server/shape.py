"""OpenAI's shapes of generated output: messages and streamed deltas with reasoning, tool calls and
log-probabilities, for chat and for the legacy completions API."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiollama import Chunk, FinishReason
from aiollama.formats.reply import ReplyDelta, ReplyReader

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


def chat_delta(delta: ReplyDelta) -> dict[str, Any]:
    """A reply delta as OpenAI's chat delta: a tool call's id and name first, then its arguments."""
    if delta.reasoning:
        return {"reasoning_content": delta.reasoning}
    if delta.content:
        return {"content": delta.content}
    calls = []
    for call in delta.calls:
        entry: dict[str, Any] = {"index": call.index}
        if call.name:
            entry.update({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}})
        else:
            entry["function"] = {"arguments": call.arguments}
        calls.append(entry)
    return {"tool_calls": calls}


class ChatChoice:
    """One chat choice as it streams, read in its model's format (``reader``, the stream's):
    reasoning goes to ``reasoning_content``, tool calls to ``tool_calls`` (finish reason
    "tool_calls"), the rest to ``content``; no marker text reaches the content."""

    def __init__(self, index: int, reader: ReplyReader, token_bytes: TokenBytes) -> None:
        self.index = index
        self.reader = reader
        self.token_bytes = token_bytes
        self.logprobs: list[dict[str, Any]] = []
        self.reasoning_tokens = 0  # tokens of chunks that thought

    def feed(self, chunk: Chunk) -> list[dict[str, Any]]:
        """The deltas to send now for a chunk."""
        deltas = [self.delta(chat_delta(d)) for d in self.reader.feed(chunk.text)]
        if any("reasoning_content" in d["delta"] for d in deltas):
            self.reasoning_tokens += len(chunk.tokens)
        if chunk.logprobs:
            entries = chat_logprobs(chunk.logprobs, self.token_bytes)
            self.logprobs += entries
            if not deltas:
                deltas.append(self.delta({}))
            deltas[-1]["logprobs"] = {"content": entries}
        return deltas

    def finish(self, reason: FinishReason | None) -> list[dict[str, Any]]:
        """The last deltas: what was held back, and the finish reason."""
        out = [self.delta(chat_delta(d)) for d in self.reader.finish()]
        return out + [self.delta({}, self.finish_reason(reason))]

    def finish_reason(self, reason: FinishReason | None) -> str:
        return "tool_calls" if self.reader.message.tool_calls else FINISH.get(reason or FinishReason.EOG, "stop")

    def message(self, reason: FinishReason | None) -> dict[str, Any]:
        """The whole choice, for a response that does not stream."""
        self.reader.finish()
        reply = self.reader.message
        message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
        if reply.tool_calls:
            message["tool_calls"] = [c.openai() for c in reply.tool_calls]
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        return {"index": self.index, "message": message,
                "logprobs": {"content": self.logprobs} if self.logprobs else None,
                "finish_reason": self.finish_reason(reason)}

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
