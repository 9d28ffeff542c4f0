"""The decode thread's own cost per step, in microseconds: per step and per stream.

    pip install ".[bench]" && python benchmarks/overhead.py             # more than 25 minutes on 2 cores
    python benchmarks/overhead.py --no-models                           # under a minute: parts 1 and 3

1. The engine alone: an executor that decodes nothing and answers every row at once (no model),
   so each step's time is the engine's: planning, the finish rules, delivery to the event loop,
   statistics, with the consumers reading their streams on the event loop meanwhile (they share
   the GIL with the decode thread). Fitted as ``a + b x streams`` over 1 to 256 streams.
2. A real model: the time outside ``llama_decode`` per step with SmolLM2 (and the fast random
   model of ``benchmarks/run.py``), from the engine's own step timers (a step's time includes the
   delivery and statistics after its sampling); this adds sampling (the chains, shared out over
   the decode's threads) to part 1. Beside each level, the event loop's CPU time per step (the
   consumers' side, on the thread that runs this script): on a machine whose cores all decode, it
   is taken from the decode.
   The fast models run 8 to 256 streams, with the 49k and the 262k vocabulary: sampling over a
   row grows with the vocabulary.
3. A simulated device: the executor of part 1 whose every decode takes a set time with the GIL
   released, started by ``submit`` and waited for by ``collect`` (as a GPU's is), beside the host's
   step time of part 1 at the same level: a plain step takes host + device, an overlapped one
   (``overlap=True``) runs the last step's finish rules and delivery while the device computes.
   And the sampler's pool: n rows of one decode sampled on 1 thread and on all of them.
4. After a decode: the same rows sampled right after ``llama_decode`` and again at once. On a CPU
   a decode streams the weights through the caches, so the first call finds none of its code and
   data there; the difference is what every step's Python and sampling pay on top of part 1.

Results go to benchmarks/results/<date>-<machine>-<cpus>cpu-overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import anyio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import fast_model  # noqa: E402
from common import machine, prompts, save_results  # noqa: E402
from fake_executor import ByteTokenizer  # noqa: E402

import aiollama  # noqa: E402
from aiollama.config import EngineConfig  # noqa: E402
from aiollama.core.engine_core import EngineCore  # noqa: E402
from aiollama.core.generations import Generations  # noqa: E402
from aiollama.native import Batch, Context, Model, math_cpus  # noqa: E402
from aiollama.native.sampler_chain import sample_rows  # noqa: E402
from aiollama.runner.token_choice import build_chain  # noqa: E402
from aiollama.sampling import SamplingParams  # noqa: E402
from aiollama.sched import Scheduler  # noqa: E402
from aiollama.sched.step import Plan, Sampled, StepResult, StepStatus  # noqa: E402

TOKENS = 256
LEVELS = (1, 8, 32, 128, 256)
FAST_LEVELS = (8, 32, 128, 256)
DEVICE_LEVELS = (8, 32, 128)
DEVICE_SECONDS = 0.002  # a decode step of a small model on a GPU


class NullExecutor:
    """Decodes nothing: every row with logits gets token 'a' at once."""

    can_shift = True
    kv_unified = True
    memory = "kv"
    placement = "CPU"

    def __init__(self, config: EngineConfig) -> None:
        self.tokenizer = ByteTokenizer()
        self.n_ctx, self.n_batch = config.n_ctx, config.n_batch
        self.n_cells = config.n_ctx
        self.n_seq_max = config.context_seq_ids(self.tokenizer.n_vocab)
        self.fingerprint = {"model": "null"}
        self.model_info = {"description": "null", "ftype": "none", "n_vocab": self.tokenizer.n_vocab}
        self._piece = self.tokenizer.piece(97)

    def start_sampling(self, conv: int, params: SamplingParams, history: Sequence[int], matcher: Any = None,
                       guidance: Any = None) -> None:
        pass

    def stop_sampling(self, conv: int) -> None:
        pass

    def execute(self, plan: Plan, on_decode: Callable[[], None] | None = None) -> StepResult:
        if plan.slices and on_decode is not None:
            on_decode()
        return StepResult(StepStatus.OK, tuple(Sampled(s.conv, 97, self._piece, False) for s in plan.slices if s.logits))

    def request_abort(self) -> None:
        pass

    def close(self) -> None:
        pass

    def embed(self, texts: Sequence[Sequence[int]], normalize: bool) -> list[list[float]]:
        raise NotImplementedError

    def read_state(self, seq_id: int) -> bytes:
        return b""

    def write_state(self, seq_id: int, data: bytes) -> bool:
        return False


class SimulatedDevice(NullExecutor):
    """A decode that takes ``DEVICE_SECONDS`` with the GIL released, as a GPU's would: ``submit``
    starts it and returns (llama_decode queues a GPU's graph), ``collect`` waits for what is left
    of it (reading the rows waits for the device)."""

    placement = "simulated"
    _done = 0.0
    _plan: Plan | None = None

    def execute(self, plan: Plan, on_decode: Callable[[], None] | None = None) -> StepResult:
        if plan.slices and on_decode is not None:
            on_decode()
        self.submit(plan)
        return self.collect()

    def submit(self, plan: Plan) -> None:
        self._plan, self._done = plan, time.perf_counter() + (DEVICE_SECONDS if plan.slices else 0.0)

    def collect(self, discard: Collection[int] = ()) -> StepResult:
        plan, self._plan = self._plan, None
        assert plan is not None
        left = self._done - time.perf_counter()
        if left > 0:
            time.sleep(left)
        gone = frozenset(s.conv for s in plan.slices if s.conv in discard)
        return StepResult(StepStatus.OK, tuple(Sampled(s.conv, 97, self._piece, False) for s in plan.slices
                                               if s.logits and s.conv not in gone), discarded=gone)


async def per_step_us(engine: aiollama.Engine, batch: list[list[int]]) -> dict[str, float]:
    """Microseconds per step with these streams running: the decode thread's whole step and its time
    outside llama_decode; and the CPU time the event loop spent per step delivering and reading
    (this thread runs it)."""
    async def read(stream: aiollama.Stream) -> None:
        async for _ in stream:
            pass

    await engine.clear_cache()  # earlier runs' prefixes would be evicted (parked) during this one
    before, loop_cpu = engine.statistics(), time.thread_time()
    convs = [engine.conversation(p) for p in batch]
    streams = [c.stream(max_tokens=TOKENS, temperature=0.7, seed=1, ignore_eos=True) for c in convs]  # all at once
    async with anyio.create_task_group() as tg:
        for stream in streams:
            tg.start_soon(read, stream)
    after, loop_cpu = engine.statistics(), time.thread_time() - loop_cpu
    for conv in convs:
        await conv.aclose()
    steps = after.decode_steps - before.decode_steps
    step = after.step_seconds - before.step_seconds
    outside = step - (after.decode_seconds - before.decode_seconds)
    return {"steps": steps, "step_us": 1e6 * step / steps, "outside_us": 1e6 * outside / steps,
            "loop_cpu_us": 1e6 * loop_cpu / steps}


def fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


async def engine_alone(rounds: int) -> dict[str, Any]:
    rows = {}
    async with aiollama.Engine(executor=NullExecutor, n_ctx=max(LEVELS) * (TOKENS + 64), n_seq_max=max(LEVELS)) as engine:
        await per_step_us(engine, [[65] * 16])
        for n in LEVELS:
            runs = [await per_step_us(engine, [[65 + i % 26] * 16 for i in range(n)]) for _ in range(rounds)]
            rows[str(n)] = min(runs, key=lambda r: r["outside_us"])  # noise only slows a run down
    a, b = fit(list(LEVELS), [rows[str(n)]["outside_us"] for n in LEVELS])
    return {"levels": rows, "per_step_us": a, "per_stream_us": b}


async def simulated_device(rounds: int, host: dict[str, Any]) -> dict[str, Any]:
    """Step time with a device that takes ``DEVICE_SECONDS`` a decode, against the host's own: the
    plain loop and overlapped steps, alternating run by run."""
    rows: dict[str, Any] = {}
    top = max(DEVICE_LEVELS)
    engines = {overlap: aiollama.Engine(executor=SimulatedDevice, n_ctx=top * (TOKENS + 64), n_seq_max=top,
                                        overlap=overlap) for overlap in (False, True)}
    async with engines[False], engines[True]:
        for engine in engines.values():
            await per_step_us(engine, [[65] * 16])
        for n in DEVICE_LEVELS:
            steps: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(rounds):
                for overlap, engine in engines.items():
                    steps[overlap].append((await per_step_us(engine, [[65 + i % 26] * 16 for i in range(n)]))["step_us"])
            own = host[str(n)]["outside_us"]
            rows[str(n)] = {"step_us": min(steps[False]), "overlapped_us": min(steps[True]), "host_us": own,
                            "device_us": 1e6 * DEVICE_SECONDS, "sum_us": own + 1e6 * DEVICE_SECONDS,
                            "max_us": max(own, 1e6 * DEVICE_SECONDS)}
    return {"device_s": DEVICE_SECONDS, "levels": rows}


async def with_model(model: Path, threads: int, rounds: int, levels: Sequence[int] = (1, 8, 32)) -> dict[str, Any]:
    rows = {}
    with Model(model, vocab_only=True) as m:
        n_vocab = m.vocab.n_tokens
    top = max(levels)
    async with aiollama.Engine(model, n_ctx=top * (TOKENS + 96), n_seq_max=top, n_threads=threads) as engine:
        await per_step_us(engine, prompts(1, 16, n_vocab, seed=9))
        for n in levels:
            runs = [await per_step_us(engine, prompts(n, 64, n_vocab, seed=n)) for _ in range(rounds)]
            rows[str(n)] = min(runs, key=lambda r: r["outside_us"])
    a, b = fit(list(levels), [rows[str(n)]["outside_us"] for n in levels])
    return {"model": model.name, "n_vocab": n_vocab, "levels": rows, "per_step_us": a, "per_stream_us": b}


def after_decode(model: Path, threads: int, steps: int = 64) -> dict[str, Any]:
    """Microseconds to sample 1 and 8 rows right after a decode, and the same call repeated."""
    rows: dict[str, Any] = {}
    with Model(model) as m, Context(m, n_ctx=2048, n_batch=512, n_seq_max=8, n_threads=threads) as ctx, \
            Batch(512, 8) as batch:
        for i, p in enumerate(prompts(8, 64, m.vocab.n_tokens, seed=3)):
            batch.add_tokens(p, 0, i, output_last=True)
        ctx.decode(batch)
        for n in (1, 8):
            chains = [build_chain(m.vocab, SamplingParams(temperature=0.7, seed=i), []) for i in range(n)]
            ks = [c.fast_k for c in chains]
            first = again = 0.0
            for step in range(steps):
                batch.clear()
                for i in range(n):
                    batch.add(300 + step, 64 + step, i, output=True)
                ctx.decode(batch)
                out = sorted(ctx.outputs)
                t0 = time.perf_counter()
                sample_rows(ctx, chains, out, threads, ks)
                t1 = time.perf_counter()
                sample_rows(ctx, chains, out, threads, ks)
                first, again = first + t1 - t0, again + time.perf_counter() - t1
            for i in range(n):
                ctx.seq_rm(i, 64, -1)
            for c in chains:
                c.close()
            rows[str(n)] = {"after_decode_us": 1e6 * first / steps, "again_us": 1e6 * again / steps}
    return {"model": model.name, "levels": rows}


PHASES = {"schedule": (Scheduler, "schedule"), "scheduler update": (Scheduler, "update"),
          "finish rules": (Generations, "update"), "publish": (EngineCore, "publish"),
          "delivery": (EngineCore, "flush"), "collect": (SimulatedDevice, "collect")}


async def phases(n: int = 128) -> dict[str, Any]:
    """Where a step's time goes on the decode thread, µs per step, with the simulated device at ``n``
    streams, plain and overlapped: each phase's method timed (the timers cost a little each)."""
    spent: dict[str, float] = {}
    saved = {name: getattr(cls, attr) for name, (cls, attr) in PHASES.items()}

    def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return run

    out: dict[str, Any] = {}
    try:
        for name, (cls, attr) in PHASES.items():
            setattr(cls, attr, timed(name, saved[name]))
        for overlap in (False, True):
            async with aiollama.Engine(executor=SimulatedDevice, n_ctx=n * (TOKENS + 64), n_seq_max=n,
                                       overlap=overlap) as engine:
                await per_step_us(engine, [[65] * 16])
                spent.clear()
                r = await per_step_us(engine, [[65 + i % 26] * 16 for i in range(n)])
                out["overlapped" if overlap else "plain"] = {"step_us": r["step_us"],
                                                             **{k: 1e6 * v / r["steps"] for k, v in spent.items()}}
    finally:
        for name, (cls, attr) in PHASES.items():
            setattr(cls, attr, saved[name])
    return {"streams": n, **out}


def sampler_threads(model: Path, threads: int, levels: Sequence[int] = (8, 32, 128), steps: int = 16) -> dict[str, Any]:
    """Microseconds to sample n rows of one decode with the default chain (temperature 0.7 over the
    whole vocabulary), on 1 thread and on ``threads`` (what the engine gives ``sample_rows``)."""
    rows: dict[str, Any] = {}
    top = max(levels)
    with Model(model) as m, Context(m, n_ctx=top * 8, n_batch=top, n_seq_max=top, n_threads=threads) as ctx, \
            Batch(top, top) as batch:
        for i in range(top):
            batch.add(300 + i, 0, i, output=True)
        ctx.decode(batch)
        out = sorted(ctx.outputs)
        for n in levels:
            row: dict[str, float] = {}
            for t in sorted({1, threads}):
                best = float("inf")
                for _ in range(steps):
                    chains = [build_chain(m.vocab, SamplingParams(temperature=0.7, seed=i), []) for i in range(n)]
                    t0 = time.perf_counter()
                    sample_rows(ctx, chains, out[:n], t, [c.fast_k for c in chains])
                    best = min(best, time.perf_counter() - t0)
                    for c in chains:
                        c.close()
                row[str(t)] = 1e6 * best
            rows[str(n)] = row
    return {"model": model.name, "threads": threads, "levels": rows}


def markdown(r: dict[str, Any]) -> str:
    e = r["engine_alone"]
    out = [f"Measured {r['date']} on {r['machine']['cpu']} ({r['machine']['cpus']} CPUs); {TOKENS} tokens a "
           f"stream, best of {r['rounds']} runs per level.", "",
           "**The engine alone** (no model: the decode thread's planning, finish rules, delivery and "
           "statistics, with the consumers reading on the event loop):", "",
           "| streams | steps | µs per step | event loop CPU per step (µs) |", "|---:|---:|---:|---:|"]
    out += [f"| {n} | {row['steps']} | {row['outside_us']:.0f} | {row['loop_cpu_us']:.0f} |"
            for n, row in e["levels"].items()]
    out += ["", f"Fit: **{e['per_step_us']:.0f} µs per step + {e['per_stream_us']:.1f} µs per stream**.", ""]
    for m in r.get("models", ()):
        out += [f"**{m['model']}** ({m['n_vocab']:,} tokens in its vocabulary), {r['threads']} threads: time "
                "outside `llama_decode` per step (sampling included; the event loop's CPU time beside it)", "",
                "| streams | step (µs) | outside llama_decode (µs) | event loop CPU per step (µs) |",
                "|---:|---:|---:|---:|"]
        out += [f"| {n} | {row['step_us']:.0f} | {row['outside_us']:.0f} | {row['loop_cpu_us']:.0f} |"
                for n, row in m["levels"].items()]
        out += ["", f"Fit: {m['per_step_us']:.0f} µs per step + {m['per_stream_us']:.1f} µs per stream.", ""]
    d = r["simulated_device"]
    out += [f"**A simulated device** ({1e3 * d['device_s']:.0f} ms a decode, the GIL released; no model): the "
            "plain loop's step and the overlapped one's (`overlap=True`: the last step's finish rules and "
            "delivery run while the device computes), runs alternating, against the host's own time (the "
            "engine alone, above, whose consumers compete with the decode thread) plus the device's, and "
            "against the larger of the two (what a step with all of the host's work overlapped would take)", "",
            "| streams | plain step (µs) | overlapped step (µs) | host + device (µs) | max(host, device) (µs) |",
            "|---:|---:|---:|---:|---:|"]
    out += [f"| {n} | {row['step_us']:.0f} | {row['overlapped_us']:.0f} | {row['sum_us']:.0f} | {row['max_us']:.0f} |"
            for n, row in d["levels"].items()]
    p = r["phases"]
    out += ["", f"**Where the decode thread's time goes** at {p['streams']} streams with the simulated device, "
            "µs per step (each phase timed; `collect` is the wait for the device):", "",
            "| phase | plain | overlapped |", "|---|---:|---:|"]
    out += [f"| {name} | {p['plain'].get(name, 0):.0f} | {p['overlapped'].get(name, 0):.0f} |" for name in PHASES]
    out += [f"| whole step | {p['plain']['step_us']:.0f} | {p['overlapped']['step_us']:.0f} |"]
    t = str(r["threads"])
    out += ["", "**Sampler threads** (`sample_rows` over n rows of one decode, the default chain at temperature 0.7, "
            "µs per call, best of 16):", "", f"| model | rows | 1 thread | {t} threads |", "|---|---:|---:|---:|"]
    for m in r["sampler_threads"]:
        out += [f"| {m['model']} | {n} | {row['1']:.0f} | {row[t]:.0f} |" for n, row in m["levels"].items()]
    out += [""]
    if "after_decode" not in r:
        return "\n".join(out)
    out += ["**Sampling right after a decode** (the default chain, `sample_rows`, µs per call): the same "
            "call repeated at once finds its code and data in the caches", "",
            "| model | rows | right after `llama_decode` | repeated |", "|---|---:|---:|---:|"]
    for m in r["after_decode"]:
        out += [f"| {m['model']} | {n} | {row['after_decode_us']:.1f} | {row['again_us']:.1f} |"
                for n, row in m["levels"].items()]
    return "\n".join(out)


async def main(args: argparse.Namespace) -> int:
    threads = args.threads or math_cpus()
    r: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(), "threads": threads,
                         "rounds": args.rounds}
    r["engine_alone"] = await engine_alone(args.rounds)
    print("engine alone", r["engine_alone"]["per_step_us"], r["engine_alone"]["per_stream_us"], flush=True)
    r["simulated_device"] = await simulated_device(args.rounds, r["engine_alone"]["levels"])
    models = [aiollama.default_model(), *(fast_model.path(v) for v in fast_model.VOCABULARIES)]
    if not args.no_models:
        r["models"] = [await with_model(models[0], threads, args.rounds)]
        r["models"] += [await with_model(m, threads, args.rounds, FAST_LEVELS) for m in models[1:]]
        r["after_decode"] = [after_decode(m, threads) for m in models]
    r["phases"] = await phases()
    r["sampler_threads"] = [sampler_threads(m, threads) for m in models[1:]]
    save_results(r, "overhead" if not args.tag else f"overhead-{args.tag}", markdown(r))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, help="llama.cpp threads (default: one per physical core)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tag", default="", help="a suffix for the results' file names")
    parser.add_argument("--no-models", action="store_true",
                        help="leave out part 2 and the sampling after a decode (the models' steps: most of the run)")
    sys.exit(anyio.run(main, parser.parse_args()))
