"""The CPU benchmarks' own code paths, run briefly, so that a script nobody ran since a change to
the engine fails here rather than on the day its figures are wanted."""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
from pathlib import Path

import anyio
import pytest

import aiollama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import overhead  # noqa: E402
import steady  # noqa: E402


def test_the_overhead_benchmarks_null_executor_drives_an_engine() -> None:
    r = anyio.run(overhead.engine_alone, 1)
    assert set(r["levels"]) == {str(n) for n in overhead.LEVELS}
    assert all(level["steps"] >= overhead.TOKENS for level in r["levels"].values())


@pytest.mark.anyio
async def test_arrivals_straight_into_an_engine_count_every_token(tiny_path: Path) -> None:
    async with aiollama.Engine(tiny_path, n_ctx=2048, n_seq_max=steady.CLIENTS, kv_unified=False) as engine:
        first = await steady.engine_arrivals(engine, engine.n_vocab, 0.5, banned=[])
        second = await steady.engine_arrivals(engine, engine.n_vocab, 0.5, banned=[], first=10_000)
    assert first > 0 and second > 0


def test_a_request_spanning_windows_is_shared_among_them() -> None:
    per_window = [0.0, 0.0, 0.0]
    steady.spread(per_window, 0.5, 2.5, 1.0, 40)  # 0.5 s in the first window, 1 s in the second, 0.5 in the third
    assert per_window == pytest.approx([10.0, 20.0, 10.0])


@pytest.mark.parametrize("script", sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")))
def test_every_benchmark_script_imports(script: str) -> None:
    """A module a script imports that moved or was renamed fails here, not on the day of the run."""
    importlib.import_module(script)


def test_the_reply_parsing_benchmark_reads_a_short_reply_both_ways() -> None:
    import reply_parsing
    for template, tools, text in reply_parsing.cases(200).values():
        assert len(reply_parsing.run(template, tools, text, splice=True)) == 4


def test_the_overhead_benchmarks_simulated_device_takes_its_time() -> None:
    host = {str(n): {"outside_us": 100.0} for n in overhead.DEVICE_LEVELS}
    r = anyio.run(overhead.simulated_device, 1, host)
    assert set(r["levels"]) == {str(n) for n in overhead.DEVICE_LEVELS}
    assert all(row["step_us"] >= 1e6 * overhead.DEVICE_SECONDS for row in r["levels"].values())
    # overlapped, a step still waits for the device: only the host's work can hide behind it
    assert all(row["overlapped_us"] >= 1e6 * overhead.DEVICE_SECONDS for row in r["levels"].values())


def test_the_overhead_benchmark_samples_on_one_thread_and_on_all(tiny_path: Path) -> None:
    r = overhead.sampler_threads(tiny_path, 2, levels=(2, 4), steps=2)
    assert set(r["levels"]) == {"2", "4"} and all(set(row) == {"1", "2"} for row in r["levels"].values())


def test_the_overhead_benchmark_times_each_phase_and_puts_the_methods_back() -> None:
    before = overhead.Scheduler.schedule
    r = anyio.run(overhead.phases, 4)
    assert overhead.Scheduler.schedule is before
    assert set(r["plain"]) >= set(overhead.PHASES) and r["overlapped"]["collect"] > 0


def test_results_of_a_second_run_on_one_day_go_beside_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    r = {"date": "2026-01-02", "machine": {"cpus": 3}, "run": 1}
    common.save_results(r, "scenario", "first\n")
    common.save_results({**r, "run": 2}, "scenario", "second\n")
    common.save_results({**r, "run": 3}, "scenario", "third\n")
    names = sorted(p.name for p in tmp_path.iterdir())
    stem = f"2026-01-02-{platform.machine()}-3cpu-scenario"
    assert names == sorted(f"{stem}{n}.{e}" for n in ("", "-2", "-3") for e in ("json", "md"))
    assert (tmp_path / f"{stem}.md").read_text() == "first\n"
    assert json.loads((tmp_path / f"{stem}-3.json").read_text())["run"] == 3
    assert capsys.readouterr().out.split() == ["first", "second", "third"]
    # a run that saves partial results first replaces them with its whole results, and only them
    stem = common.save_results({**r, "run": 4}, "scenario", "partial\n")
    assert common.save_results({**r, "run": 4}, "scenario", "whole\n", stem=stem) == stem
    assert (tmp_path / f"{stem}.md").read_text() == "whole\n" and len(list(tmp_path.iterdir())) == 8


def test_thread_cpu_reads_each_threads_own_time() -> None:
    import threading
    import time

    import common

    me = threading.get_native_id()
    before = common.thread_cpu(os.getpid())
    assert me in before and all(seconds >= 0.0 for seconds in before.values())
    deadline = time.monotonic() + 30.0
    while common.thread_cpu(os.getpid())[me] <= before[me] and time.monotonic() < deadline:
        sum(range(10_000))  # busy on this thread until its clock ticks
    assert common.thread_cpu(os.getpid())[me] > before[me]
    gone = max(int(p) for p in os.listdir("/proc") if p.isdigit()) + 1_000_000  # above any pid in use
    assert common.thread_cpu(gone) == {}  # a process that is not there: nothing, no error


def test_back_to_back_pairs_run_the_base_just_before_the_variant() -> None:
    import common

    order: list[str] = []
    rates = iter([100.0, 90.0, 50.0, 60.0])

    def run(name: str, taken: float) -> common.Rate:
        async def go() -> tuple[float, float]:
            order.append(name)
            return next(rates), taken
        return go

    ratios, bases, taken = anyio.run(common.back_to_back, 2, run("base", 0.0), run("variant", 0.25))
    assert order == ["base", "variant", "base", "variant"]
    assert ratios == [0.9, 1.2] and bases == [100.0, 50.0] and taken == 0.25


@pytest.mark.anyio
async def test_the_lone_benchmark_streams_an_engine_in_its_own_process(tiny_path: Path) -> None:
    import lone
    cpu: dict[int, float] = {}
    async with aiollama.Engine(tiny_path, n_ctx=512, n_seq_max=lone.SLOTS) as engine:
        contender = lone.in_process(engine)
        timing = await lone.one(contender, list(range(100, 100 + lone.PROMPT)), 3, cpu)
    assert contender[1] == os.getpid()
    assert len(timing.arrivals) == lone.NEW and timing.start < timing.first  # the end of generation ignored
    if platform.system() == "Linux":
        assert len(cpu) >= 2  # this process's threads were read, the decode thread's among them


def test_the_lone_benchmarks_table_reads_results_without_the_engine_in_process() -> None:
    import lone
    row = {"itl_median_ms": 5.0, "itl_p90_ms": 6.0, "ttft_median_ms": 12.0, "decode_tps": 200.0,
           "cpu_us_per_token_busiest_two": 9000.0, "cpu_us_per_token_others": 150.0}
    old = {"model": "m.gguf", "aiollama": row, "llama-server": row, "itl_ratio": 1.0, "tps_ratio": 1.0}
    new = {**old, "model": "n.gguf", "in process": row, "inproc_itl_ratio": 0.98, "inproc_tps_ratio": 1.02}
    text = lone.markdown({"date": "2026-12-07", "machine": {"cpu": "x", "cpus": 2}, "requests": 1, "threads": 2,
                          "models": [old, new]})
    assert "| m.gguf | in process |" not in text and "| n.gguf | in process |" in text
    assert "| m.gguf | 1.000 | 1.000 | nan | nan |" in text and "| n.gguf | 1.000 | 1.000 | 0.980 | 1.020 |" in text
