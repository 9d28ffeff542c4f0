"""Several models behind one URL (``aiollama serve --models-dir --models-preset``), driven over HTTP
by the official client and httpx: each model reached by name through its routes, loaded on first
use, the least recently used idle one closed to make room, an idle one closed after its
keep_alive, and one with a live stream never closed under it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from server_process import Server
from tiny_model import bert_model, rerank_model

import aiollama

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path, smollm2_path: Path) -> Path:
    cache = aiollama.cache_dir() / "test-models"
    folder = tmp_path_factory.mktemp("models")
    for name, target in (("chat", tiny_path), ("chat2", tiny_path), ("embed", bert_model(cache, smollm2_path)),
                         ("rerank", rerank_model(cache, smollm2_path))):
        (folder / f"{name}.gguf").symlink_to(target)
    return folder


@pytest.fixture(scope="module")
def router(models_dir: Path) -> Iterator[Server]:
    preset = models_dir.parent / "models.ini"
    preset.write_text("version = 1\n\n[*]\nc = 1024\nnp = 2\n\n[chat]\nalias = tiny-chat, helper\ntemp = 0\n")
    s = Server(None, "--models-dir", str(models_dir), "--models-preset", str(preset), "--models-max", "3",
               "--keep-alive", "600")
    yield s
    s.stop()


def states(server: Server) -> dict[str, Any]:
    status, text = server.get("/v1/models")
    assert status == 200
    return {card["id"]: card for card in json.loads(text)["data"]}


async def test_each_model_by_name_through_its_routes(router: Server) -> None:
    assert {n: c["status"]["value"] for n, c in states(router).items()} == {
        "chat": "unloaded", "chat2": "unloaded", "embed": "unloaded", "rerank": "unloaded"}
    async with router.client() as client:
        reply = await client.chat.completions.create(model="tiny-chat", max_tokens=4,
                                                     messages=[{"role": "user", "content": "Hello"}])
        assert reply.model == "chat" and reply.choices[0].message.content is not None
        vectors = await client.embeddings.create(model="embed", input=["a cat", "a dog"])
        assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == 64
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
            ranked = (await http.post("/v1/rerank", json={"model": "rerank", "query": "a cat",
                                                          "documents": ["a cat sat", "taxes", {"text": "cats"}],
                                                          "top_n": 2, "return_documents": True})).json()
            assert [set(r) for r in ranked["results"]] == [{"index", "relevance_score", "document"}] * 2
            scores = [r["relevance_score"] for r in ranked["results"]]
            assert scores == sorted(scores, reverse=True) and ranked["usage"]["prompt_tokens"] > 0
            tei = (await http.post("/rerank", json={"model": "rerank", "query": "a cat", "texts": ["a", "b"]})).json()
            assert sorted(r["index"] for r in tei) == [0, 1] and all("score" in r for r in tei)
            not_a_reranker = await http.post("/rerank", json={"model": "embed", "query": "q", "documents": ["d"]})
            assert not_a_reranker.status_code == 501
            unknown = await http.post("/v1/chat/completions", json={"model": "nope", "messages": []})
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
            anthropic = await http.post("/v1/messages", json={"model": "nope", "max_tokens": 4, "messages": []})
            assert anthropic.status_code == 404 and anthropic.json()["type"] == "error"
            missing = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
            metrics = (await http.get("/metrics")).text
            assert 'model="chat"' in metrics and 'aiollama_model_loaded{model="rerank"} 1' in metrics
        cards = states(router)
        assert {n: (c["status"]["value"], c["kind"]) for n, c in cards.items() if n != "chat2"} == {
            "chat": ("loaded", "chat"), "embed": ("loaded", "embedding"), "rerank": ("loaded", "rerank")}
        assert cards["chat"]["aliases"] == ["tiny-chat", "helper"]


async def test_past_the_limit_the_least_recently_used_idle_model_goes(router: Server) -> None:
    async with router.client() as client:
        for name in ("chat", "embed", "rerank"):
            assert router.post("/models/load", json.dumps({"model": name}).encode())[2] == {"success": True}
        await client.chat.completions.create(model="chat", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        await client.completions.create(model="chat2", prompt="Once", max_tokens=2)  # a fourth: embed goes
        assert {n: c["status"]["value"] for n, c in states(router).items()} == {
            "chat": "loaded", "chat2": "loaded", "embed": "unloaded", "rerank": "loaded"}


async def test_a_model_with_a_live_stream_is_not_closed(router: Server) -> None:
    async with router.client() as client:
        stream = await client.chat.completions.create(
            model="chat", max_tokens=2000, stream=True, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Count"}])
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == 2:
                busy = router.post("/models/unload?wait=false", json.dumps({"model": "chat"}).encode())
                assert busy[0] == 409 and busy[2]["error"]["code"] == "model_busy"
                for name in ("embed", "rerank", "chat2"):  # two others must go to make room, never chat
                    assert router.post("/models/load", json.dumps({"model": name}).encode())[0] == 200
                assert states(router)["chat"]["status"]["value"] == "loaded"
                break
        await stream.close()
        assert router.post("/models/unload", json.dumps({"model": "chat"}).encode())[2] == {"success": True}
        assert states(router)["chat"]["status"]["value"] == "unloaded"


async def test_an_idle_model_closes_after_its_keep_alive(router: Server) -> None:
    async with router.client() as client:
        await client.embeddings.create(model="embed", input="x", extra_body={"keep_alive": "500ms"})
        deadline = time.monotonic() + 10
        while states(router)["embed"]["status"]["value"] == "loaded" and time.monotonic() < deadline:
            await anyio.sleep(0.1)
        assert states(router)["embed"]["status"]["value"] == "unloaded"


async def test_concurrent_first_requests_load_a_model_once(router: Server) -> None:
    router.post("/models/unload", json.dumps({"model": "rerank"}).encode())
    loads = states(router)["rerank"]["loads"]
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
        async def one() -> None:
            answer = await http.post("/rerank", json={"model": "rerank", "query": "q", "documents": ["a", "b"]})
            assert answer.status_code == 200
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(one)
    assert states(router)["rerank"]["loads"] == loads + 1


async def test_loading_on_use_can_be_switched_off(router: Server) -> None:
    router.post("/models/unload", json.dumps({"model": "chat2"}).encode())
    async with router.client() as client:
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="chat2", prompt="x", max_tokens=1,
                                            extra_query={"autoload": "false"})
        assert states(router)["chat2"]["status"]["value"] == "unloaded"


async def test_a_stored_response_is_found_by_its_id_alone(router: Server) -> None:
    async with router.client() as client:
        made = await client.responses.create(model="chat", input="Hello", max_output_tokens=3, temperature=0)
        assert made.model == "chat"
        again = await client.responses.retrieve(made.id)  # a GET names no model: the id does
        assert again.output_text == made.output_text
        follow = await client.responses.create(model="chat", input="More", previous_response_id=made.id,
                                               max_output_tokens=3, temperature=0)
        assert follow.previous_response_id == made.id
        await client.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(made.id)
