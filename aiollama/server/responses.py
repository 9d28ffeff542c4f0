"""OpenAI's Responses API over live conversations.

A stored response keeps the :class:`~aiollama.Conversation` it ended in. A request with
``previous_response_id`` forks that conversation (its cells shared or copied, never evaluated
again) and appends only the new input, so a long exchange costs each turn its own tokens. The
store is bounded by a count, a time to live and a byte budget; the conversations it keeps are idle
ones, whose cells the engine takes back (or parks in host memory) when running streams need them.
An id that is gone answers 404, never a wrong continuation.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from aiollama import Chunk, Conversation, FinishReason, SamplingParams, Stream
from aiollama.errors import AiollamaError
from aiollama.formats.reply import ReplyDelta
from aiollama.server.background import Run
from aiollama.server.bad_request import BadRequest
from aiollama.server.neutral_request import message_text
from aiollama.server.opening import event_stream, open_route, while_connected
from aiollama.server.responses_request import ResponsesRequest, responses_request
from aiollama.server.state import (
    CHAT_DEFAULTS,
    State,
    check_prompt_size,
    serving_engine,
    translate,
)
from aiollama.server.store import Sizing


def response_id(replica: str = "") -> str:
    """A new response id; among replicas it names the one that holds the conversation
    (``resp_<replica>_<hex>``), which the router reads (``replica_of``)."""
    return f"resp_{replica}_{uuid.uuid4().hex}" if replica else f"resp_{uuid.uuid4().hex}"


def replica_of(response_id: Any) -> str | None:
    """The replica a response id names, if any."""
    match = REPLICA_ID.fullmatch(response_id) if isinstance(response_id, str) else None
    return match.group(1) if match else None


REPLICA_ID = re.compile(r"resp_([A-Za-z0-9]+)_[0-9a-f]{32}")


def _not_found(response_id: str, param: str | None = None) -> BadRequest:
    return BadRequest(f"no stored response '{response_id}' (never stored, deleted, expired, or its replica is "
                      "gone)", status=404, param=param, code="not_found")


async def create(state: State, request: HttpRequest) -> Response:
    req = responses_request(await state.guard.read_json(request))
    if req.previous_response_id is not None:  # in memory, or brought back from the database
        await state.responses.restore(req.previous_response_id, serving_engine(state))
    turn, release = await open_route(state, request, req.messages, lambda: _start(state, req))
    if req.background:
        return _detach(state, turn, release)
    if req.stream:
        return event_stream(_events(state, turn, release))

    async def read() -> None:
        async for chunk in turn.stream:
            turn.feed(chunk)

    try:
        if not await while_connected(request, read):  # a client that goes away cancels its generation
            return Response(status_code=499)  # nobody reads it; nothing is stored
        return JSONResponse(turn.finish())
    except AiollamaError as exc:
        raise translate(exc) from None
    finally:
        release()
        await turn.settle(state)


def _detach(state: State, turn: Turn, release: Callable[[], None]) -> Response:
    """A background response: its events driven by the app, not by this connection; the caller
    follows them (``stream``) or gets the response as it stands."""
    if state.task_group is None:
        release()
        turn.conv.close_nowait()
        raise BadRequest("background responses need the app running (its lifespan)", status=503, code="unavailable")
    run = Run(turn.id, turn.shell("in_progress", []))
    state.runs.start(state.task_group, run, _events(state, turn, release))
    if turn.req.stream:
        return event_stream(state.runs.follow(run, -1))  # a client that goes away leaves the run going
    return JSONResponse(run.response)


async def retrieve(state: State, request: HttpRequest) -> Response:
    """A response as it stands (a background one while it runs); with ``stream=true`` a background
    response's events after ``starting_after``, then the live ones."""
    response_id = request.path_params["response_id"]
    run = state.runs.get(response_id)
    if request.query_params.get("stream") == "true":
        if run is None:
            raise BadRequest("only a background response's events are kept to stream again", param="stream")
        after = request.query_params.get("starting_after", "-1")
        if not after.lstrip("-").isdigit():
            raise BadRequest("'starting_after' must be an event's sequence number", param="starting_after")
        return event_stream(state.runs.follow(run, int(after)))
    stored = await state.responses.response(response_id)
    if stored is not None:
        return JSONResponse(stored)
    if run is not None:
        return JSONResponse(run.response)
    raise _not_found(response_id)


async def cancel(state: State, request: HttpRequest) -> Response:
    """Stop a background response; the response as it then stands (``cancelled``, or how it had
    ended already)."""
    response_id = request.path_params["response_id"]
    run = state.runs.cancel(response_id)
    if run is None:
        if state.responses.get(response_id) is not None:
            raise BadRequest("only a background response can be cancelled", param="response_id")
        raise _not_found(response_id)
    while True:
        changed = run.changed
        if run.done:
            break
        await changed.wait()
    stored = state.responses.get(response_id)
    return JSONResponse(stored.response if stored is not None and run.response["status"] != "cancelled"
                        else run.response)


async def delete(state: State, request: HttpRequest) -> Response:
    response_id = request.path_params["response_id"]
    if not await state.responses.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


class Turn:
    """One response being made: its conversation and stream, and how its output is shaped."""

    def __init__(self, state: State, req: ResponsesRequest, conv: Conversation, stream: Stream,
                 input_tokens: int) -> None:
        self.req, self.conv, self.stream = req, conv, stream
        self.id, self.message_id = response_id(state.replica), "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = state.name()
        self.input_tokens = input_tokens
        assert stream.reader is not None
        self.reader = stream.reader  # the reply read in the model's format: neutral deltas, then a Message
        self.response: dict[str, Any] | None = None
        self.generated = 0
        self.reasoning_tokens = 0  # tokens of chunks that thought

    def feed(self, chunk: Chunk) -> list[ReplyDelta]:
        self.generated += len(chunk.tokens)
        deltas = self.reader.feed(chunk.text)
        if any(d.reasoning for d in deltas):
            self.reasoning_tokens += len(chunk.tokens)
        return deltas

    def shell(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": None,
                "incomplete_details": incomplete, **self.req.echo_fields}

    def output(self) -> list[dict[str, Any]]:
        self.reader.finish()
        message = self.reader.message
        items: list[dict[str, Any]] = []
        if message.reasoning:
            items.append({"id": "rs_" + self.id[5:], "type": "reasoning", "summary": [],
                          "content": [{"type": "reasoning_text", "text": message.reasoning}]})
        if message.content:
            items.append(self.message_item(message.content, "completed"))
        for call in message.tool_calls:
            items.append({"id": "fc_" + call.id[5:], "type": "function_call", "status": "completed",
                          "call_id": call.id, "name": call.name, "arguments": call.arguments})
        return items

    def message_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def finish(self) -> dict[str, Any]:
        stats = self.stream.stats
        generated = self.generated
        cached = min(stats.cached_tokens, self.input_tokens) if stats is not None else 0
        usage = {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                 "total_tokens": self.input_tokens + generated}
        status = "incomplete" if self.stream.finish_reason is FinishReason.LENGTH else "completed"
        self.response = self.shell(status, self.output(), usage)
        return self.response

    async def settle(self, state: State) -> None:
        """Keep the conversation with its response when asked to store it; else free it."""
        if self.response is not None and self.req.store:
            await state.responses.keep(self.response, self.conv)
        else:
            await self.conv.aclose()


def _start(state: State, req: ResponsesRequest) -> Turn:
    engine = serving_engine(state)
    if state.responses.sizing == Sizing():  # an engine the app was given may have started after it
        state.responses.sizing = Sizing.of(engine.model_info)
    messages = req.messages
    check_prompt_size(state, engine, [message_text(m) for m in messages], engine.n_ctx)
    if req.previous_response_id is not None:
        stored = state.responses.get(req.previous_response_id)
        if stored is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        conv = stored.conv.fork()  # the stored one stays, for other continuations
    else:
        conv = engine.conversation()
    try:
        options = req.chat_options(engine)
        params = state.params(req.params, CHAT_DEFAULTS)
        req.echo_fields.update(temperature=params.get("temperature", SamplingParams.temperature),
                        top_p=params.get("top_p", SamplingParams.top_p))  # in force, the server's defaults in
        stream = conv.chat(messages, **state.chat(options), **params)
    except BaseException as exc:
        conv.close_nowait()
        if isinstance(exc, AiollamaError):
            raise translate(exc) from None
        raise
    return Turn(state, req, conv, stream, len(conv))


async def _events(state: State, turn: Turn, release: Callable[[], None]) -> AsyncIterator[str]:
    """The Responses streaming events, in the official order: reasoning text and output text as
    they come, function calls once the reply is known to be one (text that may start a call is
    held back, so a call never leaks into the output text)."""
    number = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal number
        number += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number - 1, **fields})}\n\n"

    opened: dict[str, int] = {}  # "reasoning" / "message" -> output index, in the order they opened
    reasoning_id = "rs_" + turn.id[5:]

    def close_reasoning(text: str) -> list[str]:
        at = {"item_id": reasoning_id, "output_index": opened["reasoning"], "content_index": 0}
        item = {"id": reasoning_id, "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}
        return [event("response.reasoning_text.done", **at, text=text),
                event("response.output_item.done", output_index=opened["reasoning"], item=item)]

    thought = streamed = ""
    try:
        yield event("response.created", response=turn.shell("in_progress", []))
        yield event("response.in_progress", response=turn.shell("in_progress", []))
        try:
            async for chunk in turn.stream:
                for delta in turn.feed(chunk):
                    if piece := delta.reasoning:
                        if "reasoning" not in opened:
                            opened["reasoning"] = len(opened)
                            yield event("response.output_item.added", output_index=opened["reasoning"], item={
                                "id": reasoning_id, "type": "reasoning", "summary": [], "content": []})
                        thought += piece
                        yield event("response.reasoning_text.delta", item_id=reasoning_id,
                                    output_index=opened["reasoning"], content_index=0, delta=piece)
                    if piece := delta.content:
                        if "message" not in opened:
                            for line in close_reasoning(thought) if "reasoning" in opened else []:
                                yield line
                            opened["message"] = len(opened)
                            yield event("response.output_item.added", output_index=opened["message"],
                                        item=turn.message_item(None, "in_progress"))
                            yield event("response.content_part.added", item_id=turn.message_id,
                                        output_index=opened["message"], content_index=0,
                                        part={"type": "output_text", "text": "", "annotations": []})
                        streamed += piece
                        yield event("response.output_text.delta", item_id=turn.message_id,
                                    output_index=opened["message"], content_index=0, delta=piece, logprobs=[])
        except AiollamaError as exc:
            error = translate(exc)
            yield event("error", code=error.code, message=error.message, param=error.param)
            return
        response = turn.finish()
        output = response["output"]
        if "reasoning" in opened and "message" not in opened:
            for line in close_reasoning(next(i for i in output if i["type"] == "reasoning")["content"][0]["text"]):
                yield line
        rest = [item for item in output if item["type"] not in opened]
        if "message" in opened:
            done = next((i for i in output if i["type"] == "message"), None)
            if done is None:  # what streamed as text turned out to hold only calls: it stays text
                done = turn.message_item(streamed, "completed")
                output.insert(opened["message"], done)
            at = {"item_id": turn.message_id, "output_index": opened["message"], "content_index": 0}
            yield event("response.output_text.done", **at, text=done["content"][0]["text"], logprobs=[])
            yield event("response.content_part.done", **at, part=done["content"][0])
            yield event("response.output_item.done", output_index=opened["message"], item=done)
        for index, item in enumerate(rest, start=len(opened)):
            added = {**item, "status": "in_progress", **({"arguments": ""} if item["type"] == "function_call" else {})}
            yield event("response.output_item.added", output_index=index, item=added)
            if item["type"] == "function_call":
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item=item)
        response["output"] = [i for i in output if i["type"] in opened] + rest  # the order they were sent in
        yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                    response=response)
    finally:
        release()
        await turn.settle(state)
