"""``aiollama serve``'s runner: the heap that startup built is frozen before serving begins."""

from __future__ import annotations

import gc
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from aiollama.server.run import _Server


def test_serving_freezes_the_heap_that_startup_built() -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    built_before = [object()]  # a container the collector tracks
    assert any(o is built_before for o in gc.get_objects())
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("up"))])
    server = _Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"), app, 1.0)
    thread = threading.Thread(target=server.run, daemon=True)  # not the main thread: no signal handlers
    thread.start()
    try:
        deadline = time.monotonic() + 30
        # started sets uvicorn's flag, then freezes (before the loop can take a request)
        while not gc.get_freeze_count() and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started
        # frozen: the full collections while serving no longer scan it (it is still alive)
        assert gc.get_freeze_count() > 0
        assert not any(o is built_before for o in gc.get_objects())
        made_after = [object()]
        assert any(o is made_after for o in gc.get_objects())  # what serving creates is still collected
    finally:
        server.should_exit = True
        thread.join(30)
        gc.unfreeze()
    assert not thread.is_alive()
