"""Embedding aiollama in a Starlette service (FastAPI is the same: pass ``lifespan=`` to FastAPI).

The app's lifespan owns one Engine for the whole process; every request borrows it. The
OpenAI-compatible API is mounted on the same engine under /openai, so existing OpenAI clients and
the service's own endpoints land in the same batches.

    pip install ".[server]"
    python examples/embed_starlette.py [--port 8000] [MODEL.gguf]
    curl -s localhost:8000/summarize -d '{"text": "Llamas are domesticated South American camelids..."}'
    curl -sN localhost:8000/story -d '{"topic": "a lighthouse keeper"}'
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

import aiollama
from aiollama.server import create_app


def build(model: str | None) -> Starlette:
    # Created here, started by the lifespan: an Engine belongs to the event loop that starts it.
    engine = aiollama.Engine(model, n_ctx=8192, n_seq_max=16, max_queued=256)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine:  # loads the model; leaving it ends running streams and frees everything
            yield

    async def summarize(request: Request) -> Response:
        text = (await request.json()).get("text", "")
        if not isinstance(text, str) or not text:
            return JSONResponse({"error": "'text' must be a non-empty string"}, status_code=400)
        try:
            async with engine.conversation() as conv:
                reply = await conv.chat([{"role": "system", "content": "Summarize in one sentence."},
                                         {"role": "user", "content": text}], max_tokens=64, temperature=0.3)
        except aiollama.Overloaded:
            return JSONResponse({"error": "busy, retry"}, status_code=503, headers={"Retry-After": "1"})
        except aiollama.ContextFull:
            return JSONResponse({"error": "text too long"}, status_code=413)
        return JSONResponse({"summary": reply.text})

    async def story(request: Request) -> Response:
        topic = (await request.json()).get("topic", "a llama")
        conv = engine.conversation()
        stream = conv.chat(f"Tell a short story about {topic}.", max_tokens=200, temperature=0.8)

        async def body() -> AsyncIterator[str]:
            async with conv:  # a client that disconnects cancels the generation within a step
                async for chunk in stream:
                    yield chunk.text

        return StreamingResponse(body(), media_type="text/plain")

    return Starlette(lifespan=lifespan, routes=[
        Route("/summarize", summarize, methods=["POST"]),
        Route("/story", story, methods=["POST"]),
        Mount("/openai", create_app(engine=engine)),  # /openai/v1/chat/completions, /openai/metrics, ...
    ])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(build(args.model), host="127.0.0.1", port=args.port, log_level="warning")
