"""The deterministic mode: a sequence's logits do not depend on the company it keeps.

Golden tests compare a sequence's logits bit for bit, decoded alone (one thread) and with 1, 7 and
31 random batch-mates (two threads), with short and long (> 1,000 cells) contexts, batch-mates
evaluated before it or beside it, on Q4_1, Q8_0, F16 and Q4_K tiny models. The same comparisons
without the mode find differences: the test has teeth.

Freed cells: a conversation's logits stay the same while others around it are evicted, preempted,
parked and restored, rewound and closed (the cache is re-laid to keep each sequence's cells in
position order); without that re-laying they change.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from helpers import gather
from tiny_model import quantized_model

import aiollama
from aiollama import Engine, EngineConfig, InvalidRequestError
from aiollama.native import Batch, Context, DecodeStatus, Model, seqstate
from aiollama.runner.ordered import OrderedCells
from aiollama.sched.kvcache import KVManager

WIDE = dict(n_embd=256, n_ff=768, n_head=4, n_head_kv=2, n_layer=4)  # K-quants need rows of 256
MODELS = [("q4_1", {}), ("q8_0", {}), ("f16", {}), ("q4_k_m", WIDE)]
STEPS = 3


@pytest.fixture(scope="module", params=MODELS, ids=[kind for kind, _ in MODELS])
def quantized(request: pytest.FixtureRequest, smollm2_path: Path) -> Path:
    kind, params = request.param
    return quantized_model(aiollama.cache_dir() / "test-models", smollm2_path, kind, **params)


def decode(model: Model, target: Sequence[int], mates: Sequence[Sequence[int]], *, reference: bool,
           mates_first: bool = False, threads: int = 2) -> list[np.ndarray]:
    """The target's logits rows: its prompt's last, then ``STEPS - 1`` greedy steps, all in batches
    shared with the mates (each continuing greedily)."""
    with Context(model, n_ctx=8192, n_batch=4096, n_ubatch=512, n_seq_max=33, n_threads=threads,
                 flash_attn=True if reference else None, reference_kernels=reference) as ctx, Batch(4096) as batch:
        if mates_first:
            batch.clear()
            for i, m in enumerate(mates):
                batch.add_tokens(m[:-1], 0, i + 1, output_last=False)
            assert ctx.decode(batch) is DecodeStatus.OK
        batch.clear()
        row = batch.add_tokens(target, 0, 0, output_last=True)
        mate_rows = [batch.add_tokens(m[-1:], len(m) - 1, i + 1, output_last=True) if mates_first
                     else batch.add_tokens(m, 0, i + 1, output_last=True) for i, m in enumerate(mates)]
        assert ctx.decode(batch) is DecodeStatus.OK
        pos, mate_pos = len(target), [len(m) for m in mates]
        rows = []
        for _ in range(STEPS):
            logits = np.frombuffer(ctx.logits_buffer(row), dtype=np.float32).copy()
            rows.append(logits)
            nexts = [int(np.frombuffer(ctx.logits_buffer(r), dtype=np.float32).argmax()) for r in mate_rows]
            batch.clear()
            row = batch.add_tokens([int(logits.argmax())], pos, 0, output_last=True)
            mate_rows = [batch.add_tokens([t], mate_pos[i], i + 1, output_last=True) for i, t in enumerate(nexts)]
            pos += 1
            mate_pos = [p + 1 for p in mate_pos]
            assert ctx.decode(batch) is DecodeStatus.OK
        return rows


def cases(n_vocab: int) -> list[tuple[str, list[int], list[list[int]], bool]]:
    rng = random.Random(14)
    out = []
    for length in (8, 1100):
        target = [rng.randrange(100, n_vocab) for _ in range(length)]
        for k in (1, 7, 31):
            for first in (False, True):
                longest = 120 if length < 100 else 60
                mates = [[rng.randrange(100, n_vocab) for _ in range(rng.randrange(3, longest))] for _ in range(k)]
                out.append((f"{length} cells, {k} mates{' first' if first else ''}", target, mates, first))
    return out


def test_logits_are_bit_identical_solo_and_batched(quantized: Path) -> None:
    with Model(quantized, repack=False) as model:
        solo: dict[int, list[np.ndarray]] = {}
        for name, target, mates, first in cases(model.vocab.n_tokens):
            if len(target) not in solo:
                solo[len(target)] = decode(model, target, [], reference=True, threads=1)
            got = decode(model, target, mates, reference=True, mates_first=first)
            for step, (a, b) in enumerate(zip(solo[len(target)], got)):
                assert np.array_equal(a, b), f"{quantized.name}, {name}: step {step} differs by {np.abs(a - b).max()}"


def test_without_the_mode_batch_mates_change_the_logits(smollm2_path: Path) -> None:
    path = quantized_model(aiollama.cache_dir() / "test-models", smollm2_path, "q4_k_m", **WIDE)
    with Model(path) as model:
        differs = 0
        for _, target, mates, first in cases(model.vocab.n_tokens)[:6]:
            solo = decode(model, target, [], reference=False, threads=1)
            got = decode(model, target, mates, reference=False, mates_first=first)
            differs += not all(np.array_equal(a, b) for a, b in zip(solo, got))
        assert differs > 0


# the engine


async def logits_of(model: Path, mates: int, *, late: bool, seed: int | None = None,
                    threads: int = 2) -> tuple[list[int], list[np.ndarray]]:
    """A conversation's tokens and every logits row it sampled from, beside ``mates`` others that
    start before it or while it runs."""
    rows: list[np.ndarray] = []

    def keep(tokens: tuple[int, ...], logits: np.ndarray) -> None:
        rows.append(logits.copy())

    params = dict(temperature=0.0) if seed is None else dict(temperature=0.9, seed=seed)
    async with Engine(model, n_ctx=8192, n_seq_max=32, n_threads=threads, step_tokens=64, deterministic=True) as engine:
        rng, own = random.Random(1), random.Random(7)
        others = [engine.conversation([rng.randrange(100, 40000) for _ in range(rng.randrange(5, 150))])
                  for _ in range(mates)]
        before = [] if late else [c.stream(max_tokens=rng.randrange(5, 40), ignore_eos=True) for c in others]
        conv = engine.conversation([own.randrange(100, 40000) for _ in range(300)])
        stream = conv.stream(max_tokens=24, ignore_eos=True, logits_processors=[keep], **params)
        if late:
            async for _ in stream:
                break
            before = [c.stream(max_tokens=rng.randrange(5, 40), ignore_eos=True) for c in others]
        await stream
        for s in before:
            await s
        return list(conv.tokens[300:]), rows


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [None, 5])
async def test_the_engine_gives_the_same_logits_whatever_runs_beside(tiny_path: Path, seed: int | None) -> None:
    alone = await logits_of(tiny_path, 0, late=False, seed=seed, threads=1)
    for mates, late in ((7, False), (7, True), (31, True)):
        tokens, rows = await logits_of(tiny_path, mates, late=late, seed=seed)
        assert tokens == alone[0]
        assert len(rows) == len(alone[1]) and all(np.array_equal(a, b) for a, b in zip(rows, alone[1]))


@pytest.mark.anyio
async def test_forks_with_one_seed_give_one_text(tiny_path: Path) -> None:
    async with Engine(tiny_path, n_ctx=4096, n_seq_max=8, deterministic=True) as engine:
        root = engine.conversation("Once upon a time")
        forks = [root.fork() for _ in range(4)]
        outs = await gather(*[f.stream(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True) for f in forks])
        assert len({tuple(o.tokens) for o in outs}) == 1
        other = await root.fork().stream(max_tokens=24, temperature=1.0, seed=12, ignore_eos=True)
        assert other.tokens != outs[0].tokens


def test_the_mode_is_cpu_only() -> None:
    with pytest.raises(InvalidRequestError, match="CPU"):
        EngineConfig(deterministic=True, n_gpu_layers=-1)
    with pytest.raises(InvalidRequestError, match="deterministic"):
        EngineConfig(deterministic="yes")  # type: ignore[arg-type]


def test_quantize_refuses_what_it_cannot_do(tmp_path: Path, tiny_path: Path) -> None:
    from aiollama.errors import ModelNotFound
    from aiollama.native.model import quantize

    with pytest.raises(InvalidRequestError, match="kind"):
        quantize(tiny_path, tmp_path / "x.gguf", "q3_xyz")
    with pytest.raises(ModelNotFound):
        quantize(tmp_path / "missing.gguf", tmp_path / "x.gguf", "q8_0")


# freed cells


def test_a_state_is_put_in_position_order_and_cut(tiny_path: Path) -> None:
    """A state whose cells sit out of position order (a later position in a freed cell below) is
    put in order; cut at a position, restored beside a donor that shares the rest, it gives the
    same logits as the whole ordered state, wherever its cells land."""
    rng = random.Random(2)
    target = [rng.randrange(100, 40000) for _ in range(200)]
    filler = [rng.randrange(100, 40000) for _ in range(120)]

    def next_row(ctx: Context, batch: Batch, seq: int) -> np.ndarray:
        batch.clear()
        row = batch.add_tokens(target[199:], 199, seq, output_last=True)
        assert ctx.decode(batch) is DecodeStatus.OK
        return np.frombuffer(ctx.logits_buffer(row), dtype=np.float32).copy()

    def evaluate(ctx: Context, batch: Batch, tokens: Sequence[int], pos: int, seq: int) -> None:
        batch.clear()
        batch.add_tokens(tokens, pos, seq)
        assert ctx.decode(batch) is DecodeStatus.OK

    with Model(tiny_path, repack=False) as model, Batch(512) as batch:
        def context() -> Context:
            return Context(model, n_ctx=1024, n_batch=512, n_seq_max=4, n_threads=2, kv_unified=True,
                           flash_attn=True, reference_kernels=True)

        with context() as ctx:
            evaluate(ctx, batch, filler, 0, 1)
            evaluate(ctx, batch, target[:150], 0, 0)
            ctx.seq_rm(1)
            evaluate(ctx, batch, target[150:199], 150, 0)  # into the cells seq 1 freed
            messy = ctx.seq_state(0)
            row_messy = next_row(ctx, batch, 0)
        assert seqstate.positions(messy)[:2] == [150, 151] and seqstate.positions(messy)[49] == 0
        good = seqstate.ordered(messy)
        cut = seqstate.ordered(messy, 120)
        assert seqstate.positions(good) == list(range(199)) and len(good) == len(messy)
        assert seqstate.positions(cut) == list(range(120, 199))
        assert seqstate.ordered(good) is good and seqstate.ordered(messy, 500) == b""
        with context() as ctx:
            ctx.set_seq_state(0, good)
            row_good = next_row(ctx, batch, 0)
        with context() as ctx:  # another sequence's cells first: the same order, other cells
            evaluate(ctx, batch, filler, 0, 3)
            ctx.set_seq_state(2, good)
            ctx.set_seq_state(0, cut)
            ctx.seq_cp(2, 0, 0, 120)
            row_cut = next_row(ctx, batch, 0)
        assert np.array_equal(row_good, row_cut)
        assert not np.array_equal(row_good, row_messy)  # the order of the cells changes the sums
    with pytest.raises(seqstate.StateFormatError):
        seqstate.ordered(good[:-3])


async def busy_logits(model: Path, busy: bool, threads: int = 2, *, shift: bool = False,
                      draft: int = 0) -> tuple[list[int], list[np.ndarray], aiollama.Statistics]:
    """A low-priority conversation's last tokens and logits rows in a small cache, alone or among
    others that come and go: evicted, preempted (it is the first to go), parked and restored,
    rewound, forked and closed. With ``shift`` it outgrows the context and shifts, among short ones;
    with ``draft`` it drafts (n-gram) up to that many tokens a step, and must have taken some."""
    rows: list[np.ndarray] = []

    def keep(tokens: tuple[int, ...], logits: np.ndarray) -> None:
        rows.append(logits.copy())

    n_ctx, prompt, new, n_mates, lengths = (512, 400, 200, 12, (20, 60)) if shift else (1024, 300, 64, 24, (60, 260))
    async with Engine(model, n_ctx=n_ctx, n_seq_max=6, n_threads=threads, step_tokens=64,
                      deterministic=True) as engine:
        rng, own = random.Random(3), random.Random(7)

        async def mate(i: int) -> None:
            await asyncio.sleep(rng.random() * 0.3)
            conv = engine.conversation([rng.randrange(100, 40000) for _ in range(rng.randrange(*lengths))])
            await conv.stream(max_tokens=rng.randrange(10, 60), ignore_eos=True)
            if i % 3 == 0 and not shift:
                conv.rewind(rng.randrange(5, 30))
                fork = conv.fork()
                await fork.stream(max_tokens=20, ignore_eos=True)
                await fork.aclose()
            if i % 2 == 0 or shift:
                await conv.aclose()

        mates = [asyncio.create_task(mate(i)) for i in range(n_mates if busy else 0)]
        conv = engine.conversation([own.randrange(100, 40000) for _ in range(prompt)])
        options = dict(context_shift=True, n_keep=16) if shift else {}
        out = await conv.stream(max_tokens=new, ignore_eos=True, logits_processors=[keep], priority=5,
                                temperature=0.0, draft_tokens=draft, **options)
        assert out.stats.accepted > 0 if draft else out.stats.drafted == 0
        await asyncio.gather(*mates)
        return list(conv.tokens[-new // 2:]), rows, engine.statistics()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(("shift", "draft"), [(False, 0), (True, 0), (False, 6)], ids=["freed", "shifted", "drafts"])
@pytest.mark.anyio
async def test_logits_stay_the_same_while_cells_are_freed_around(tiny_path: Path, shift: bool, draft: int) -> None:
    alone = await busy_logits(tiny_path, False, threads=1, shift=shift)
    tokens, rows, stats = await busy_logits(tiny_path, True, shift=shift, draft=draft)
    assert stats.preemptions > 0 and stats.compactions > 0
    if not shift:
        assert stats.restores > 0 and stats.evictions > 0
    assert tokens == alone[0]
    assert len(rows) == len(alone[1]) == (200 if shift else 64)
    assert all(np.array_equal(a, b) for a, b in zip(rows, alone[1]))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_without_re_laying_freed_cells_change_the_logits(tiny_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    init = KVManager.__init__

    def unordered(self: KVManager, *args: object, **kwargs: object) -> None:
        kwargs["ordered"] = False
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    def no_tombstone(self: OrderedCells, seq_id: int, p0: int, p1: int) -> None:
        pass

    monkeypatch.setattr(KVManager, "__init__", unordered)
    monkeypatch.setattr(OrderedCells, "hold", no_tombstone)
    alone = await busy_logits(tiny_path, False, threads=1)
    for _ in range(3):  # where the others' freed cells fall depends on when they come: one run may not show it
        _, rows, stats = await busy_logits(tiny_path, True)
        assert stats.compactions == 0
        if not all(np.array_equal(a, b) for a, b in zip(rows, alone[1])):
            return
    pytest.fail("three runs whose freed cells were not re-laid gave the logits of the conversation alone")
