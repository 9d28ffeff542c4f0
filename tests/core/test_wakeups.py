"""Wake-ups that cannot be lost, and waits that always end.

An application's event loop is shared with everything else it does, leaks included. A transport
whose socket was closed behind its back (collected with its client) still removes "its" reader by
descriptor number when it is finally closed, and a key left in the selector for a closed
descriptor swallows a new registration of that number: a stream woken through a descriptor of its
own would wait forever. And a reader of an engine that ended without answering must learn so.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from fake_executor import FakeExecutor, solo_tokens

from aiollama import Engine, EngineConfig, EngineDead, SyncEngine
from aiollama.core.engine_core import EngineCore
from aiollama.core.loop import DecodeLoop
from aiollama.sched.step import StepStatus

HERE = Path(__file__).resolve().parents[1]  # the tests' helpers
GREEDY: dict[str, Any] = dict(temperature=0.0, ignore_eos=True)
TIMEOUT = 60


@pytest.mark.parametrize("how", ["asyncio", "trio", "thread"])
def test_a_leaked_http_client_does_not_stop_a_stream(tiny_path: Path, how: str) -> None:
    # The reproduction, in its own process: the OpenAI client leaked, collected, then a stream.
    done = subprocess.run([sys.executable, str(HERE / "leaky_app.py"), str(tiny_path), how],
                          capture_output=True, text=True, timeout=2 * TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "ok 8"


class _Leaks:
    """Connections to a local listener whose sockets are closed behind their transports' backs."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.transports: list[asyncio.Transport] = []
        self.peers: list[socket.socket] = []

    async def leak(self, reading: bool) -> None:
        """A connection whose socket closes while its transport lives on: with ``reading``, its
        reader's key stays in the selector for a closed descriptor (a stale key); without, the
        transport will remove a reader under that number when it is closed."""
        loop = asyncio.get_running_loop()
        sock = socket.create_connection(self.listener.getsockname())
        self.peers.append(self.listener.accept()[0])
        transport, _ = await loop.create_connection(asyncio.Protocol, sock=sock)
        if not reading:
            transport.pause_reading()
        sock.close()  # what a collected cycle does to it: the fd number is free for the next open()
        self.transports.append(transport)  # type: ignore[arg-type]

    def close_one(self, rng: random.Random) -> None:
        """A leaked transport is closed at last: it removes its reader by number."""
        if self.transports:
            self.transports.pop(rng.randrange(len(self.transports))).abort()

    def close(self) -> None:
        for transport in self.transports:
            transport.abort()
        for peer in self.peers:
            peer.close()
        self.listener.close()


@contextlib.contextmanager
def leaking() -> Iterator[_Leaks]:
    """Leaks made on the running loop, closed before it ends."""
    leaks = _Leaks()
    try:
        yield leaks
    finally:
        leaks.close()


def asyncio_leaks(test: Any) -> Any:
    """The leaks are asyncio transports; the ResourceWarnings they raise are the point."""
    for mark in (pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"]),
                 pytest.mark.filterwarnings("ignore::ResourceWarning")):
        test = mark(test)
    return test


@asyncio_leaks
async def test_readers_removed_by_number_lose_no_wake(tiny_path: Path) -> None:
    rng = random.Random(0)
    with leaking() as leaks, anyio.fail_after(TIMEOUT):
        for reading in (True, False, True, False):
            await leaks.leak(reading)
        async with Engine(tiny_path, n_ctx=512, n_seq_max=4) as engine:
            convs = [engine.conversation(f"Story number {i}") for i in range(3)]
            streams = [c.stream(max_tokens=6, **GREEDY) for c in convs]
            while leaks.transports:  # every leaked transport removes its reader while streams run
                leaks.close_one(rng)
                await anyio.sleep(0)
            results = [await s for s in streams]
    assert all(len(r.tokens) == 6 for r in results)


@asyncio_leaks
@pytest.mark.parametrize("seed", range(4))
async def test_leaks_interleaved_with_engines_streams_saves_and_loads(tiny_path: Path, tmp_path: Path,
                                                                     seed: int) -> None:
    rng = random.Random(seed)
    expected: dict[str, list[int]] = {}
    saved: list[tuple[Path, int]] = []
    with leaking() as leaks, anyio.fail_after(4 * TIMEOUT):
        for _ in range(3):  # engines started and stopped
            for _ in range(rng.randint(0, 3)):
                await leaks.leak(rng.random() < 0.5)
            async with Engine(tiny_path, n_ctx=1024, n_seq_max=4) as engine:
                for step in range(12):
                    op = rng.choice(["leak", "close_leak", "stream", "stream", "save", "load"])
                    if op == "leak":
                        await leaks.leak(rng.random() < 0.5)
                    elif op == "close_leak":
                        leaks.close_one(rng)
                    elif op == "stream":
                        prompt = f"Prompt {rng.randint(0, 5)}"
                        got = (await engine.conversation(prompt).stream(max_tokens=4, **GREEDY)).tokens
                        assert expected.setdefault(prompt, got) == got  # greedy: the same every time
                    elif op == "save":
                        conv = engine.conversation(f"Saved {step}")
                        await conv.stream(max_tokens=3, **GREEDY)
                        path = tmp_path / f"{len(saved)}.conv"
                        await conv.save(path)
                        saved.append((path, len(conv.tokens)))
                        await conv.aclose()
                    elif op == "load" and saved:
                        path, n = rng.choice(saved)
                        conv = await engine.load(path)
                        assert len(conv.tokens) == n
                        assert len((await conv.stream(max_tokens=2, **GREEDY)).tokens) == 2
                        await conv.aclose()
                    if rng.random() < 0.3:
                        leaks.close_one(rng)


# An engine that ends without answering: the failure is not delivered (as if its thread had been
# killed), and nothing but liveness can end the waits.

def _mute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EngineCore, "fail_all", lambda self, error: None)
    monkeypatch.setattr(DecodeLoop, "_answer_leftovers", lambda self, outbox, error: None)


class _Dies:
    """A fake executor that fails fatally at its fourth decode."""

    def __call__(self, config: EngineConfig) -> FakeExecutor:
        calls = iter(range(1000))
        return FakeExecutor(config, fault=lambda plan: StepStatus.FAILED if next(calls) == 3 else None)


@pytest.mark.anyio
async def test_a_stream_of_an_engine_that_ends_without_answering_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    _mute(monkeypatch)
    engine = Engine(executor=_Dies(), n_ctx=512, n_seq_max=4)
    await engine.start()
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(EngineDead):
            await engine.conversation([1, 2, 3]).stream(max_tokens=50, **GREEDY)
        with pytest.raises(EngineDead):
            await engine.aclose()


def test_a_blocking_stream_of_an_engine_that_ends_without_answering_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    _mute(monkeypatch)
    engine = SyncEngine(executor=_Dies(), n_ctx=512, n_seq_max=4)
    engine.start()
    with pytest.raises(EngineDead):
        engine.conversation([1, 2, 3]).stream(max_tokens=50, **GREEDY).result()
    with pytest.raises(EngineDead):
        engine.close()


@pytest.mark.anyio
async def test_streams_still_flow_through_fake_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    # the wake path without a model: many short steps, every chunk delivered in order
    async with Engine(executor=FakeExecutor, n_ctx=512, n_seq_max=4) as engine:
        with anyio.fail_after(TIMEOUT):
            got = await engine.conversation([5, 6, 7]).stream(max_tokens=40, **GREEDY)
    assert list(got.tokens) == solo_tokens([5, 6, 7], 40)

