"""The blocking facade: plain threads share one engine and its decode steps."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from aiollama import EngineClosed, SyncEngine


def test_eight_threads_share_decode_steps(tiny_path: Path) -> None:
    n_threads, n_tokens = 8, 32
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    with SyncEngine(tiny_path, n_ctx=2048, n_seq_max=8) as engine:
        barrier = threading.Barrier(n_threads)

        def worker(i: int) -> None:
            try:
                with engine.conversation(f"Thread {i} writes:") as conv:
                    barrier.wait()
                    results[i] = [t for chunk in conv.stream(max_tokens=n_tokens, temperature=0.0,
                                                            ignore_eos=True) for t in chunk.tokens]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        stats = engine.statistics()
    assert not errors
    assert all(len(r) == n_tokens for r in results.values()) and len(results) == n_threads
    # one at a time would take 8 x 32 steps; shared steps take about 32 plus prompt steps
    assert stats.decode_steps < n_threads * n_tokens / 2


def test_sync_stream_result_cancel_and_close(tiny_path: Path) -> None:
    with SyncEngine(tiny_path, n_ctx=1024, n_seq_max=2) as engine:
        conv = engine.conversation("Hello")
        assert len(conv.stream(max_tokens=4, temperature=0.0, ignore_eos=True).result().tokens) == 4
        stream = conv.stream(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        next(iter(stream))
        stream.cancel()
        assert stream.result().finish_reason == "cancelled"
        parallel = engine.generate_parallel(["a", "b", "c"], max_tokens=3, seed=1)
        assert [len(c.tokens) for c in parallel] == [3, 3, 3]
        conv.close()
        assert engine.statistics().live == 0
    with pytest.raises(EngineClosed):
        engine.conversation()
