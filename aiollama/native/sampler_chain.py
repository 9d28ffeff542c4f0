"""SamplerChain: one sequence's token choice (temperature, top-k/p, penalties, grammar...).

A chain holds per-sequence state (RNG, penalty history, grammar stack), so every sequence needs its
own; :meth:`SamplerChain.clone` copies one, state included, for a fork.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from aiollama._validate import integer, number
from aiollama.errors import GrammarError, InvalidRequestError
from aiollama.native.binding import clear_recent_errors, ffi, lib, recent_errors
from aiollama.native.context import Context
from aiollama.native.handle import Handle
from aiollama.native.model import Vocab

DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed
# The samplers llama.cpp can run inside the decode graph (backend sampling). Its penalties can too,
# but two runs of one greedy chain with penalties in the graph chose different tokens: not used.
BACKEND_SAMPLERS = frozenset({"greedy", "dist", "top_k", "top_p", "min_p", "temp", "logit_bias"})


def _unit(name: str, value: object) -> float:
    return number(name, value, low=0.0, high=1.0)


class SamplerChain(Handle):
    """A llama.cpp sampler chain bound to a vocabulary; the model stays alive until it is closed.

    Build it with the ``add_*`` methods, in the order they should apply, and end with a selecting
    sampler (``add_greedy`` or ``add_dist``).
    """

    _kind = "sampler chain"

    def __init__(self, vocab: Vocab, *, no_perf: bool = True) -> None:
        self.vocab = vocab
        vocab._model._acquire_native()
        params = lib.llama_sampler_chain_default_params()
        params.no_perf = no_perf
        self._own(lib.llama_sampler_chain_init(params))
        self._grammar: Any = None  # the grammar sampler inside the chain, if any
        self.names: list[str] = []
        self._first_k = 0  # the k of a top-k (1 for greedy) that begins the chain

    def _free(self, ptr: Any) -> None:
        self._grammar = None
        lib.llama_sampler_free(ptr)
        self.vocab._model._release()

    def __repr__(self) -> str:
        return f"<SamplerChain {'closed' if self._ptr is None else self.names}>"

    def _add(self, name: str, smpl: Any) -> SamplerChain:
        chain = self._get()
        if smpl == ffi.NULL:
            raise InvalidRequestError(f"llama.cpp refused the {name} sampler")
        lib.llama_sampler_chain_add(chain, smpl)  # the chain owns it from here on
        self.names.append(name)
        return self

    def add_greedy(self) -> SamplerChain:
        if not self.names:
            self._first_k = 1
        return self._add("greedy", lib.llama_sampler_init_greedy())

    def add_dist(self, seed: int = DEFAULT_SEED) -> SamplerChain:
        integer("seed", seed, low=0, high=DEFAULT_SEED)
        return self._add("dist", lib.llama_sampler_init_dist(seed))

    def add_temp(self, t: float) -> SamplerChain:
        return self._add("temp", lib.llama_sampler_init_temp(number("temperature", t)))

    def add_top_k(self, k: int) -> SamplerChain:
        integer("top_k", k)
        if not self.names and k > 0:
            self._first_k = k
        return self._add("top_k", lib.llama_sampler_init_top_k(k))

    @property
    def backend_capable(self) -> bool:
        """Every sampler of the chain can run inside the decode graph (see :func:`attach`)."""
        return bool(self.names) and all(name in BACKEND_SAMPLERS for name in self.names)

    @property
    def fast_k(self) -> int:
        """The k of a top-k that begins the chain (1 for a chain that begins with greedy), up to
        ``FAST_K_MAX``; else 0. Sampling then needs only the k best candidates of a row."""
        return self._first_k if self._first_k <= FAST_K_MAX else 0

    def add_top_p(self, p: float, min_keep: int = 1) -> SamplerChain:
        return self._add("top_p", lib.llama_sampler_init_top_p(_unit("top_p", p), min_keep))

    def add_min_p(self, p: float, min_keep: int = 1) -> SamplerChain:
        return self._add("min_p", lib.llama_sampler_init_min_p(_unit("min_p", p), min_keep))

    def add_typical(self, p: float, min_keep: int = 1) -> SamplerChain:
        return self._add("typical", lib.llama_sampler_init_typical(_unit("typical_p", p), min_keep))

    def add_penalties(
        self, last_n: int = 64, repeat: float = 1.0, frequency: float = 0.0, presence: float = 0.0
    ) -> SamplerChain:
        integer("penalty_last_n", last_n, low=-1)
        number("repeat_penalty", repeat, low=0.0, low_open=True)
        smpl = lib.llama_sampler_init_penalties(
            self.vocab.n_tokens, last_n, repeat, number("frequency_penalty", frequency),
            number("presence_penalty", presence))
        return self._add("penalties", smpl)

    def add_logit_bias(self, bias: Mapping[int, float]) -> SamplerChain:
        items = [(self.vocab.check_token(t), number("logit_bias", b)) for t, b in bias.items()]
        arr = ffi.new("llama_logit_bias[]", max(1, len(items)))
        for i, (t, b) in enumerate(items):
            arr[i].token = t
            arr[i].bias = b
        return self._add("logit_bias", lib.llama_sampler_init_logit_bias(self.vocab.n_tokens, len(items), arr))

    def add_grammar(self, grammar: str, root: str = "root") -> SamplerChain:
        """Constrain tokens to a GBNF grammar. Raises GrammarError if it does not parse."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("grammar must be a non-empty GBNF string")
        if self._grammar is not None:
            raise GrammarError("a chain takes at most one grammar")
        clear_recent_errors()
        smpl = lib.llama_sampler_init_grammar(self.vocab._get(), grammar.encode(), root.encode())
        if smpl == ffi.NULL:
            why = "; ".join(recent_errors()) or "parse error"
            raise GrammarError(f"invalid GBNF grammar: {why}")
        self._add("grammar", smpl)
        self._grammar = smpl
        return self

    # use

    def sample(self, ctx: Context, idx: int) -> int:
        """Choose (and accept) a token from row ``idx`` of ``ctx``'s last decode."""
        chain = self._get()
        ctx_ptr = ctx._get()
        ctx.check_output(idx)
        return int(lib.llama_sampler_sample(chain, ctx_ptr, idx))

    def _grammar_allows(self, token: int) -> bool:
        data = ffi.new("llama_token_data[1]")
        data[0].id = token
        data[0].logit = 0.0
        arr = ffi.new("llama_token_data_array *")
        arr.data = data
        arr.size = 1
        arr.selected = -1
        arr.sorted = False
        lib.llama_sampler_apply(self._grammar, arr)
        return bool(math.isfinite(arr.data[0].logit))

    def prefill_grammar(self, tokens: Sequence[int]) -> None:
        """Advance the chain's grammar over ``tokens`` (text its grammar begins with that is
        already in the prompt), leaving the rest of the chain as it is. Raises GrammarError for a
        token the grammar rejects."""
        if self._grammar is None:
            raise GrammarError("the chain has no grammar to prefill")
        for token in tokens:
            self.vocab.check_token(token)
            if not self._grammar_allows(token):
                raise GrammarError(f"the grammar does not begin with the text of token {token}")
            lib.llama_sampler_accept(self._grammar, token)

    def accept(self, token: int) -> None:
        """Feed a token that was not sampled (a prompt token) to the chain's state.

        Raises InvalidTokenError for an id outside the vocabulary and GrammarError for a token the
        grammar rejects: llama.cpp would terminate the process on either.
        """
        chain = self._get()
        self.vocab.check_token(token)
        if self._grammar is not None and not self._grammar_allows(token):
            raise GrammarError(f"the grammar does not accept token {token} here")
        lib.llama_sampler_accept(chain, token)

    def clone(self) -> SamplerChain:
        """An independent copy, state included (RNG, penalty history, grammar position)."""
        chain = self._get()
        twin = SamplerChain.__new__(SamplerChain)
        twin.vocab = self.vocab
        self.vocab._model._acquire_native()
        twin._own(lib.llama_sampler_clone(chain))
        twin.names = list(self.names)
        twin._first_k = self._first_k
        twin._grammar = None
        if self._grammar is not None:
            twin._grammar = lib.llama_sampler_chain_get(twin._ptr, self.names.index("grammar"))
        return twin


FAST_K_MAX = 256  # beyond it, building the whole row and sorting it is no slower


def attach(ctx: Context, seq_id: int, chain: SamplerChain | None) -> bool:
    """Backend sampling: ``chain`` chooses ``seq_id``'s tokens inside ``ctx``'s decode graph from
    the next decode on (None: back to choosing from the logits). The chain must stay open while
    attached; :func:`sample_rows` then takes its token (and accepts it). Each change makes the next
    decode build its graph anew. True when the chain runs in the graph; a sequence may give only
    one output per decode while it does. Raises InvalidRequestError for a chain that cannot."""
    if chain is not None and not chain.backend_capable:
        raise InvalidRequestError(f"these samplers cannot run in the decode graph: {chain.names}")
    return bool(lib.llama_set_sampler(ctx._get(), ctx._check_seq(seq_id), ffi.NULL if chain is None else chain._get()))


def sample_rows(ctx: Context, chains: Sequence[SamplerChain], rows: Sequence[int], threads: int = 1,
                top_k: Sequence[int] | None = None) -> list[int]:
    """Choose (and accept) a token for each of ``rows`` of ``ctx``'s last decode, ``chains[i]``
    for ``rows[i]``: one call for the whole step, the rows shared out over up to ``threads``
    threads. The chains must be distinct.

    ``top_k[i]`` > 0 says chain i begins with top-k of that k (or is greedy, with 1) and nothing
    before it reads the row: then only those k candidates are built (a row with a NaN is built
    whole), which is faster and chooses the same token (:meth:`SamplerChain.fast_k` tells the k of a chain).
    """
    if len(chains) != len(rows) or (top_k is not None and len(top_k) != len(rows)):
        raise ValueError("one chain (and one top_k) per row")
    if len({id(c) for c in chains}) != len(chains):
        raise ValueError("the chains must be distinct: a chain samples one row at a time")
    ctx.check_outputs(rows)
    n = len(rows)
    if n == 0:
        return []
    out = ffi.new("int32_t[]", n)
    if top_k is not None and not all(type(k) is int and k >= 0 for k in top_k):
        for k in top_k:
            integer("top_k", k, low=0)
    ks = ffi.NULL if top_k is None else ffi.new("int32_t[]", list(top_k))
    lib.aiollama_sample_rows(ctx._get(), ffi.new("struct llama_sampler *[]", [c._get() for c in chains]),
                             ffi.new("int32_t[]", list(rows)), ks, n, integer("threads", threads, low=1), out)
    tokens = list(out)
    if -1 in tokens:
        raise MemoryError("sampling could not allocate its candidates")
    return tokens
