"""Replicas on Ray Serve: a local Ray instance on 127.0.0.1 (2 CPUs), two replicas of the tiny
model behind Serve's proxy, the official OpenAI client in front."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from aiollama.ray import REPLICA_HEADER, affinity_keys, build_app  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def endpoint(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray's workers start in the driver's folder: from the repository root they would import the
    # uncompiled sources, not the installed package
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray"))
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    finally:
        os.chdir(here)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(tiny_path, replicas=2, n_seq_max=4, n_ctx=4096, n_threads=1),
                  name="aiollama", route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url: str) -> Any:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def test_the_openai_client_streams_through_the_proxy(endpoint: str) -> None:
    chunks = list(client(endpoint).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_conversations_stay_with_the_replica_that_holds_their_prefix(endpoint: str) -> None:
    api = client(endpoint)
    replicas: dict[int, set[str]] = {}
    for conv in range(4):
        messages = [{"role": "system", "content": f"You are assistant number {conv}. " * 8}]
        previous = 0
        for turn in range(4):
            messages.append({"role": "user", "content": f"Question {turn} of conversation {conv}?"})
            raw = api.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=8,
                                                                 temperature=0)
            reply = raw.parse()
            replicas.setdefault(conv, set()).add(raw.headers[REPLICA_HEADER])
            usage = reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            if turn:  # everything the previous turn evaluated is in that replica's cache
                assert usage.prompt_tokens_details.cached_tokens >= previous - 1, (conv, turn, usage)
            previous = usage.prompt_tokens
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    assert all(len(served) == 1 for served in replicas.values()), replicas


def test_a_responses_chain_stays_with_the_replica_that_holds_it_and_ends_clearly_with_it(endpoint: str) -> None:
    import json
    import threading
    import urllib.error
    import urllib.request

    root = endpoint.removesuffix("/v1")

    def call(method: str, path: str, body: Any = None) -> tuple[int, Any, str]:
        request = urllib.request.Request(root + path, None if body is None else json.dumps(body).encode(),
                                         method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read()), response.headers[REPLICA_HEADER]
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                return exc.code, json.loads(raw), exc.headers[REPLICA_HEADER]
            except ValueError:  # Ray's proxy, not a replica, answered (in plain text)
                return exc.code, raw.decode("utf-8", "replace"), exc.headers[REPLICA_HEADER]

    status, first, holder = call("POST", "/v1/responses", {"input": "Once upon a time", "max_output_tokens": 4,
                                                           "temperature": 0})
    assert status == 200 and holder in first["id"]
    previous, total = first["id"], first["usage"]["total_tokens"]
    for turn in range(3):
        # load, while the turn runs: streams that the least-loaded rule would place beside it
        load = [threading.Thread(target=call, args=("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"busy {turn} {i}"}], "max_tokens": 24, "user": f"u{i}"}))
            for i in range(4)]
        for thread in load:
            thread.start()
        status, reply, served = call("POST", "/v1/responses", {"input": f"Then {turn}", "previous_response_id": previous,
                                                               "max_output_tokens": 4, "temperature": 0})
        for thread in load:
            thread.join()
        assert status == 200 and served == holder, (turn, reply)
        assert reply["usage"]["input_tokens_details"]["cached_tokens"] >= total - 1  # only the new input evaluated
        previous, total = reply["id"], reply["usage"]["total_tokens"]
    for _ in range(3):  # from any client, whichever replica is least loaded
        status, stored, served = call("GET", f"/v1/responses/{previous}")
        assert status == 200 and served == holder and stored["id"] == previous
    doomed = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(holder))
    ray.kill(ray.get_actor(doomed, namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            status, gone, served = call("POST", "/v1/responses", {"input": "And?", "previous_response_id": previous,
                                                                  "max_output_tokens": 2})
        except OSError:
            time.sleep(0.5)
            continue
        if status != 500 and served != holder and isinstance(gone, dict):
            break
        time.sleep(0.5)
    assert status == 404 and "gone" in gone["error"]["message"], gone  # never another conversation's reply
    _wait_for_two_replicas(holder)


def _wait_for_two_replicas(dead: str) -> None:
    deadline = time.monotonic() + 90
    states: Any = None
    while time.monotonic() < deadline:
        states = serve.status().applications["aiollama"].deployments["EngineReplica"].replica_states
        alive = _replica_ids()
        if len(alive) == 2 and dead not in alive and states.get("RUNNING", 0) == 2:
            return
        time.sleep(0.5)
    pytest.fail(f"the dead replica was not replaced: {states}")


def test_a_dead_replica_fails_its_requests_and_the_other_serves(endpoint: str) -> None:
    api = client(endpoint)
    pinned = {"x-session-id": "doomed"}
    raw = api.chat.completions.with_raw_response.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=2, extra_headers=pinned)
    doomed = raw.headers[REPLICA_HEADER]
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(doomed))
    stream = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "long"}],
                                         max_tokens=3000, stream=True, extra_headers=pinned,
                                         extra_body={"ignore_eos": True})
    received = 0
    with pytest.raises(openai.APIError):
        for _ in stream:
            received += 1
            if received == 3:
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    assert received < 3000
    for i in range(4):  # the pinned conversation too: its replica is gone, another takes it
        reply = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"after {i}"}],
                                            max_tokens=4, extra_headers=pinned if i % 2 else None)
        assert reply.choices[0].message.content is not None
    # and Ray replaces the dead replica
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        states = serve.status().applications["aiollama"].deployments["EngineReplica"].replica_states
        alive = _replica_ids()
        if len(alive) == 2 and doomed not in alive and states.get("RUNNING", 0) == 2:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the dead replica was not replaced: {states}")


def _replica_ids() -> list[str]:
    return [a["name"].rsplit("#", 1)[-1] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and "EngineReplica" in a["name"]]


def test_affinity_keys() -> None:
    chat = b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}'
    lookup, record = affinity_keys([], chat)
    assert len(lookup) == 2 and record == lookup[:1]
    longer = chat.replace(b'"u"}]', b'"u"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]')
    assert record[0] in affinity_keys([], longer)[0]  # the next turn finds this one
    assert affinity_keys([(b"X-Session-Id", b"abc")], chat) == (("session:abc",), ("session:abc",))
    assert affinity_keys([], b'{"prompt": "hi", "user": "ann"}') == (("user:ann",), ("user:ann",))
    assert affinity_keys([], b"not json") == ((), ())
    text = b'{"prompt": "' + b"x" * 600 + b'"}'
    assert len(affinity_keys([], text)[0]) == 2  # 512 and 256 characters
    salted = chat.replace(b'{"messages"', b'{"cache_salt": "tenant-a", "messages"')
    other = chat.replace(b'{"messages"', b'{"cache_salt": "tenant-b", "messages"')
    keys = [set(affinity_keys([], body)[0]) for body in (chat, salted, other)]
    assert not keys[0] & keys[1] and not keys[1] & keys[2]  # a tenant is never routed by another's keys
    assert affinity_keys([], b'{"user": "ann", "cache_salt": "t"}')[0] != (("user:ann",),)
    from aiollama.ray import holder_of
    assert holder_of("/v1/responses/resp_abc123_" + "0" * 32, b"") == "abc123"
    assert holder_of("/v1/responses", b'{"previous_response_id": "resp_r9_' + b"f" * 32 + b'"}') == "r9"
    assert holder_of("/v1/responses", b'{"previous_response_id": "resp_' + b"f" * 32 + b'"}') is None
    assert holder_of("/v1/chat/completions", b"{}") is None


def test_build_app_takes_serve_run_arguments(tiny_path: Path) -> None:
    app = build_app({"model": str(tiny_path), "replicas": "2", "n_ctx": "2048", "deterministic": "true"})
    assert app is not None
    with pytest.raises(ValueError, match="unknown engine option"):
        build_app(tiny_path, n_ctxx=1)


def test_a_replica_freezes_the_heap_its_start_built(tiny_path: Path) -> None:
    """A replica's process is its own, as ``aiollama serve``'s is: what its start built is out of the
    full collections' sight, what serving makes is not."""
    import gc

    import anyio

    from aiollama.ray import EngineReplica

    class Replica(EngineReplica):
        def __del__(self) -> None:  # type: ignore[override]  # closed below: Ray awaits the async one
            pass

    async def main() -> None:
        replica = Replica(str(tiny_path), {"n_ctx": 1024, "n_seq_max": 2, "n_threads": 1})
        built_before = [object()]
        try:
            await replica._started()
            assert gc.get_freeze_count() > 0 and not any(o is built_before for o in gc.get_objects())
            made_after = [object()]
            assert any(o is made_after for o in gc.get_objects())
        finally:
            await EngineReplica.__del__(replica)

    gc.unfreeze()
    try:
        anyio.run(main)
    finally:
        gc.unfreeze()
