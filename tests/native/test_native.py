"""The native layer on real llama.cpp, with the tiny random-weight model."""

from __future__ import annotations

import gc
import logging
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import first_greedy_tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_model import spm_model
from tiny_mtp_families import deepseek4_mtp_model

import aiollama
from aiollama.errors import (
    ClosedError,
    GrammarError,
    InvalidBatchError,
    InvalidOutputError,
    InvalidRequestError,
    InvalidSeqIdError,
    InvalidTokenError,
    ModelLoadError,
)
from aiollama.native import (
    Batch,
    Context,
    DecodeStatus,
    Model,
    SamplerChain,
    Vocab,
    available_cpus,
    math_cpus,
    sample_rows,
)
from aiollama.native.binding import set_log_level


@pytest.fixture
def ctx(tiny: Model) -> Iterator[Context]:
    with Context(tiny, n_ctx=512, n_batch=64, n_seq_max=4) as context:
        yield context


@pytest.fixture
def batch() -> Iterator[Batch]:
    with Batch(64, 4) as b:
        yield b


def prefill(ctx: Context, batch: Batch, tokens: list[int], seq_id: int = 0, pos: int = 0) -> int:
    batch.clear()
    last = batch.add_tokens(tokens, pos, seq_id, output_last=True)
    assert ctx.decode(batch) is DecodeStatus.OK
    return last


# tokenizer


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris.",
        "héllo wörld, naïve café",
        "東京は日本の首都です",
        "emoji 🎉🦙 and ZWJ 👩‍👩‍👧",
        "  leading spaces\nand\ttabs\n\n",
        "",
    ],
)
def test_tokenize_round_trip(tiny: Model, text: str) -> None:
    vocab = tiny.vocab
    tokens = vocab.tokenize(text)
    assert vocab.detokenize(tokens) == text
    # piece by piece, the bytes add up to the UTF-8 text even where a piece splits a character
    assert b"".join(vocab.token_to_piece(t) for t in tokens) == text.encode()


def test_text_that_is_not_unicode_is_refused(tiny: Model) -> None:
    with pytest.raises(InvalidRequestError, match="lone surrogate at character 2"):
        tiny.vocab.tokenize("ab\ud800c")  # JSON can carry it ("\\ud800"); UTF-8 cannot


def test_pieces_can_split_a_character(tiny: Model) -> None:
    vocab = tiny.vocab
    pieces = [vocab.token_to_piece(t) for t in vocab.tokenize("🦙")]
    assert len(pieces) > 1
    with pytest.raises(UnicodeDecodeError):
        pieces[0].decode("utf-8")


def test_special_tokens(tiny: Model) -> None:
    vocab = tiny.vocab
    text = "<|im_start|>user\nhi<|im_end|>"
    special = vocab.tokenize(text, parse_special=True)
    plain = vocab.tokenize(text, parse_special=False)
    im_start = vocab.tokenize("<|im_start|>", parse_special=True)
    assert len(im_start) == 1
    assert special[0] == im_start[0]
    assert vocab.is_control(im_start[0])
    assert len(plain) > len(special)
    assert vocab.detokenize(special, unparse_special=True) == text
    assert vocab.detokenize(special, unparse_special=False) == "user\nhi"
    assert vocab.is_eog(vocab.eos)


def test_chat_template(tiny: Model) -> None:
    text = tiny.vocab.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(InvalidRequestError, match="role"):
        tiny.vocab.apply_chat_template([{"content": "no role"}])


def test_token_validation(tiny: Model) -> None:
    vocab = tiny.vocab
    with pytest.raises(InvalidTokenError, match="outside the vocabulary"):
        vocab.token_to_piece(vocab.n_tokens)
    with pytest.raises(InvalidTokenError):
        vocab.detokenize([1, -5])
    with pytest.raises(InvalidTokenError):
        vocab.is_eog(10**9)


# decoding


def test_decode_and_greedy_sample(ctx: Context, batch: Batch) -> None:
    tokens = ctx.vocab.tokenize("The capital of France is")
    last = prefill(ctx, batch, tokens)
    assert ctx.outputs == {last}
    assert ctx.seq_pos_max(0) == len(tokens) - 1
    logits = ctx.logits(last)
    with SamplerChain(ctx.vocab) as greedy:
        greedy.add_greedy()
        token = greedy.sample(ctx, last)
    assert token == max(range(len(logits)), key=logits.__getitem__)


def test_two_sequences_in_one_decode_match_each_alone(tiny: Model) -> None:
    vocab = tiny.vocab
    prompts = [vocab.tokenize("The quick brown fox"), vocab.tokenize("Once upon a time, in a land")]
    assert first_greedy_tokens(tiny, prompts, together=True) == first_greedy_tokens(tiny, prompts, together=False)


def test_seq_cp_shares_cells_in_unified_cache(tiny: Model) -> None:
    vocab = tiny.vocab
    with Context(tiny, n_ctx=256, n_batch=256, n_seq_max=4) as ctx, Batch(256) as b:
        assert ctx.n_ctx == 256
        prefix = (vocab.tokenize(" the cat sat on the mat") * 40)[:200]
        prefill(ctx, b, prefix)
        for dst in (1, 2, 3):
            ctx.seq_cp(0, dst)
            assert ctx.seq_pos_max(dst) == 199
        # 56 more cells are free: a copy that took cells would leave none.
        b.clear()
        b.add_tokens(prefix[:56], 200, 1, output_last=True)
        assert ctx.decode(b) is DecodeStatus.OK
        b.clear()
        b.add(prefix[0], 200, 2, output=True)
        assert ctx.decode(b) is DecodeStatus.NO_KV_SLOT
        # removing a copy frees nothing shared; removing the private tail frees its cells
        ctx.seq_rm(3)
        ctx.seq_rm(1, 200, -1)
        assert ctx.decode(b) is DecodeStatus.OK


def test_seq_state_round_trip(ctx: Context, batch: Batch) -> None:
    prefill(ctx, batch, ctx.vocab.tokenize("a state to keep"))
    saved = ctx.seq_state(0)
    pos_max = ctx.seq_pos_max(0)
    ctx.seq_rm(0)
    assert ctx.seq_pos_max(0) == -1
    ctx.set_seq_state(2, saved)
    assert ctx.seq_pos_max(2) == pos_max


def test_abort_flag(ctx: Context, batch: Batch) -> None:
    tokens = ctx.vocab.tokenize("abort this decode please")
    ctx.request_abort()
    batch.add_tokens(tokens, 0, 0, output_last=True)
    assert ctx.decode(batch) is DecodeStatus.ABORTED
    assert ctx.outputs == frozenset()
    assert ctx.seq_pos_max(0) == -1  # the aborted ubatch was rolled back
    ctx.clear_abort()
    assert ctx.decode(batch) is DecodeStatus.OK


def test_decode_status() -> None:
    assert DecodeStatus(1) is DecodeStatus.NO_KV_SLOT
    assert DecodeStatus(-7) is DecodeStatus.FATAL
    assert DecodeStatus(-3).is_fatal and not DecodeStatus(1).is_fatal


def test_threads_default_to_physical_cores(ctx: Context) -> None:
    assert ctx.n_threads == (math_cpus(), math_cpus())
    assert 1 <= math_cpus() <= available_cpus()
    ctx.set_threads(1, 2)
    assert ctx.n_threads == (1, 2)


def test_perf_counters(ctx: Context, batch: Batch) -> None:
    prefill(ctx, batch, ctx.vocab.tokenize("count me"))
    before = ctx.perf()
    batch.clear()
    batch.add(1, ctx.seq_pos_max(0) + 1, 0, output=True)
    assert ctx.decode(batch) is DecodeStatus.OK
    after = ctx.perf()
    assert before.n_prompt_eval == len(ctx.vocab.tokenize("count me"))
    # llama.cpp reports counts as at least 1; the single-token decode shows in the eval time
    assert before.t_eval_ms == 0 < after.t_eval_ms
    assert after.t_prompt_eval_ms > 0


# sampling


def test_sampler_clone_keeps_state(ctx: Context, batch: Batch) -> None:
    last = prefill(ctx, batch, ctx.vocab.tokenize("Random words:"))
    with SamplerChain(ctx.vocab) as chain:
        chain.add_top_k(50).add_temp(1.5).add_dist(seed=1234)
        chain.sample(ctx, last)
        with chain.clone() as twin:
            assert twin.names == chain.names
            a = [chain.sample(ctx, last) for _ in range(5)]
            b = [twin.sample(ctx, last) for _ in range(5)]
    assert a == b


def test_the_fast_path_keeps_the_top_k_of_any_row(tiny: Model) -> None:
    """Rows that defeat skipping blocks of logits (rising or falling values, ties, NaNs before a
    larger value in a block, -inf, the largest spread one a block or at the row's end) give what
    building the whole row gives. (Among more than k tied logits the
    two paths keep different ones: llama.cpp's top-k does not order ties; only greedy is compared.)"""
    n = tiny.vocab.n_tokens
    rng = np.random.default_rng(0)
    rising = np.arange(n, dtype=np.float32)
    ties = np.zeros(n, dtype=np.float32)
    nans = rng.standard_normal(n).astype(np.float32)
    nans[::64] = np.nan  # the first of every block
    nans[1::64] = 50.0 + np.arange(len(nans[1::64]), dtype=np.float32)  # larger than all before, after a NaN
    nans[70] = np.nan
    sparse = np.full(n, -np.inf, dtype=np.float32)
    sparse[rng.choice(n, 50, replace=False)] = rng.standard_normal(50).astype(np.float32)
    falling = np.arange(n, 0, -1, dtype=np.float32)  # the first block holds them all
    spread = rng.standard_normal(n).astype(np.float32)  # the largest one a block, the K-th's block in the middle
    spread[64 * rng.choice(n // 64, 60, replace=False) + rng.integers(0, 64, 60)] = 10.0 + rng.random(60, dtype=np.float32)
    last_ones = rng.standard_normal(n).astype(np.float32)
    last_ones[-45:] = 20.0 + np.arange(45, dtype=np.float32)  # at the row's end
    with Context(tiny, n_ctx=64, n_batch=64) as ctx, Batch(64) as b:
        last = b.add_tokens(tiny.vocab.tokenize("Once upon a time"), 0, 0, output_last=True)
        assert ctx.decode(b) is DecodeStatus.OK
        row = np.frombuffer(ctx.logits_buffer(last), dtype=np.float32)
        for values in (rising, ties, nans, sparse, falling, spread, last_ones):
            row[:] = values
            for k in (1,) if values is ties else (1, 40):
                picks = []
                for fast in (False, True):
                    with SamplerChain(tiny.vocab) as chain:
                        if k == 1:
                            chain.add_greedy()
                        else:
                            chain.add_top_k(k).add_temp(0.7).add_dist(seed=3)
                        picks.append(sample_rows(ctx, [chain], [last], 1, [chain.fast_k] if fast else None))
                assert picks[0] == picks[1]


@pytest.fixture(scope="module")
def odd_vocab() -> Iterator[Model]:
    """771 tokens: twelve whole blocks of 64 and a last one of 3."""
    with Model(spm_model(aiollama.cache_dir() / "test-models")) as model:
        assert model.vocab.n_tokens % 64 != 0
        yield model


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 256), spread=st.sampled_from([0.01, 1.0, 1e3]),
       empty=st.sampled_from([0.0, 0.5, 0.97]), nans=st.integers(0, 3), top_at_end=st.booleans(),
       nan_at_end=st.booleans())
def test_the_fast_path_chooses_as_the_whole_row_does_on_drawn_rows(odd_vocab: Model, seed: int, k: int, spread: float,
                                                                   empty: float, nans: int, top_at_end: bool,
                                                                   nan_at_end: bool) -> None:
    """Rows drawn at random, on a vocabulary whose last block is partial: distinct values of any
    spread, many -inf, a few NaNs (one in the last block or not), the largest ones in the last block
    or not; k below and above the number of blocks. (A row with a NaN has no k largest: both paths
    then build it whole.) The fast path (only the k best built) chooses the token the whole row does,
    greedy and with top-k, temperature and a seeded draw."""
    n = odd_vocab.vocab.n_tokens
    rng = np.random.default_rng(seed)
    values = (rng.permutation(n) * spread / n).astype(np.float32)  # distinct: no ties at the k-th
    values[rng.random(n) < empty] = -np.inf
    values[rng.choice(n, nans, replace=False)] = np.nan
    if top_at_end:
        values[-3:] = 2 * spread + np.arange(3, dtype=np.float32)
    if nan_at_end:
        values[-2] = np.nan
    with Context(odd_vocab, n_ctx=64, n_batch=64) as ctx, Batch(64) as b:
        last = b.add_tokens(odd_vocab.vocab.tokenize("the cat"), 0, 0, output_last=True)
        assert ctx.decode(b) is DecodeStatus.OK
        np.frombuffer(ctx.logits_buffer(last), dtype=np.float32)[:] = values
        for greedy in (True, False):
            picks = []
            for fast in (False, True):
                with SamplerChain(odd_vocab.vocab) as chain:
                    if greedy:
                        chain.add_greedy()
                    else:
                        chain.add_top_k(k).add_temp(0.7).add_dist(seed=seed)
                    picks.append(sample_rows(ctx, [chain], [last], 1, [chain.fast_k] if fast else None))
            assert picks[0] == picks[1], (greedy, picks)


def test_sample_rows_equals_each_row_alone(tiny: Model) -> None:
    """One call for a step's rows, shared out over threads, chooses what each chain chooses alone."""
    vocab = tiny.vocab
    prompts = [vocab.tokenize(f"Story number {i}: once upon a time") for i in range(12)]

    def chains() -> list[SamplerChain]:
        out = []
        for i in range(len(prompts)):
            chain = SamplerChain(vocab)
            if i % 3 == 0:
                chain.add_greedy()
            else:
                chain.add_top_k(40).add_top_p(0.9).add_temp(1.2).add_dist(seed=100 + i)
            out.append(chain)
        return out

    results = []
    for threads, fast in ((None, False), (1, False), (2, False), (1, True), (2, True)):
        with Context(tiny, n_ctx=512, n_batch=512, n_seq_max=len(prompts)) as ctx, Batch(512) as b:
            rows = []
            for seq, tokens in enumerate(prompts):
                rows.append(b.add_tokens(tokens, 0, seq, output_last=True))
            assert ctx.decode(b) is DecodeStatus.OK
            cs = chains()
            try:
                if threads is None:
                    results.append([c.sample(ctx, r) for c, r in zip(cs, rows)])
                else:  # the fast path builds only each chain's top-k candidates
                    assert [c.fast_k for c in cs] == [1 if i % 3 == 0 else 40 for i in range(len(cs))]
                    results.append(sample_rows(ctx, cs, rows, threads, [c.fast_k for c in cs] if fast else None))
            finally:
                for c in cs:
                    c.close()
    assert all(r == results[0] for r in results)
    with Context(tiny, n_ctx=64, n_batch=64) as ctx, Batch(64) as b, SamplerChain(vocab) as chain:
        last = b.add_tokens(prompts[0], 0, 0, output_last=True)
        ctx.decode(b)
        with pytest.raises(ValueError, match="distinct"):
            sample_rows(ctx, [chain, chain], [last, last])
        with pytest.raises(InvalidOutputError):
            sample_rows(ctx, [chain], [0])
        with pytest.raises(InvalidRequestError, match="idx"):
            sample_rows(ctx, [chain], [float(last)])
        with pytest.raises(InvalidRequestError, match="top_k"):
            sample_rows(ctx, [chain], [last], 1, [-1])
        assert sample_rows(ctx, [], []) == []
    with SamplerChain(vocab) as chain:  # something before top-k reads the whole row: no fast path
        assert chain.add_logit_bias({5: 1.0}).add_top_k(40).fast_k == 0
    with SamplerChain(vocab) as chain:
        assert chain.add_top_k(1000).fast_k == 0


def test_grammar(ctx: Context, batch: Batch) -> None:
    vocab = ctx.vocab
    yes, no = vocab.tokenize("yes"), vocab.tokenize("no")
    assert len(yes) == len(no) == 1
    last = prefill(ctx, batch, vocab.tokenize("Answer:"))
    with SamplerChain(vocab) as chain:
        chain.add_grammar('root ::= "yes" | "no"').add_greedy()
        piece = vocab.token_to_piece(chain.sample(ctx, last)).decode()
        assert piece and ("yes".startswith(piece) or "no".startswith(piece))
    with SamplerChain(vocab) as chain:
        chain.add_grammar('root ::= "yes"').add_greedy()
        with pytest.raises(GrammarError, match="does not accept"):
            chain.accept(no[0])
        chain.accept(yes[0])
    with SamplerChain(vocab) as chain, pytest.raises(GrammarError, match="invalid GBNF"):
        chain.add_grammar("root ::= (")


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda c: c.add_top_p(1.5), "top_p"),
        (lambda c: c.add_min_p(math.nan), "min_p"),
        (lambda c: c.add_temp("hot"), "temperature"),
        (lambda c: c.add_dist(seed=-1), "seed"),
        (lambda c: c.add_penalties(repeat=0.0), "repeat_penalty"),
        (lambda c: c.add_logit_bias({10**9: 1.0}), "outside the vocabulary"),
    ],
)
def test_sampler_parameters_are_validated(tiny: Model, build: object, field: str) -> None:
    with SamplerChain(tiny.vocab) as chain, pytest.raises(InvalidRequestError, match=field):
        build(chain)  # type: ignore[operator]


# point 6 of the foundation: misuse raises instead of aborting the process


def test_batch_larger_than_n_batch(ctx: Context) -> None:
    with Batch(ctx.n_batch + 1) as big:
        big.add_tokens([1] * (ctx.n_batch + 1), 0, 0)
        with pytest.raises(InvalidBatchError, match="exceeds n_batch"):
            ctx.decode(big)


def test_batch_capacity(batch: Batch) -> None:
    with pytest.raises(InvalidBatchError, match="full"):
        batch.add_tokens([1] * (batch.capacity + 1), 0, 0)
    assert len(batch) == 0


def test_empty_batch(ctx: Context, batch: Batch) -> None:
    with pytest.raises(InvalidBatchError, match="empty"):
        ctx.decode(batch)


def test_seq_id_out_of_range(ctx: Context, batch: Batch) -> None:
    batch.add(1, 0, ctx.n_seq_max, output=True)
    with pytest.raises(InvalidSeqIdError, match="n_seq_max"):
        ctx.decode(batch)
    with pytest.raises(InvalidSeqIdError):
        batch.add(1, 0, -1)
    for op in (lambda: ctx.seq_pos_max(ctx.n_seq_max), lambda: ctx.seq_cp(0, 99),
               lambda: ctx.seq_rm(-2), lambda: ctx.seq_state(300)):
        with pytest.raises(InvalidSeqIdError):
            op()


def test_too_many_seq_ids_per_row(batch: Batch) -> None:
    with pytest.raises(InvalidSeqIdError, match="at most"):
        batch.add(1, 0, [0, 1, 2, 3, 4])


def test_n_seq_max_over_256(tiny: Model) -> None:
    with pytest.raises(InvalidRequestError, match="256"):
        Context(tiny, n_seq_max=257)
    with pytest.raises(InvalidRequestError):
        Batch(8, n_seq_max=1000)


def test_token_outside_vocabulary(ctx: Context, batch: Batch) -> None:
    batch.add(ctx.n_vocab, 0, 0, output=True)
    with pytest.raises(InvalidTokenError):
        ctx.decode(batch)
    with pytest.raises(InvalidTokenError):
        batch.add(-1, 1, 0)


def test_position_gap_in_batch(batch: Batch) -> None:
    batch.add(1, 0, 0)
    with pytest.raises(InvalidBatchError, match="gap"):
        batch.add(2, 2, 0)


def test_position_gap_after_cache(ctx: Context, batch: Batch) -> None:
    prefill(ctx, batch, [1, 2, 3])
    batch.clear()
    batch.add(4, 5, 0, output=True)
    with pytest.raises(InvalidBatchError, match="expected 3"):
        ctx.decode(batch)
    batch.clear()
    batch.add(4, 3, 0, output=True)
    assert ctx.decode(batch) is DecodeStatus.OK


def test_sampling_a_row_without_logits(ctx: Context, batch: Batch) -> None:
    with SamplerChain(ctx.vocab) as greedy:
        greedy.add_greedy()
        with pytest.raises(InvalidOutputError):
            greedy.sample(ctx, 0)  # nothing decoded yet
        batch.add_tokens([1, 2, 3], 0, 0, output_last=True)
        assert ctx.decode(batch) is DecodeStatus.OK
        for bad in (0, 1, 3, -1, 1000):
            with pytest.raises(InvalidOutputError):
                greedy.sample(ctx, bad)
        greedy.sample(ctx, 2)


def test_missing_model() -> None:
    with pytest.raises(FileNotFoundError):
        Model("/nonexistent/model.gguf")


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Model(path)
    with pytest.raises(IsADirectoryError):
        Model(tmp_path)


@pytest.mark.parametrize("keep", [2, 20, 5000, 0.5, 0.999])
def test_truncated_gguf(tmp_path: Path, tiny_path: Path, keep: float) -> None:
    data = tiny_path.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:n])
    with pytest.raises(ModelLoadError):
        Model(path)


def test_partial_seq_cp_on_split_cache(tiny: Model) -> None:
    with Context(tiny, n_ctx=1024, n_batch=64, n_seq_max=2, kv_unified=False) as ctx, Batch(64) as b:
        prefill(ctx, b, [1, 2, 3, 4])
        with pytest.raises(InvalidRequestError, match="unified"):
            ctx.seq_cp(0, 1, 0, 2)
        ctx.seq_cp(0, 1)  # a whole copy is fine


def test_a_memory_copied_whole_only_refuses_a_range_and_copies_its_state(smollm2_path: Path) -> None:
    """DeepSeek V4's memory: llama.cpp asserts (aborting the process) on a range. A range is
    refused, one that covers the whole sequence is a whole copy (made of the state's bytes: see
    memory.py), and after it each sequence decodes what it would alone. (That llama.cpp's own copy
    leaves the two sharing state shows in the engine's forks: tests/core/test_recurrent.py.)"""
    path = deepseek4_mtp_model(aiollama.cache_dir() / "test-models", smollm2_path, agree=False)
    prompt = [1, *([504, 3426, 314, 3599, 284] * 6)]
    def after(ctx: Context, b: Batch, seq_id: int, token: int) -> np.ndarray:
        b.clear()
        b.add_tokens([token], len(prompt), seq_id, output_last=True)
        assert ctx.decode(b) is DecodeStatus.OK
        return np.frombuffer(ctx.logits_buffer(0), dtype=np.float32).copy()

    with Model(path) as model, Batch(64) as b:
        with Context(model, n_ctx=1024, n_batch=64, n_seq_max=1) as alone:
            prefill(alone, b, prompt)
            expected = after(alone, b, 0, 601)
        with Context(model, n_ctx=1024, n_batch=64, n_seq_max=3) as ctx:
            assert ctx.whole_copies
            prefill(ctx, b, prompt)
            with pytest.raises(InvalidRequestError, match="whole sequences only"):
                ctx.seq_cp(0, 1, 0, 10)
            ctx.seq_cp(0, 1, 0, len(prompt))  # all of it
            ctx.seq_cp(0, 2)
            after(ctx, b, 1, 600)  # a copy decodes first
            assert np.array_equal(after(ctx, b, 0, 601), expected)
            assert np.array_equal(after(ctx, b, 2, 601), expected)


def test_shared_rows_need_unified_cache(tiny: Model) -> None:
    with Context(tiny, n_ctx=1024, n_batch=64, n_seq_max=2, kv_unified=False) as ctx, Batch(64, 2) as b:
        b.add(1, 0, [0, 1], output=True)
        with pytest.raises(InvalidBatchError, match="kv_unified"):
            ctx.decode(b)


# handle lifetimes


def test_close_model_first(tiny_path: Path) -> None:
    model = Model(tiny_path)
    ctx = Context(model, n_ctx=256, n_batch=32)
    chain = SamplerChain(ctx.vocab).add_greedy()
    model.close()
    model.close()
    assert model.closed
    with pytest.raises(ClosedError):
        model.description()
    with pytest.raises(ClosedError):
        Context(model)
    # the context and the sampler keep the native model alive
    with Batch(32) as b:
        last = prefill(ctx, b, ctx.vocab.tokenize("still alive"))
        chain.sample(ctx, last)
    ctx.close()
    ctx.vocab.tokenize("the sampler still holds the model")
    chain.close()
    with pytest.raises(ClosedError):
        ctx.vocab.tokenize("now everything is closed")


def test_close_context_first(tiny_path: Path) -> None:
    with Model(tiny_path) as model:
        ctx = Context(model, n_ctx=256, n_batch=32)
        ctx.close()
        ctx.close()
        assert model.description()
    with pytest.raises(ClosedError):
        model.vocab.tokenize("closed")


def test_closed_handles_raise(tiny: Model) -> None:
    ctx = Context(tiny, n_ctx=256, n_batch=32)
    b = Batch(8)
    chain = SamplerChain(tiny.vocab).add_greedy()
    for handle in (b, chain, ctx):
        handle.close()
    for op in (lambda: ctx.decode(b), lambda: ctx.seq_pos_max(0), lambda: b.add(1, 0, 0),
               lambda: chain.sample(ctx, 0), lambda: chain.clone(), lambda: ctx.request_abort() or ctx.perf()):
        with pytest.raises(ClosedError):
            op()
    with pytest.raises(ClosedError):
        with ctx:
            pass


def test_leaked_handle_warns_without_freeing(tiny: Model) -> None:
    leaked = Batch(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        leaked.__del__()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    assert not leaked.closed  # the finalizer did not free it
    leaked.close()
    gc.collect()


def test_vocab_is_shared(tiny: Model, ctx: Context) -> None:
    assert isinstance(ctx.vocab, Vocab)
    assert ctx.vocab is tiny.vocab


# logging


def test_log_goes_to_python_logging(tiny_path: Path, caplog: pytest.LogCaptureFixture,
                                    capfd: pytest.CaptureFixture[str]) -> None:
    with Model(tiny_path):
        pass
    assert capfd.readouterr().err == ""  # quiet by default
    set_log_level(logging.INFO)
    try:
        with caplog.at_level(logging.INFO, logger="aiollama.llama_cpp"), Model(tiny_path):
            pass
    finally:
        set_log_level(logging.WARNING)
    assert any(r.name == "aiollama.llama_cpp" for r in caplog.records)
    assert capfd.readouterr().err == ""


def test_load_error_carries_llama_log(tmp_path: Path, tiny_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_path.read_bytes()[:100_000])
    with pytest.raises(ModelLoadError, match="could not load"):
        Model(path)
