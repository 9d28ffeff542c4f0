"""Running the app under uvicorn with a graceful shutdown that ends in answers, not cut connections."""

from __future__ import annotations

import asyncio
import gc
import math
import socket
from types import FrameType

import uvicorn
from starlette.applications import Starlette


class _Server(uvicorn.Server):
    """On SIGTERM or SIGINT uvicorn stops accepting and waits for running requests. When the grace
    period ends, this closes the app's engine: streams still running end with an error event and
    requests still waiting get a 503, and only then do the connections close."""

    def __init__(self, config: uvicorn.Config, app: Starlette, grace: float) -> None:
        super().__init__(config)
        self._app, self._grace, self._deadline_set = app, grace, False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            freeze_startup_heap()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if not self._deadline_set:
            self._deadline_set = True
            loop = asyncio.get_event_loop()  # the signal handler runs on the thread of the serving loop
            loop.call_soon_threadsafe(loop.call_later, self._grace, self._end_running)

    def _end_running(self) -> None:
        asyncio.get_event_loop().create_task(self._app.state.aiollama.close_engine())


def freeze_startup_heap() -> None:
    """Move what startup built (the modules and the app: most of what a server holds) out of the
    collector's sight, after collecting what is garbage already.
    A full collection of the cyclic garbage collector otherwise scans all of it while holding the
    GIL, which stops the decode thread and every stream with it: in a server of the default model,
    about 55k objects and 27-34 ms a collection on a 2-core machine (vLLM's server does the same
    after its start). What serving creates is still collected."""
    gc.collect()
    gc.freeze()


def serve(app: Starlette, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          grace: float = 30.0) -> None:
    """Serve ``app`` (from ``create_app``) until SIGTERM/SIGINT, then drain for ``grace`` seconds.
    The process's heap as it stands once the app has started is frozen (:func:`freeze_startup_heap`):
    this takes over the process, as ``aiollama serve`` does."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=math.ceil(grace) + 10)  # a backstop: the engine ends first
    _Server(config, app, grace).run()
