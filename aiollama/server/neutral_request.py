"""The one request the three APIs' codecs read into: a chat (or a text prompt) to continue, its
sampling, its tools and the template's switches, in neutral names.

OpenAI chat/completions (``openai_request``, ``chat_request``), Anthropic Messages
(``messages_request``) and the Responses API (``responses_request``) each only translate their
body into a :class:`ChatRequest` (or a subclass adding what only that API answers with). The
sampling fields are checked by :class:`~aiollama.sampling.SamplingParams` alone; :func:`checked`
maps its refusal to the body's own field name, in one place. Beside it stand only each API's own
bounds (OpenAI's temperature is at most 2, Anthropic's 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiollama.errors import InvalidRequestError
from aiollama.sampling import SamplingParams, wrap_seed
from aiollama.server.bad_request import BadRequest

if TYPE_CHECKING:
    from aiollama import Engine

MAX_STOP = 4
MAX_TOOLS = 128
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@dataclass
class ChatRequest:
    """One generation request: the prompt (text, token ids or chat messages), how to sample, and
    what to answer with (log-probabilities, tool calls)."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    obfuscate: bool = False  # stream_options.include_obfuscation: chunks padded to random lengths
    params: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # in the chat shape
    tool_choice: Any = "auto"  # in the chat shape
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # for the chat template
    thinking: bool | None = None  # the template's thinking switch; None: as the template does by default
    reasoning_effort: str | None = None
    effort_param: str = "reasoning_effort"  # the body's field the effort came from, for a 400 naming it
    reasoning_format: str | None = None  # None: the server's
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    cache_salt: str | None = None  # shares cached cells only with requests of the same salt
    echo: bool = False  # legacy completions: the prompt comes back before the completion
    prompt_logprobs: int | None = None  # vLLM's: the prompt's tokens scored, in the response
    lora: list[tuple[str | int, float]] = field(default_factory=list)  # adapters by name or index, scales
    defaults: dict[str, Any] = field(default_factory=dict)  # the API's own, under the server's (--temp, -n)
    suffix: str | None = None  # legacy completions: the text after the completion (fill-in-the-middle)
    llama: Any = None  # llama.cpp's fields (native_request.Native), set by the route

    def chat_options(self, engine: Engine) -> dict[str, Any]:
        """What ``Conversation.append_chat`` takes besides the messages, for ``engine``'s template:
        a switch or an effort it cannot honour is a 400 naming the field, never a control lost.
        Asking for no thinking from a template that has no switch is an error; asking for thinking
        from one that has none is not: such a model simply answers without a thinking block."""
        kwargs = dict(self.template_kwargs)
        if self.thinking is not None:
            template = engine.chat_template
            if template.supports_thinking or template.reads("enable_thinking"):
                kwargs["enable_thinking"] = self.thinking
            elif self.thinking is False:
                raise BadRequest("this model's chat template has no switch for thinking, so thinking cannot be "
                                 "disabled", param="thinking", code="unsupported_parameter")
        options = {"tools": self.tools, "tool_choice": self.tool_choice, "chat_template_kwargs": kwargs,
                   "reasoning_effort": effort_of(engine, self.reasoning_effort, self.effort_param),
                   "parallel_tool_calls": self.parallel_tool_calls,
                   "continue_final_message": self.continue_final_message}
        if self.reasoning_format is not None:
            options["reasoning_format"] = self.reasoning_format
        return options


def effort_of(engine: Engine, effort: str | None, param: str) -> str | None:
    """A reasoning effort the model's template can honour: a 400 naming ``param`` for one it
    cannot (its template reads no effort), never a control silently lost. "none" is always
    honoured: it switches thinking off, or there is none."""
    if effort is None or effort == "none":
        return effort
    template = engine.chat_template
    if not template.caps.get("supports_reasoning_effort") and not template.reads("reasoning_effort"):
        raise BadRequest("this model's chat template reads no reasoning_effort, so it cannot be honoured",
                         param=param, code="unsupported_parameter")
    return effort


def checked(params: dict[str, Any], names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``params`` as :class:`SamplingParams` takes them, checked by it (the one validator of
    sampling); its refusal becomes a 400 naming the body's field (``names`` maps a parameter to
    the field an API calls it: ``stop`` is Anthropic's ``stop_sequences``)."""
    try:
        SamplingParams(**params)
    except InvalidRequestError as exc:
        message, param = str(exc), exc.param
        named = (names or {}).get(param, param) if param else None
        if param and named and named != param and message.startswith(param):
            message = named + message[len(param):]
        raise BadRequest(message, param=named) from None
    return params


def number_field(body: dict[str, Any], name: str, low: float = -math.inf, high: float = math.inf) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number in [{low}, {high}], got {value!r}", param=name)
    return float(value)


def integer_field(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise BadRequest(f"'{name}' must be an integer {bound}, got {value!r}", param=name)
    return value


# the sampling fields that go to SamplingParams as they come, under their neutral names
PLAIN = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "presence_penalty",
         "frequency_penalty", "grammar", "priority", "reasoning_budget", "reasoning_budget_message")


def sampling_fields(body: dict[str, Any], ceilings: Mapping[str, float]) -> dict[str, Any]:
    """The sampling parameters of a body whose fields bear their neutral names (``max_tokens``,
    ``temperature``, ``stop``...), as JSON gives them: stops as a list, ``logit_bias`` keys as
    ids, any integer as a seed, and a JSON schema an object. ``ceilings`` are the API's own upper
    bounds. Their ranges are :func:`checked`'s, once, by the codec that called this."""
    params = {name: body[name] for name in PLAIN if body.get(name) is not None}
    for name, high in ceilings.items():
        number_field(body, name, -math.inf, high)
    schema = body.get("json_schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise BadRequest("'json_schema' must be a JSON object", param="json_schema")
        params["json_schema"] = schema
    seed = integer_field(body, "seed", -(2**63))
    if seed is not None:
        params["seed"] = wrap_seed(seed)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > MAX_STOP:
            raise BadRequest(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them",
                             param="stop")
        if stops:
            params["stop"] = stops
    if "reasoning_budget_message" in params and body.get("reasoning_budget") is None:
        raise BadRequest("'reasoning_budget_message' is given with 'reasoning_budget'", param="reasoning_budget_message")
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            params["logit_bias"] = {int(k): v for k, v in dict(bias).items()}
        except (TypeError, ValueError):
            raise BadRequest("'logit_bias' must map token ids to numbers", param="logit_bias") from None
    return params


def tool_list(value: Any, convert: Callable[[int, Any], dict[str, Any]]) -> list[dict[str, Any]] | None:
    """A request's tools in the chat shape (None for none): a list of at most ``MAX_TOOLS``, each
    made by ``convert(index, tool)``, which raises BadRequest for one it cannot take."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    return [convert(i, tool) for i, tool in enumerate(value)]


def json_object(body: Any, known: frozenset[str]) -> dict[str, Any]:
    """``body`` as an endpoint's object: a 400 unless it is a JSON object, and one naming the first
    field the endpoint does not read."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"'{unknown[0]}' is not a field this server reads", param=unknown[0],
                         code="unsupported_parameter")
    return body


def message_text(message: dict[str, Any]) -> str:
    """The text of a message's content (without its pictures)."""
    content = message.get("content") or ""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
