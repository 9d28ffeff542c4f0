"""Images through libmtmd: a tiny projector written with gguf in clip.cpp's layout beside the tiny
text model. The engine's greedy tokens equal llama.cpp's own evaluation of the same prompt
(mtmd_helper_eval_chunks), whatever the step budget, beside other streams, after a fork, a rewind,
a prefix hit or a preemption; and bad pictures get typed errors while the engine keeps serving."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from server_process import Server
from tiny_model import spm_model
from tiny_projector import N_IMAGE_TOKENS, png, projector

import aiollama
from aiollama import Engine, Image
from aiollama.errors import ChatTemplateError, ImageError, ModelLoadError
from aiollama.formats.images import image_row
from aiollama.native import Batch, Context, DecodeStatus, Model, Projector
from aiollama.native.binding import ffi, lib

pytestmark = pytest.mark.anyio

PICTURE = png(40, 30, seed=1)
OTHER = png(24, 48, seed=2)
BEFORE, AFTER = "Look:", " What is it?"
N = 8  # tokens generated


@pytest.fixture(scope="module")
def mmproj() -> Path:
    return projector(aiollama.cache_dir() / "test-models", 64)


def _reference(model_path: Path, mmproj: Path, picture: bytes, n: int = N, before: str = BEFORE) -> list[int]:
    """llama.cpp's own evaluation: libmtmd tokenizes and evaluates the prompt with its helper, then
    a plain greedy loop on one sequence."""
    with Model(model_path) as model, Projector(model, mmproj) as proj, \
            Context(model, n_ctx=256, n_batch=64, n_seq_max=1) as ctx, Batch(1) as batch:
        chunks = lib.mtmd_input_chunks_init()
        try:
            text = ffi.new("char[]", f"{before}<__media__>{AFTER}".encode())
            spec = ffi.new("mtmd_input_text *", {"text": text, "text_len": len(text) - 1, "add_special": True,
                                                 "parse_special": False})
            wrapper = lib.mtmd_helper_bitmap_init_from_buf(proj._get(), picture, len(picture), False,
                                                           lib.mtmd_helper_init_opt_default())
            bitmaps = ffi.new("mtmd_bitmap *[1]", [wrapper.bitmap])
            assert lib.mtmd_tokenize(proj._get(), chunks, spec, bitmaps, 1) == 0
            lib.mtmd_bitmap_free(wrapper.bitmap)
            n_past = ffi.new("llama_pos *")
            assert lib.mtmd_helper_eval_chunks(proj._get(), ctx._get(), chunks, 0, 0, 64, True, n_past) == 0
        finally:
            lib.mtmd_input_chunks_free(chunks)
        pos, out = n_past[0], []
        logits = lib.llama_get_logits_ith(ctx._get(), -1)
        for _ in range(n):
            token = int(np.argmax(np.frombuffer(ffi.buffer(logits, model.vocab.n_tokens * 4), dtype=np.float32)))
            out.append(token)
            batch.clear()
            row = batch.add(token, pos, 0, output=True)
            assert ctx.decode(batch) is DecodeStatus.OK
            logits, pos = lib.llama_get_logits_ith(ctx._get(), row), pos + 1
        return out


@pytest.fixture(scope="module")
def want(tiny_path: Path, mmproj: Path) -> list[int]:
    return _reference(tiny_path, mmproj, PICTURE)


@pytest.fixture(scope="module")
def gemma3() -> Path:
    return projector(aiollama.cache_dir() / "test-models", 64, "gemma3")


def _prompt(picture: bytes = PICTURE) -> list[Any]:
    return [BEFORE, Image(picture), AFTER]


def test_the_projector_encodes_a_picture_into_rows_of_the_text_models_width(tiny: Model, mmproj: Path) -> None:
    with Projector(tiny, mmproj) as proj:
        first, again, other = proj.encode(PICTURE), proj.encode(PICTURE), proj.encode(OTHER)
        (rows,) = first.parts
        assert isinstance(rows, np.ndarray) and rows.shape == (N_IMAGE_TOKENS, 64) and rows.dtype == np.float32
        assert (first.width, first.height) == (40, 30)
        assert np.array_equal(rows, again.parts[0]) and not np.array_equal(rows, other.parts[0])
        for bad in (b"not a picture", PICTURE[:40]):
            with pytest.raises(ImageError):
                proj.encode(bad)
        assert np.array_equal(proj.encode(PICTURE).parts[0], rows)  # and it still works


def test_a_projector_that_cannot_load_is_a_model_load_error(tiny: Model, tiny_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        Projector(tiny, tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError):
        Projector(tiny, tiny_path)  # a text model is no projector


def test_a_projector_takes_a_thread_count_of_at_least_one(tiny: Model, mmproj: Path) -> None:
    with pytest.raises(aiollama.InvalidRequestError, match="n_threads"):
        Projector(tiny, mmproj, n_threads=0)
    with Projector(tiny, mmproj, n_threads=1) as proj:
        assert proj.encode(PICTURE).parts


@pytest.mark.parametrize("step_tokens", [256, 5])
async def test_an_image_prompt_gives_llama_cpps_own_tokens(tiny_path: Path, mmproj: Path, want: list[int],
                                                           step_tokens: int) -> None:
    async with Engine(tiny_path, mmproj=mmproj, n_ctx=512, n_seq_max=4, step_tokens=step_tokens) as engine:
        conv = engine.conversation()
        conv.prompt(_prompt())
        lead, tail = len(engine.tokenize(BEFORE, add_special=True)), len(engine.tokenize(AFTER))
        assert len(conv) == lead + N_IMAGE_TOKENS + tail and sum(t < 0 for t in conv.tokens) == N_IMAGE_TOKENS
        rows = [image_row(t) for t in conv.tokens[lead:lead + N_IMAGE_TOKENS]]
        assert rows == [(rows[0][0], i) for i in range(N_IMAGE_TOKENS)]  # one picture's rows, in order
        got = await conv.stream(max_tokens=N, temperature=0)
        assert got.tokens == want
        assert got.stats.prompt_tokens == len(conv) - N


async def test_a_prompt_that_starts_with_a_picture_begins_with_bos(mmproj: Path) -> None:
    """As a first text part would, and as libmtmd does: BOS before the picture (a model whose
    vocabulary asks for BOS)."""
    path = spm_model(aiollama.cache_dir() / "test-models")
    async with Engine(path, mmproj=mmproj, n_ctx=512, n_seq_max=4) as engine:
        conv = engine.conversation()
        conv.prompt([Image(PICTURE), AFTER])
        bos = engine.tokenize(AFTER, add_special=True)[:1]
        assert bos != engine.tokenize(AFTER)[:1]
        assert list(conv.tokens[:1]) == bos and conv.tokens[1] < 0
        got = await conv.stream(max_tokens=N, temperature=0)
        assert got.tokens == _reference(path, mmproj, PICTURE, before="")
        start = len(conv)
        conv.prompt([Image(OTHER), AFTER])  # not the first prompt: no BOS
        assert conv.tokens[start] != bos[0]


@pytest.mark.parametrize("step_tokens", [256, 5])
async def test_a_picture_decoded_with_attention_over_all_its_rows_goes_whole_in_one_step(
        tiny_path: Path, gemma3: Path, step_tokens: int) -> None:
    want = _reference(tiny_path, gemma3, PICTURE)
    async with Engine(tiny_path, mmproj=gemma3, n_ctx=512, n_seq_max=4, step_tokens=step_tokens) as engine:
        runner = engine.conversation("Once upon a time")
        running = runner.stream(max_tokens=30, temperature=0)
        conv = engine.conversation()
        conv.prompt(_prompt())
        # Gemma 3's format: text markers around the picture's 16 rows
        assert sum(t < 0 for t in conv.tokens) == N_IMAGE_TOKENS and len(conv) > N_IMAGE_TOKENS + 10
        got, _ = await _all([conv.stream(max_tokens=N, temperature=0), running])
        assert got.tokens == want
        fork = conv.fork()
        fork.rewind(N)
        assert (await fork.stream(max_tokens=N, temperature=0)).tokens == want


async def test_streams_keep_decoding_while_a_picture_is_evaluated(tiny_path: Path, mmproj: Path,
                                                                  want: list[int]) -> None:
    async with Engine(tiny_path, mmproj=mmproj, n_ctx=512, n_seq_max=4) as engine:
        alone = await engine.conversation("Once upon a time").stream(max_tokens=12, temperature=0)
    async with Engine(tiny_path, mmproj=mmproj, n_ctx=512, n_seq_max=4, step_tokens=4) as engine:
        runner = engine.conversation("Once upon a time")
        stream = runner.stream(max_tokens=12, temperature=0)
        seen: list[int] = []
        async for chunk in stream:  # the picture arrives while this one decodes
            seen += chunk.tokens
            if len(seen) == 2:
                looker = engine.conversation()
                looker.prompt(_prompt())
                pictured = looker.stream(max_tokens=N, temperature=0)
                steps = engine.statistics().decode_steps
        assert seen == alone.tokens
        assert (await pictured).tokens == want
        # a 4-token budget: the 23-token prompt took several steps, and the running stream had a row in each
        assert engine.statistics().decode_steps - steps >= 5


async def test_the_same_picture_shares_its_cells_and_another_does_not(tiny_path: Path, mmproj: Path,
                                                                      want: list[int]) -> None:
    async with Engine(tiny_path, mmproj=mmproj, n_ctx=512, n_seq_max=4) as engine:
        first = engine.conversation()
        first.prompt(_prompt())
        assert (await first.stream(max_tokens=N, temperature=0)).tokens == want
        await first.aclose()
        again = engine.conversation()
        again.prompt(_prompt())
        got = await again.stream(max_tokens=N, temperature=0)
        assert got.tokens == want and got.stats.cached_tokens == got.stats.prompt_tokens - 1
        other = engine.conversation()
        other.prompt(_prompt(OTHER))
        got = await other.stream(max_tokens=N, temperature=0)
        assert got.stats.cached_tokens == len(engine.tokenize(BEFORE, add_special=True))  # the picture differs
        assert got.tokens != want


async def test_fork_and_rewind_give_the_tokens_of_a_fresh_conversation(
        tiny_path: Path, mmproj: Path, want: list[int]) -> None:
    async with Engine(tiny_path, mmproj=mmproj, n_ctx=512, n_seq_max=4) as engine:
        conv = engine.conversation()
        conv.prompt(_prompt())
        assert (await conv.stream(max_tokens=N, temperature=0)).tokens == want
        child = conv.fork()
        child.rewind(N)
        got = await child.stream(max_tokens=N, temperature=0)
        assert got.tokens == want and got.stats.cached_tokens == len(child) - N - 1
        # back into the middle of the picture, then another one: as a conversation given that history
        keep = len(engine.tokenize(BEFORE, add_special=True)) + 7
        conv.rewind(len(conv) - keep)
        with pytest.raises(ImageError):
            conv.stream()  # it ends with a picture's rows
        conv.prompt([Image(OTHER), AFTER])
        fresh = engine.conversation(cache_salt="fresh")
        fresh.prompt(_prompt())
        fresh.rewind(len(fresh) - keep)
        fresh.prompt([Image(OTHER), AFTER])
        assert fresh.tokens == conv.tokens
        mine, theirs = await _all([conv.stream(max_tokens=N, temperature=0),
                                   fresh.stream(max_tokens=N, temperature=0)])
        assert mine.tokens == theirs.tokens and mine.stats.cached_tokens == keep
        assert theirs.stats.cached_tokens == 0


async def test_preempted_streams_evaluate_their_pictures_again(tiny_path: Path, mmproj: Path) -> None:
    ref = _reference(tiny_path, mmproj, PICTURE, 60)
    # four streams in a context too small for all of them, with no host memory to park in: the
    # preempted ones drop their cells and evaluate the picture again from their own rows
    async with Engine(tiny_path, mmproj=mmproj, n_ctx=256, n_seq_max=4, cache_seq_ids=0,
                      host_cache_bytes=0) as engine:
        parent = engine.conversation()
        parent.prompt(_prompt())
        convs = [parent.fork()]  # it keeps the picture's rows after its parent is closed
        await parent.aclose()
        for _ in range(3):
            c = engine.conversation()
            c.prompt(_prompt(OTHER))
            convs.append(c)
        results = await _all([c.stream(max_tokens=60, temperature=0) for c in convs])
        ref = [ref] + [_reference(tiny_path, mmproj, OTHER, 60)] * 3
        assert [r.tokens for r in results] == ref
        assert engine.statistics().preemptions > 0


async def _all(streams: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(streams)

    async def one(i: int) -> None:
        out[i] = await streams[i]
    async with anyio.create_task_group() as tg:
        for i in range(len(streams)):
            tg.start_soon(one, i)
    return out


async def test_bad_pictures_get_typed_errors_and_the_engine_keeps_serving(tiny_path: Path, mmproj: Path,
                                                                          want: list[int], tmp_path: Path) -> None:
    with pytest.raises(ImageError):
        Image(tmp_path / "missing.png")
    with pytest.raises(ImageError):
        Image(b"")
    with pytest.raises(ImageError):
        Image(42)  # type: ignore[arg-type]
    for url in ("https://example.com/a.png", "data:image/png,plain", "data:image/png;base64,@@@"):
        with pytest.raises(ImageError):
            Image.from_url(url)
    assert Image.from_url("data:image/png;base64," + base64.b64encode(PICTURE).decode()) == Image(PICTURE)
    async with Engine(tiny_path, n_ctx=256, n_seq_max=2) as plain:
        with pytest.raises(ImageError, match="projector"):
            plain.conversation().prompt(_prompt())
    async with Engine(tiny_path, mmproj=mmproj, n_ctx=512, n_seq_max=4) as engine:
        conv = engine.conversation()
        with pytest.raises(ImageError):
            conv.prompt([BEFORE, Image(b"GIF89a but not really")])
        with pytest.raises(ImageError, match="end with an image"):
            conv.prompt([BEFORE, Image(PICTURE)])
        with pytest.raises(ImageError):
            await engine.encode_images([Image(b"\x89PNG\r\n\x1a\n broken")])
        assert len(conv) == 0  # nothing was appended
        await engine.encode_images([Image(PICTURE)])
        conv.prompt(_prompt())
        assert (await conv.stream(max_tokens=N, temperature=0)).tokens == want
        with pytest.raises(aiollama.InvalidTokenError):
            engine.conversation().prompt(list(conv.tokens))  # placeholders are no token ids


async def test_chat_messages_take_pictures_as_content_parts(tiny_path: Path, mmproj: Path) -> None:
    url = "data:image/png;base64," + base64.b64encode(PICTURE).decode()
    async with Engine(tiny_path, mmproj=mmproj, n_ctx=1024, n_seq_max=4) as engine:
        ways = [[{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}],
                ["What is this?", Image(PICTURE)],
                [{"type": "text", "text": "What is this?"}, {"type": "image", "image": Image(PICTURE)}]]
        results = []
        for content in ways:
            conv = engine.conversation()
            results.append(await conv.chat([{"role": "user", "content": content}], max_tokens=N, temperature=0))
            assert sum(t < 0 for t in conv.tokens) == N_IMAGE_TOKENS
        assert results[0].tokens == results[1].tokens == results[2].tokens
        # the same turn as text with the picture given by hand between the template's pieces
        text = engine.render_chat([{"role": "user", "content": "What is this?\ue004"}])
        before, after = text.split("\ue004")
        by_hand = engine.conversation(cache_salt="by hand")
        by_hand.prompt([before, Image(PICTURE), after], special=True)
        assert by_hand.tokens == conv.tokens[:len(by_hand)]
        for bad in ([{"type": "audio"}], ["a", 3], ["\ue003"]):
            with pytest.raises(ChatTemplateError):
                engine.conversation().chat([{"role": "user", "content": bad}])
        # a second turn with another picture appends after the first turn's reply
        await conv.chat([{"role": "user", "content": ["And this?", Image(OTHER)]}], max_tokens=N, temperature=0)
        assert sum(t < 0 for t in conv.tokens) == 2 * N_IMAGE_TOKENS


def test_the_server_reads_image_url_parts(tiny_path: Path, mmproj: Path) -> None:
    url = "data:image/png;base64," + base64.b64encode(PICTURE).decode()
    server = Server(tiny_path, "--n-ctx", "1024", "--n-seq-max", "2", "--log-level", "warning", "--mmproj", str(mmproj))
    try:
        def chat(content: Any) -> tuple[int, Any]:
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
            status, _, answer = server.post("/v1/chat/completions", json.dumps(body).encode())
            return status, answer

        parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
        status, first = chat(parts)
        assert status == 200, first
        status, second = chat(parts)
        assert status == 200 and second["choices"][0]["message"] == first["choices"][0]["message"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == second["usage"]["prompt_tokens"] - 1
        assert second["usage"]["prompt_tokens"] > N_IMAGE_TOKENS
        for bad, param in (([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
                            "messages[0].content[0].image_url"),
                           ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                            "messages[0].content[0].image_url"),
                           ([{"type": "image_url", "image_url": {"url": "ftp://x"}}], "messages[0].content[0].image_url"),
                           ([{"type": "input_audio"}], "messages[0].content[0]")):
            status, answer = chat(bad)
            assert status == 400 and answer["error"]["param"] == param, answer
        status, again = chat(parts)  # and it keeps serving
        assert status == 200 and again["choices"][0]["message"] == first["choices"][0]["message"]
    finally:
        server.stop()


def test_placeholders_runs_and_whole_pictures() -> None:
    from aiollama.formats.images import placeholders, runs
    from aiollama.sched.images import ImageStore, whole, whole_take
    from aiollama.sched.speculation import draft

    a, b = placeholders(1, 4), placeholders(2, 3)
    assert [image_row(t) for t in a] == [(1, 0), (1, 1), (1, 2), (1, 3)]
    tokens = [5, 6, *a, *b, 7]
    assert list(runs(tokens)) == [(0, 2, False), (2, 9, True), (9, 10, False)]
    assert whole(tokens, 0, 4) == 2  # inside picture 1: back to its first row
    assert whole(tokens, 0, 6) == 6  # between the two pictures
    assert whole(tokens, 3, 4) == 3  # begins inside the picture it would cut
    assert whole_take(tokens, 2, 2, room=10) == 4  # a picture at the start goes whole...
    assert whole_take(tokens, 2, 2, room=3) == 0  # ...if the step has room for it
    assert whole_take(tokens, 0, 5, room=10) == 2
    assert draft([9, 8, *a, 9, 8], 4) == ()  # a draft stops before a picture's rows
    assert draft([9, 8, 7, *a, 9, 8], 4) == (7,)
    store = ImageStore()
    store.add(1, {1: "rows of 1"})
    store.fork(1, 2)
    store.add(2, {2: "rows of 2"})
    store.drop(1)
    assert store.rows == {1: "rows of 1", 2: "rows of 2"} and store.held(2) == {1, 2}
    store.drop(2)
    assert store.rows == {}


def test_the_messages_and_responses_apis_and_fetched_urls_read_pictures(tiny_path: Path, mmproj: Path) -> None:
    import http.server
    import threading

    class Picture(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/cat.png" else 404)
            self.end_headers()
            if self.path == "/cat.png":
                self.wfile.write(PICTURE)

        def log_message(self, *args: Any) -> None:
            pass

    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Picture)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    here = f"http://127.0.0.1:{files.server_address[1]}"
    data = base64.b64encode(PICTURE).decode()
    server = Server(tiny_path, "--n-ctx", "1024", "--n-seq-max", "2", "--log-level", "warning", "--mmproj", str(mmproj),
                    "--fetch-images", "--fetch-private-addresses")  # the picture is served on this machine
    try:
        def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
            status, _, answer = server.post(path, json.dumps(body).encode())
            return status, answer

        def chat(url: str) -> tuple[int, Any]:
            return post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}],
                "max_tokens": 4, "temperature": 0})

        status, by_data = chat("data:image/png;base64," + data)
        assert status == 200, by_data
        status, fetched = chat(here + "/cat.png")
        assert status == 200 and fetched["choices"][0]["message"] == by_data["choices"][0]["message"]
        status, missing = chat(here + "/dog.png")
        assert status == 400 and missing["error"]["param"] == "messages[0].content[1].image_url"
        blocks = [{"type": "text", "text": "What is this?"},
                  {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]
        status, counted = post("/v1/messages/count_tokens",
                               {"model": "m", "messages": [{"role": "user", "content": blocks}]})
        assert status == 200 and counted["input_tokens"] > N_IMAGE_TOKENS
        status, message = post("/v1/messages", {"model": "m", "max_tokens": 4, "temperature": 0,
                                                 "messages": [{"role": "user", "content": blocks}]})
        usage = message["usage"]  # Anthropic's input_tokens leave out what the cache held
        assert status == 200 and usage["input_tokens"] + usage["cache_read_input_tokens"] == counted["input_tokens"]
        status, bad = post("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "x"}}]}]})
        assert status == 400 and bad["error"]["type"] == "invalid_request_error"
        status, response = post("/v1/responses", {"max_output_tokens": 4, "temperature": 0, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                         {"type": "input_image", "image_url": "data:image/png;base64," + data}]}]})
        assert status == 200 and response["usage"]["input_tokens"] > N_IMAGE_TOKENS, response
    finally:
        server.stop()
        files.shutdown()
        files.server_close()


async def test_a_hybrid_model_takes_pictures_too(smollm2_path: Path, mmproj: Path) -> None:
    """LFM2 (short convolutions beside attention): a picture prompt, a prefix hit on it, a fork and a
    rewind to the prompt's end give llama.cpp's own tokens; the recurrent state goes back to the
    checkpoint at the prompt's end."""
    from tiny_model import lfm2_model

    path = lfm2_model(aiollama.cache_dir() / "test-models", smollm2_path)
    want = _reference(path, mmproj, PICTURE)
    async with Engine(path, mmproj=mmproj, n_ctx=512, n_seq_max=4, step_tokens=6) as engine:
        conv = engine.conversation()
        conv.prompt(_prompt())
        assert (await conv.stream(max_tokens=N, temperature=0)).tokens == want
        again = engine.conversation()
        again.prompt(_prompt())
        got = await again.stream(max_tokens=N, temperature=0)
        assert got.tokens == want and got.stats.cached_tokens > N_IMAGE_TOKENS
        conv.rewind(N)
        assert (await conv.stream(max_tokens=N, temperature=0)).tokens == want


async def test_a_saved_conversation_carries_its_pictures(tiny_path: Path, mmproj: Path, tmp_path: Path) -> None:
    """Saved with its pictures' rows, loaded into another engine that numbers pictures otherwise
    (it saw another one first): the same history, the same continuation, with the cells restored or
    evaluated again from the saved rows."""
    path = tmp_path / "pictured.aiollama"
    async with Engine(tiny_path, mmproj=mmproj, n_ctx=512, n_seq_max=4) as engine:
        conv = engine.conversation()
        conv.prompt(_prompt())
        await conv.stream(max_tokens=N, temperature=0)
        await conv.save(path)
        conv.prompt(" And then?")
        want = (await conv.stream(max_tokens=N, temperature=0)).tokens
        text = engine.detokenize(conv.tokens)
    for host in (2**30, 0):
        async with Engine(tiny_path, mmproj=mmproj, n_ctx=256, n_seq_max=4, host_cache_bytes=host) as engine:
            other = engine.conversation()
            other.prompt(_prompt(OTHER))  # this engine's picture number 0 is another picture
            loaded = await engine.load(path)
            assert [image_row(t)[0] for t in loaded.tokens if t < 0] == [1] * N_IMAGE_TOKENS
            if not host:  # others take the cells, and the loaded one evaluates all again, from the saved rows
                others = [engine.conversation() for _ in range(3)]
                for c in others:
                    c.prompt(_prompt(OTHER))
                await _all([c.stream(max_tokens=150, temperature=0) for c in others])
            loaded.prompt(" And then?")
            got = await loaded.stream(max_tokens=N, temperature=0)
            assert got.tokens == want and engine.detokenize(loaded.tokens) == text
            assert (got.stats.prompt_evaluated > N_IMAGE_TOKENS) == (not host)
    async with Engine(tiny_path, n_ctx=512, n_seq_max=2) as plain:
        with pytest.raises(ImageError, match="projector"):
            await plain.load(path)
        assert plain.statistics().live == 0


def test_an_embedding_batch_refuses_what_it_cannot_hold() -> None:
    from aiollama.errors import InvalidBatchError

    with Batch(8, n_embd=4) as rows, Batch(8) as tokens:
        rows.add_embeddings(np.zeros((3, 4), np.float32), 0, 0)
        assert len(rows) == 3
        for bad in (np.zeros((2, 5), np.float32), np.zeros((2, 4), np.float64), np.zeros(4, np.float32), [[0.0] * 4]):
            with pytest.raises(InvalidBatchError):
                rows.add_embeddings(bad, 3, 0)
        with pytest.raises(InvalidBatchError, match="position gap"):
            rows.add_embeddings(np.zeros((1, 4), np.float32), 7, 0)
        with pytest.raises(InvalidBatchError, match="full"):
            rows.add_embeddings(np.zeros((6, 4), np.float32), 3, 0)
        with pytest.raises(InvalidBatchError, match="holds embeddings"):
            rows.add_tokens([1, 2], 3, 0)
        with pytest.raises(InvalidBatchError, match="holds tokens"):
            tokens.add_embeddings(np.zeros((1, 4), np.float32), 0, 0)
        assert len(rows) == 3 and len(tokens) == 0


def test_a_projector_closed_while_another_thread_encodes_ends_that_thread_cleanly(tiny: Model, mmproj: Path) -> None:
    import threading

    from aiollama.errors import ClosedError

    proj = Projector(tiny, mmproj)
    outcome: list[BaseException | int] = []
    busy = threading.Event()

    def encode_until_closed() -> None:
        n = 0
        try:
            while True:
                proj.encode(PICTURE)
                n += 1
                if n == 5:
                    busy.set()
        except ClosedError as exc:
            outcome.append(exc)
        except BaseException as exc:  # pragma: no cover - reported below
            outcome.append(exc)
            raise

    worker = threading.Thread(target=encode_until_closed)
    worker.start()
    assert busy.wait(30)
    proj.close()  # frees it between two encodes, never inside one
    worker.join(timeout=30)
    assert not worker.is_alive() and len(outcome) == 1 and isinstance(outcome[0], ClosedError)


async def test_an_engine_refuses_a_projector_it_cannot_use(tiny_path: Path, mmproj: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no projector file"):
        async with Engine(tiny_path, mmproj=tmp_path / "missing.gguf", n_ctx=256):
            pass
    with pytest.raises(ModelLoadError):
        async with Engine(tiny_path, mmproj=tiny_path, n_ctx=256):  # a text model is no projector
            pass
    with pytest.raises(aiollama.UnsupportedModel, match="draft model"):
        async with Engine(tiny_path, mmproj=mmproj, draft_model=tiny_path, n_ctx=256):
            pass
    with pytest.raises(aiollama.InvalidRequestError, match="mmproj"):
        Engine(tiny_path, mmproj=42)
    async with Engine(tiny_path, mmproj=mmproj, n_ctx=256) as engine:  # and a good one still loads
        conv = engine.conversation(_prompt())
        assert len((await conv.stream(max_tokens=2, temperature=0)).tokens) == 2


def test_a_whole_picture_waits_for_a_step_with_room_for_it() -> None:
    from aiollama.formats.images import placeholders
    from aiollama.sched.scheduler import Scheduler, SchedulerConfig
    from aiollama.sched.step import Sampled, StepResult, StepStatus

    sched = Scheduler(SchedulerConfig(n_ctx=256, n_seq_max=4, n_batch=16, step_tokens=16, whole_images=True))
    sched.add(1, [5, 6, 7])
    sched.submit(1)
    sched.update(plan := sched.schedule(), StepResult(StepStatus.OK, (Sampled(1, 9, b"", False),)))
    assert plan.slices[0].tokens == (5, 6, 7)
    sched.add(2, placeholders(0, 16) + [8])  # 16 rows: with conversation 1's row, no step has room
    sched.add_images(2, {0: ["row"] * 16})
    sched.submit(2)
    for _ in range(3):
        plan = sched.schedule()
        assert [s.conv for s in plan.slices] == [1] and all(s.tokens for s in plan.slices)
        sched.update(plan, StepResult(StepStatus.OK, (Sampled(1, 9, b"", False),)))
    sched.finish(1)
    plan = sched.schedule()  # now the whole picture goes in one step
    assert [(s.conv, len(s.tokens)) for s in plan.slices] == [(2, 16)]
