"""Fault injection: recoverable llama_decode codes are absorbed; a fatal fault anywhere on the decode
thread reaches every stream and the engine's exit as EngineDead; a closed event loop or a closed
engine ends its streams. Nothing may hang: every test runs under a timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from helpers import GREEDY, decode_threads, gather, solo, wait_for

from aiollama import Engine, EngineConfig, EngineDead
from aiollama.native import Batch, Context, DecodeStatus, open_handles
from aiollama.runner.executor import NativeExecutor
from aiollama.sched.scheduler import Scheduler

pytestmark = pytest.mark.anyio

TIMEOUT = 60


class FaultyExecutor(NativeExecutor):
    """The real executor, with llama_decode's return code replaced by ``fault`` when it says so
    (nothing is decoded then, as for NO_KV_SLOT)."""

    fault: Callable[[int], DecodeStatus | None] = staticmethod(lambda call: None)  # type: ignore[assignment]

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, config.model_path)  # type: ignore[arg-type]
        self.calls = 0

    def _decode(self, batch: Batch, on_decode: Callable[[], None] | None) -> DecodeStatus:
        self.calls += 1
        injected = type(self).fault(self.calls)
        return injected if injected is not None else super()._decode(batch, on_decode)


@pytest.mark.parametrize("code", [DecodeStatus.NO_KV_SLOT, DecodeStatus.ABORTED])
async def test_recoverable_decode_codes_are_absorbed(tiny_path: Path, code: DecodeStatus,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = ["First of three", "Second of three", "Third of three"]
    expected = [(await solo(tiny_path, p, max_tokens=12, **GREEDY)).tokens for p in prompts]
    calls: list[int] = []

    def every_third(call: int) -> DecodeStatus | None:
        calls.append(call)
        return code if call % 3 == 0 else None

    monkeypatch.setattr(FaultyExecutor, "fault", staticmethod(every_third))
    with anyio.fail_after(TIMEOUT):
        async with Engine(tiny_path, n_ctx=1024, n_seq_max=4, executor=FaultyExecutor) as engine:
            outs = await gather(*(engine.conversation(p).stream(max_tokens=12, **GREEDY) for p in prompts))
    assert len(calls) >= 12
    assert [o.tokens for o in outs] == expected


def _fatal_code(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FaultyExecutor, "fault", staticmethod(lambda call: DecodeStatus.COMPUTE_FAILED))


def _decode_raises(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Context, batch: object, wake: object = ()) -> object:
        raise RuntimeError("simulated backend failure")

    monkeypatch.setattr(Context, "decode", broken)


def _scheduler_raises(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Scheduler, *args: object) -> object:
        raise RuntimeError("simulated scheduler bug")

    monkeypatch.setattr(Scheduler, "schedule", broken)


@pytest.mark.parametrize(
    ("inject", "message"),
    [(_fatal_code, "COMPUTE_FAILED"), (_decode_raises, "simulated backend"),
     (_scheduler_raises, "simulated scheduler")],
    ids=["fatal-decode-code", "decode-raises", "scheduler-raises"],
)
async def test_a_fatal_fault_reaches_every_stream_and_the_exit(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch,
    inject: Callable[[Engine, pytest.MonkeyPatch], None], message: str,
) -> None:
    before = open_handles()
    body_done = False
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(EngineDead, match=message):  # raised by leaving the block
            async with Engine(tiny_path, n_ctx=1024, n_seq_max=4, executor=FaultyExecutor) as engine:
                streams = [engine.conversation(f"doomed {i}").stream(max_tokens=100_000, **GREEDY)
                           for i in range(6)]  # 4 running, 2 waiting for a seq id
                await wait_for(engine, lambda s: s.active == 4 and s.queued == 2)
                inject(engine, monkeypatch)
                for s in streams:
                    with pytest.raises(EngineDead, match=message):
                        await s
                with pytest.raises(EngineDead):
                    engine.conversation("after")
                body_done = True
    assert body_done
    assert not engine.serving and decode_threads() == []
    assert open_handles() == before
    with pytest.raises(EngineDead):
        await engine.aclose()  # it stays dead


async def test_a_fault_while_starting_a_stream_answers_that_stream(tiny_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The command the decode thread fails on has left the queue: its caller is answered too."""
    def broken(self: FaultyExecutor, *args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated sampler bug")

    with anyio.fail_after(TIMEOUT):
        with pytest.raises(EngineDead, match="simulated sampler"):
            async with Engine(tiny_path, n_ctx=1024, n_seq_max=4, executor=FaultyExecutor) as engine:
                conv = engine.conversation("hello")
                monkeypatch.setattr(FaultyExecutor, "start_sampling", broken)
                with pytest.raises(EngineDead, match="simulated sampler"):
                    await conv.stream(max_tokens=4)
    assert decode_threads() == []


def _run_script(code: str, model: Path) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter (warnings are errors) and return what it printed as JSON."""
    proc = subprocess.run([sys.executable, "-X", "dev", "-W", "error", "-c", textwrap.dedent(code), str(model)],
                          capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir())
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stderr"] = proc.stderr
    return result


SHUTDOWN = """
    import json, sys, threading
    import anyio
    from aiollama import Engine, EngineClosed
    from aiollama.native import open_handles

    async def consume(stream, out):
        n = 0
        try:
            async for chunk in stream:
                n += len(chunk.tokens)
            out.append("finished")
        except EngineClosed:
            out.append("EngineClosed" if n else "EngineClosed before a token")

    async def main():
        out = []
        async with anyio.create_task_group() as tg:
            async with Engine(sys.argv[1], n_ctx=2048, n_seq_max=16) as engine:
                for i in range(16):
                    stream = engine.conversation(f"stream {i}").stream(max_tokens=100_000, temperature=0.0,
                                                                      ignore_eos=True)
                    tg.start_soon(consume, stream, out)
                while engine.statistics().tokens_generated < 16 * 8:
                    await anyio.sleep(0.01)
        threads = [t.name for t in threading.enumerate() if t.name.startswith("aiollama")]
        print(json.dumps({"streams": sorted(out), "decode_threads": threads, "handles": open_handles()}))

    anyio.run(main)
"""


async def test_shutdown_with_running_streams_exits_cleanly(tiny_path: Path) -> None:
    result = await anyio.to_thread.run_sync(_run_script, SHUTDOWN, tiny_path)
    assert result["streams"] == ["EngineClosed"] * 16
    assert result["decode_threads"] == []
    assert result["handles"] == {}
    assert result["stderr"] == ""


LOOP_CLOSES = """
    import asyncio, json, sys, threading, time
    from aiollama import Engine
    from aiollama.native import open_handles

    engine = Engine(sys.argv[1], n_ctx=1024, n_seq_max=4)
    tasks = []

    async def consume(stream):
        async for _ in stream:
            pass

    async def start():
        await engine.start()
        for i in range(4):
            stream = engine.conversation(f"orphan {i}").stream(max_tokens=100_000, temperature=0.0, ignore_eos=True)
            tasks.append(asyncio.ensure_future(consume(stream)))
        while engine.statistics().tokens_generated < 4 * 8:
            await asyncio.sleep(0.01)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(start())
    loop.close()  # the consumers are still pending: the loop vanishes under running streams
    deadline = time.monotonic() + 20
    while engine.statistics().active and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = engine.statistics()
    engine.close_nowait()  # the owner of an orphaned engine can still stop it from any thread
    deadline = time.monotonic() + 20
    while any(t.name == "aiollama-decode" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    threads = [t.name for t in threading.enumerate() if t.name.startswith("aiollama")]
    tasks.clear()
    print(json.dumps({"active": stats.active, "queued": stats.queued, "decode_threads": threads,
                      "handles": open_handles()}))
"""


async def test_a_closed_event_loop_ends_its_streams(tiny_path: Path) -> None:
    result = await anyio.to_thread.run_sync(_run_script, LOOP_CLOSES, tiny_path)
    assert (result["active"], result["queued"]) == (0, 0)
    assert result["decode_threads"] == []
    assert result["handles"] == {}
