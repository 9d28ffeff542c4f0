"""An application that leaks an HTTP client, then streams from an engine in the same event loop.

    python tests/leaky_app.py MODEL {asyncio,trio,thread}

It serves a tiny OpenAI-shaped HTTP API on a local socket, makes three requests with the ``openai``
package's ``AsyncOpenAI`` client and drops the client without closing it (as applications often
do), collects it, and only then starts an engine and streams from it: on the event loop itself
(``asyncio``, ``trio``) or with the blocking API from a worker thread (``thread``). The collected
client's sockets are closed by the collector, their transports are closed later, and asyncio
removes their readers by descriptor number then, whatever took that number meanwhile.
Prints ``ok N`` and exits 0 once the stream ends; exits 1 if it does not end within 60 s.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio

import aiollama

TIMEOUT = 60


class _Models(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        body = json.dumps({"object": "list", "data": [
            {"id": "m", "object": "model", "created": 0, "owned_by": "me"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


async def leak_a_client(url: str) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    for _ in range(3):
        await client.models.list()
    del client  # never closed
    gc.collect()


def stream_blocking(model: str) -> int:
    with aiollama.SyncEngine(model, n_ctx=512, n_seq_max=2) as engine:
        return len(engine.conversation("Once upon a time").stream(max_tokens=8, temperature=0).result().tokens)


async def main(model: str, how: str) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        await leak_a_client(f"http://127.0.0.1:{server.server_address[1]}/v1")
        with anyio.fail_after(TIMEOUT):
            if how == "thread":
                n = await anyio.to_thread.run_sync(stream_blocking, model)
            else:
                async with aiollama.Engine(model, n_ctx=512, n_seq_max=2) as engine:
                    completion = await engine.conversation("Once upon a time").stream(max_tokens=8, temperature=0)
                    n = len(completion.tokens)
        print("ok", n, flush=True)
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    warnings.simplefilter("ignore", ResourceWarning)  # the leak is the point
    model_path, backend = sys.argv[1], sys.argv[2]
    try:
        anyio.run(main, model_path, backend, backend="trio" if backend == "trio" else "asyncio")
    except TimeoutError:
        print("the stream did not end", flush=True)
        sys.exit(1)
