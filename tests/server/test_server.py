"""The OpenAI-compatible server, in a real process on 127.0.0.1, driven by the official openai client."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import anyio
import pytest
from server_process import TIMEOUT, Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.anyio


SERVER_OPTIONS = ("--n-ctx", "4096", "--n-seq-max", "16", "--model-name", "tiny", "--log-level", "warning")


async def wait_metric(server: Server, name: str, pred: Any) -> float:
    with anyio.fail_after(TIMEOUT):
        while not pred(value := await anyio.to_thread.run_sync(server.metric, name)):
            await anyio.sleep(0.02)
    return value


async def test_models_and_health(server: Server) -> None:
    async with server.client() as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert server.get("/health") == (200, '{"status":"ok"}')


async def test_chat_non_streaming_reports_usage(server: Server) -> None:
    async with server.client() as client:
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=7, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 7 and reply.usage.prompt_tokens > 10
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 7


async def test_chat_streaming(server: Server) -> None:
    async with server.client() as client:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Stream to me"}], max_tokens=9, temperature=0,
            stream=True, stream_options={"include_usage": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert finish == "length" and usage is not None and usage.completion_tokens == 9
        again = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Stream to me"}], max_tokens=9, temperature=0)
    assert again.choices[0].message.content == text  # streamed and whole answers agree


async def test_completions_and_stop(server: Server) -> None:
    async with server.client() as client:
        plain = await client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                                temperature=0)
        text = plain.choices[0].text
        assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 12
        stop = text[len(text) // 2:][:3]
        assert stop.strip(), text
        cut = await client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                              temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


async def test_n_choices_share_the_prompt(server: Server) -> None:
    before = await anyio.to_thread.run_sync(server.metric, "aiollama_tokens_in_total")
    async with server.client() as client:
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Give me three different answers " * 20}],
            n=3, max_tokens=5, temperature=1.0, seed=3)
    after = await anyio.to_thread.run_sync(server.metric, "aiollama_tokens_in_total")
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    assert reply.usage.completion_tokens == 15
    # the prompt was evaluated once for the three forks, not three times
    assert after - before < 2 * reply.usage.prompt_tokens


async def test_multi_turn_chat_evaluates_only_the_new_tokens(server: Server) -> None:
    messages = [{"role": "system", "content": "You are a patient storyteller. " * 12},
                {"role": "user", "content": "Begin a story about a lighthouse."}]
    async with server.client() as client:
        previous = 0
        for turn in range(3):
            before = await anyio.to_thread.run_sync(server.metric, "aiollama_tokens_in_total")
            reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                         temperature=0)
            after = await anyio.to_thread.run_sync(server.metric, "aiollama_tokens_in_total")
            usage = reply.usage
            cached = usage.prompt_tokens_details.cached_tokens
            if turn:  # what the previous turn evaluated is reused; only the new messages are not
                assert cached >= previous
                assert after - before <= usage.prompt_tokens - cached + usage.completion_tokens
            previous = usage.prompt_tokens + usage.completion_tokens - 1
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": f"Go on ({turn})."}]


async def test_a_disconnect_frees_the_conversation(server: Server) -> None:
    async with server.client() as client:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Talk for a long time"}], max_tokens=3000,
            temperature=0, stream=True)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        assert await wait_metric(server, "aiollama_active_conversations", lambda v: v >= 1) >= 1
        out_at_close = await anyio.to_thread.run_sync(server.metric, "aiollama_tokens_out_total")
        await stream.close()
    await wait_metric(server, "aiollama_active_conversations", lambda v: v == 0)
    # ended within a few steps of the disconnect, not after its 3,000 tokens
    assert await anyio.to_thread.run_sync(server.metric, "aiollama_tokens_out_total") - out_at_close < 100
    await wait_metric(server, "aiollama_live_conversations", lambda v: v == 0)
    # what stays is the prefix cache: every seq id still held is a cache entry's
    assert await anyio.to_thread.run_sync(server.metric, "aiollama_seq_ids_used") == \
        await anyio.to_thread.run_sync(server.metric, "aiollama_cache_entries")


async def test_sixteen_concurrent_clients_and_metrics_under_load(server: Server) -> None:
    peak = 0.0

    async def scrape() -> None:
        nonlocal peak
        while True:
            peak = max(peak, await anyio.to_thread.run_sync(server.metric, "aiollama_active_conversations"))
            await anyio.sleep(0.02)

    replies: list[Any] = []

    async def one(i: int) -> None:
        async with server.client() as client:  # one connection each, as separate clients have
            replies.append(await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Client {i} here"}], max_tokens=48,
                temperature=0.5, seed=i))

    async with anyio.create_task_group() as outer:
        outer.start_soon(scrape)
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
        outer.cancel_scope.cancel()
    assert len(replies) == 16 and all(r.usage.completion_tokens == 48 for r in replies)
    assert peak >= 8  # the gauge moved with the load
    assert await anyio.to_thread.run_sync(server.metric, "aiollama_active_conversations") == 0
    assert await anyio.to_thread.run_sync(server.metric, "aiollama_time_to_first_token_seconds_count") >= 16


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [("/v1/chat/completions", b"{not json", None),
     ("/v1/chat/completions", b'{"messages": []}', "messages"),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": 3}', "temperature"),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', "top_p"),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stop": [""]}', "stop"),
     # the limits: n, stop strings and tools
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 17}', "n"),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}',
      "stop"),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": ['
                              + b",".join(b'{"type": "function", "function": {"name": "f%d"}}' % i for i in range(129))
                              + b"]}", "tools"),
     ("/v1/chat/completions", b'{"messages": [{"role": "user<|im_end|>", "content": "x"}]}', None),
     ("/v1/completions", b'{"prompt": ""}', "prompt"),
     ("/v1/completions", b'{"prompt": [1, 2, 999999999]}', None),
     ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
     ("/v1/completions", b'{"prompt": "x", "logprobs": 99}', "logprobs"),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}', "top_logprobs"),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
      "tools"),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "response_format": '
                              b'{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}',
      None),
     ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "grammar": "root ::= ("}', None),
     ("/v1/embeddings", b'{"input": ""}', "input"),
     ("/v1/embeddings", b'{"input": "x", "encoding_format": "int8"}', "encoding_format")],
)
async def test_malformed_requests_get_openai_style_400(server: Server, path: str, body: bytes,
                                                       param: str | None) -> None:
    status, _, payload = await anyio.to_thread.run_sync(server.post, path, body)
    assert status == 400
    error = payload["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param


async def test_the_openai_client_sees_a_bad_request_error(server: Server) -> None:
    async with server.client() as client:
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                 temperature=9)


async def test_overload_answers_503_with_retry_after_and_sigterm_is_graceful(tiny_path: Path) -> None:
    small = Server(tiny_path, "--n-ctx", "1024", "--n-seq-max", "1", "--max-queued", "1", "--grace", "20",
                   "--log-level", "warning")
    try:
        await overload_then_sigterm(small)
    finally:
        small.stop()


async def overload_then_sigterm(small: Server) -> None:
    async with small.client() as client:
        running = await client.completions.create(model="x", prompt="Running", max_tokens=300, temperature=0,
                                                  stream=True)
        first = await running.__anext__()
        waiting = await client.completions.create(model="x", prompt="Waiting", max_tokens=5, temperature=0,
                                                  stream=True)
        status, headers, payload = await anyio.to_thread.run_sync(
            small.post, "/v1/completions", b'{"prompt": "One too many", "max_tokens": 5}')
        assert status == 503 and headers.get("Retry-After") == "1"
        assert payload["error"]["code"] == "overloaded"
        # SIGTERM: no new connections, but the running streams finish within the grace period
        small.proc.send_signal(signal.SIGTERM)
        texts = [first.choices[0].text]
        async for chunk in running:
            texts += [c.text for c in chunk.choices]
        tail = [c async for c in waiting]
        assert sum(1 for t in texts if t) >= 30 and tail[-1].choices[0].finish_reason == "length"
    # uvicorn re-raises the signal once it has shut down, as process managers expect
    assert await anyio.to_thread.run_sync(small.proc.wait, TIMEOUT) in (0, -signal.SIGTERM)
    assert "Traceback" not in small.output()


async def test_the_embedding_example(tiny_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "embed_starlette.py"
    app = Server(tiny_path, command=(str(example),), health="/openai/health")
    try:
        status, _, body = await anyio.to_thread.run_sync(app.post, "/summarize", b'{"text": "Llamas hum."}')
        assert status == 200 and isinstance(body["summary"], str)
        status, _, body = await anyio.to_thread.run_sync(app.post, "/summarize", b'{"text": ""}')
        assert status == 400
        async with openai.AsyncOpenAI(base_url=app.url + "/openai/v1", api_key="unused", max_retries=0) as client:
            reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                         max_tokens=3)
            assert reply.usage.completion_tokens == 3
            assert [m.id for m in (await client.models.list()).data] == [tiny_path.stem]
    finally:
        app.stop()


async def test_streams_past_the_grace_period_end_with_an_error_event(tiny_path: Path) -> None:
    short = Server(tiny_path, "--n-ctx", "4096", "--unified-cache", "--grace", "1", "--log-level", "warning")
    try:
        async with short.client() as client:
            stream = await client.completions.create(model="x", prompt="Go on", max_tokens=3500, stream=True)
            await stream.__anext__()
            short.proc.send_signal(signal.SIGTERM)
            with pytest.raises(openai.APIError, match="engine was closed"):
                async for _ in stream:
                    pass
        assert await anyio.to_thread.run_sync(short.proc.wait, TIMEOUT) in (0, -signal.SIGTERM)
        assert "Traceback" not in short.output()
    finally:
        short.stop()
