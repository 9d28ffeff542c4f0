"""The one request model: each API's codec only translates its body into the neutral request,
and the sampling fields are checked by SamplingParams alone, its refusal naming the body's field."""

from __future__ import annotations

from typing import Any

import pytest

from aiollama.server.bad_request import BadRequest
from aiollama.server.chat_request import chat_request
from aiollama.server.messages_request import messages_request
from aiollama.server.native_request import native_request
from aiollama.server.neutral_request import ChatRequest, checked
from aiollama.server.openai_request import completion_request
from aiollama.server.responses_request import responses_request

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TEXT = {"prompt": "hi"}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"input": "hi"}


def _native(body: dict[str, Any]) -> Any:
    return native_request(body, n_slots=1, tokenize=lambda text: [1])


# (codec, base body, bad fields, the field the 400 names)
REFUSED = [
    (chat_request, CHAT, {"max_tokens": 0}, "max_tokens"),
    (chat_request, CHAT, {"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
    (chat_request, CHAT, {"temperature": 2.5}, "temperature"),  # OpenAI's own ceiling
    (chat_request, CHAT, {"temperature": -0.5}, "temperature"),
    (chat_request, CHAT, {"top_p": 0}, "top_p"),
    (chat_request, CHAT, {"top_k": 1.5}, "top_k"),
    (chat_request, CHAT, {"min_p": 1.5}, "min_p"),
    (chat_request, CHAT, {"presence_penalty": 3}, "presence_penalty"),
    (chat_request, CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (chat_request, CHAT, {"logprobs": True, "top_logprobs": False}, "top_logprobs"),
    (chat_request, CHAT, {"stop": ["a", ""]}, "stop"),
    (chat_request, CHAT, {"priority": 2**40}, "priority"),
    (chat_request, CHAT, {"reasoning_budget": -1}, "reasoning_budget"),
    (chat_request, CHAT, {"logit_bias": {"5": "high"}}, "logit_bias"),
    (chat_request, CHAT, {"grammar": ""}, "grammar"),
    (chat_request, CHAT, {"prompt_logprobs": 21}, "prompt_logprobs"),
    (completion_request, TEXT, {"logprobs": 21}, "logprobs"),
    (completion_request, TEXT, {"max_tokens": -1}, "max_tokens"),
    (messages_request, MESSAGES, {"max_tokens": 0}, "max_tokens"),
    (messages_request, MESSAGES, {"temperature": 1.5}, "temperature"),  # Anthropic's own ceiling
    (messages_request, MESSAGES, {"top_k": -1}, "top_k"),
    (messages_request, MESSAGES, {"stop_sequences": ["a", ""]}, "stop_sequences"),
    (responses_request, RESPONSES, {"max_output_tokens": 0}, "max_output_tokens"),
    (responses_request, RESPONSES, {"temperature": 2.5}, "temperature"),
    (responses_request, RESPONSES, {"top_p": 1.5}, "top_p"),
    (responses_request, RESPONSES, {"text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    (_native, TEXT, {"top_p": 0}, "top_p"),
    (_native, TEXT, {"n_predict": 5, "min_p": -1}, "min_p"),
    (_native, TEXT, {"repeat_last_n": -2}, "repeat_last_n"),
]


@pytest.mark.parametrize(("codec", "base", "bad", "param"), REFUSED,
                         ids=[f"{c.__name__}-{p}-{i}" for i, (c, _, _, p) in enumerate(REFUSED)])
def test_each_api_refuses_a_sampling_field_naming_its_own_field(codec: Any, base: dict[str, Any],
                                                                bad: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        codec({**base, **bad})
    assert caught.value.param == param, caught.value.message
    assert caught.value.status == 400


def test_the_codecs_give_one_neutral_request() -> None:
    """The same generation asked through three APIs reads into the same neutral fields."""
    chat = chat_request({**CHAT, "max_completion_tokens": 7, "temperature": 0.5, "stop": ["x"],
                         "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}})
    messages = messages_request({**MESSAGES, "max_tokens": 7, "temperature": 0.5, "stop_sequences": ["x"],
                                 "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    responses = responses_request({**RESPONSES, "max_output_tokens": 7, "temperature": 0.5, "stop": ["x"],
                                   "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    for request in (chat, messages, responses):
        assert isinstance(request, ChatRequest)
        assert request.params == {"max_tokens": 7, "temperature": 0.5, "stop": ["x"],
                                  "json_schema": {"type": "object"}}
        assert request.messages == [{"role": "user", "content": "hi"}]
    assert messages.effort_param == "output_config.effort" and responses.effort_param == "reasoning.effort"


def test_checked_names_the_field_in_the_message_too() -> None:
    with pytest.raises(BadRequest) as caught:
        checked({"stop": [""]}, {"stop": "stop_sequences"})
    assert caught.value.param == "stop_sequences" and caught.value.message.startswith("stop_sequences ")
    assert checked({"temperature": 0.0, "seed": 3}) == {"temperature": 0.0, "seed": 3}


@pytest.mark.parametrize("name", ["truncate", "raw_scores", "max_chunks_per_doc", "rank_fields"])
def test_a_rerank_field_this_server_does_not_honour_is_refused(name: str) -> None:
    from aiollama.server.rerank import rerank_request

    with pytest.raises(BadRequest) as caught:
        rerank_request({"query": "q", "documents": ["d"], name: True})
    assert caught.value.param == name
