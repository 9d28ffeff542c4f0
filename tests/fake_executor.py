"""An executor with no model: the engine's whole thread, scheduling and delivery run against it.

The fake model reads each sequence back from a fake KV cache (so it sees exactly what the engine
fed it, at the positions it fed it) and picks the next token as a function of that history alone:
its output is the same whatever runs beside it, so any difference is the engine's fault. Tokens
0-255 are bytes ('a'..'z' are generated); 256 and up are special tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence

from fake_kv import FakeKV

from aiollama.config import EngineConfig
from aiollama.errors import GrammarError, InvalidTokenError
from aiollama.formats.tokens import SpecialToken
from aiollama.sampling import SamplingParams
from aiollama.sched.step import Plan, Sampled, StepResult, StepStatus

BOS, EOS, IM_START, IM_END = 256, 257, 258, 259
SPECIALS = {BOS: "<s>", EOS: "</s>", IM_START: "<|im_start|>", IM_END: "<|im_end|>"}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ByteTokenizer:
    """Bytes as tokens, plus four special tokens (split out only with ``special``)."""

    n_vocab = 260
    bos, eos, eot = BOS, EOS, IM_END
    add_bos = False
    fim = {"pre": -1, "suf": -1, "mid": -1, "rep": -1, "sep": -1}

    def tokenize(self, text: str, *, add_special: bool, special: bool) -> list[int]:
        out: list[int] = []
        rest = text
        while rest:
            hits = [(rest.find(t), tok, t) for tok, t in SPECIALS.items() if special and t in rest]
            if not hits:
                out += list(rest.encode())
                break
            at, tok, t = min(hits)
            out += list(rest[:at].encode()) + [tok]
            rest = rest[at + len(t):]
        return out

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        return b"".join(self.piece(t) for t in tokens if special or t < 256).decode("utf-8", "replace")

    def piece(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else SPECIALS[token].encode()

    def check_token(self, token: object) -> int:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.n_vocab:
            raise InvalidTokenError(f"token id {token!r} is outside the vocabulary [0, {self.n_vocab})")
        return token

    def is_control(self, token: int) -> bool:
        return token >= 256

    def token_text(self, token: int) -> str:
        return self.piece(token).decode("utf-8", "replace")

    def special_tokens(self) -> Sequence[SpecialToken]:
        return sorted((SpecialToken(tok, text) for tok, text in SPECIALS.items()), key=lambda s: -len(s.text))

    def chat_layer(self, source: str | None = None) -> object:
        from aiollama.native.chat import ChatTemplates

        return ChatTemplates(source or CHATML, bos_token="<s>", eos_token="</s>")

    def guidance(self) -> object:
        from aiollama.formats import constraints

        pieces = [(constraints.SPECIAL if t >= 256 else b"") + self.piece(t) for t in range(self.n_vocab)]
        return constraints.make_tokenizer(pieces, eog=[EOS, IM_END], bos=BOS, special=list(SPECIALS),
                                          encode=lambda text: self.tokenize(text, add_special=False, special=False))



def next_token(history: Sequence[int], eog_every: int | None, period: int | None = None) -> int:
    """The fake model: a function of the history only. With ``period`` it repeats the token that
    many places back (a model that copies: n-gram drafts from its history are right)."""
    if period and len(history) >= period:
        return history[-period]
    x = len(history)
    for t in history[-8:]:
        x = (x * 31 + t) % 1_000_003
    if eog_every and x % eog_every == 0:
        return EOS
    return 97 + x % 26


def guided_token(history: Sequence[int], guide: Sequence[int], scale: float) -> int:
    """The fake model under classifier-free guidance: the plain token at scale 1, otherwise a
    function of both histories."""
    token = next_token(history, None)
    if scale == 1.0:
        return token
    return 97 + (token + next_token(guide, None) * int(scale * 7)) % 26


Fault = Callable[[Plan], StepStatus | None]


class FakeExecutor:
    """:class:`~aiollama.sched.step.Executor` over :class:`FakeKV` and :func:`next_token`.

    ``fault(plan)`` may return a status to inject instead of decoding (ABORTED and FAILED keep the
    first half of the plan's tokens, as a partly computed llama_decode does). With ``hold``, a step
    holding a prompt chunk waits until ``hold`` is set or an abort is requested, and sets
    ``prefilling`` meanwhile: a long decode the test can cancel at a known moment.
    """

    def __init__(self, config: EngineConfig, *, eog_every: int | None = None, fault: Fault | None = None,
                 hold: threading.Event | None = None, period: int | None = None, memory: str = "kv") -> None:
        self.n_ctx, self.n_batch = config.n_ctx, config.n_batch
        self.n_cells = config.n_ctx
        self.tokenizer = ByteTokenizer()
        self.n_seq_max = config.context_seq_ids(self.tokenizer.n_vocab)  # ids for the prefix cache too
        self.memory = memory  # "hybrid": a recurrent state beside the cells, with llama.cpp's rules
        self.kv = FakeKV(config.n_ctx, self.n_seq_max, recurrent=memory != "kv")
        self.fingerprint = {"model": "fake", "n_vocab": ByteTokenizer.n_vocab}
        self.model_info = {"description": "fake", "ftype": "none", "n_params": 0, "size": 0, "n_embd": 0,
                           "kv_bytes_per_cell": 64, "n_ctx_train": config.n_ctx, "n_vocab": ByteTokenizer.n_vocab}
        self.can_shift = memory == "kv"
        self.kv_unified = True
        self.placement = "CPU"
        self.eog_every = eog_every
        self.period = period
        self.fault = fault
        self.hold = hold
        self.prefilling = threading.Event()
        self.plans: list[Plan] = []
        self.sampling: dict[int, SamplingParams] = {}
        self.matchers: dict[int, object] = {}
        self.guidance: dict[int, tuple[int, float]] = {}
        self.closed = False
        self._abort = threading.Event()
        self._submitted: Plan | None = None

    def start_sampling(self, conv: int, params: SamplingParams, history: Sequence[int],
                       matcher: object = None, guidance: tuple[int, float] | None = None) -> None:
        if params.grammar is not None:
            raise GrammarError("the fake executor has no GBNF grammars")
        self.sampling[conv] = params
        if matcher is not None:
            self.matchers[conv] = matcher
        if guidance is not None:
            self.guidance[conv] = guidance

    def _choose(self, conv: int, history: list[int]) -> tuple[int, bool]:
        """The fake model's token, or under a constraint the first token it allows if not that one."""
        token = next_token(history, self.eog_every, self.period)
        matcher = self.matchers.get(conv)
        if matcher is None:
            return token, False
        bits = matcher.compute_bitmask()  # type: ignore[attr-defined]
        allowed = [t for t in range(self.tokenizer.n_vocab) if bits[t // 8] >> (t % 8) & 1]
        if token not in allowed:
            token = allowed[0]
        matcher.consume_token(token)  # type: ignore[attr-defined]
        return token, bool(matcher.is_stopped())  # type: ignore[attr-defined]

    def stop_sampling(self, conv: int) -> None:
        self.sampling.pop(conv, None)
        self.matchers.pop(conv, None)
        self.guidance.pop(conv, None)

    def execute(self, plan: Plan, on_decode: Callable[[], None] | None = None) -> StepResult:
        if plan.slices and on_decode is not None:
            on_decode()
        try:
            return self._execute(plan)
        finally:
            self._abort.clear()

    # Overlapped steps: the decode runs in collect(), as a GPU's finishes when its rows are read.

    def submit(self, plan: Plan) -> None:
        assert self._submitted is None, "submit() twice without collect()"
        self._submitted = plan

    def collect(self, discard: Collection[int] = ()) -> StepResult:
        plan, self._submitted = self._submitted, None
        assert plan is not None, "collect() without submit()"
        try:
            return self._execute(plan, frozenset(s.conv for s in plan.slices if s.conv in discard))
        finally:
            self._abort.clear()

    def _execute(self, plan: Plan, discard: frozenset[int] = frozenset()) -> StepResult:
        applied = self.kv.apply(plan.ops)
        if not plan.slices:
            return StepResult(StepStatus.OK, **applied)
        self.plans.append(plan)
        status = self.fault(plan) if self.fault is not None else None
        if status is None and self.hold is not None and plan.prefilling:
            self.prefilling.set()
            while not self.hold.is_set() and not self._abort.is_set():
                self._abort.wait(0.001)
            self.prefilling.clear()
            status = StepStatus.ABORTED if self._abort.is_set() else None
        if status is StepStatus.NO_KV_SLOT or (status is None and not self.kv.fits(plan)):
            return StepResult(StepStatus.NO_KV_SLOT, **applied)
        if status is not None:
            self.kv.decode(plan, limit=plan.n_tokens // 2)
            return StepResult(status, n_cached={s.conv: self.kv.pos_max(s.seq_id) + 1 for s in plan.slices},
                              detail=f"injected {status.name}", **applied)
        assert self.kv.decode(plan)
        sampled = []
        rows = {s.conv: s for s in plan.slices if s.logits}
        for s in plan.slices:
            if s.conv in discard:
                if self.memory == "kv":
                    self.kv.remove(s.seq_id, s.pos)  # a recurrent state keeps what it read
                continue
            if not s.logits or s.conv not in self.sampling:
                continue  # a guiding sequence's row: read by the stream it guides
            history = self.kv.tokens(s.seq_id)
            held = len(history) - s.draft  # what precedes the draft
            if s.conv in self.guidance:
                guide, scale = self.guidance[s.conv]
                assert guide in rows, "a guided stream sampled without its guide's logits in the step"
                sampled.append(self._sampled(s.conv, guided_token(history, self.kv.tokens(rows[guide].seq_id),
                                                                  scale), False))
                continue
            token, final = self._choose(s.conv, history[:held])
            sampled.append(self._sampled(s.conv, token, final))
            taken = 0
            while taken < s.draft and token == s.tokens[1 + taken] and token not in (EOS, IM_END):
                taken += 1  # the draft token is right: choose from the history that holds it
                token, final = self._choose(s.conv, history[:held + taken])
                sampled.append(self._sampled(s.conv, token, final))
            if taken < s.draft:
                self.kv.remove(s.seq_id, s.pos + 1 + taken)
        return StepResult(StepStatus.OK, tuple(sampled), **applied, discarded=discard)

    def _sampled(self, conv: int, token: int, final: bool) -> Sampled:
        return Sampled(conv, token, self.tokenizer.piece(token), token in (EOS, IM_END), final)

    def read_state(self, seq_id: int) -> bytes:
        return self.kv.read(seq_id)

    def write_state(self, seq_id: int, data: bytes) -> bool:
        return self.kv.write(seq_id, data)

    def request_abort(self) -> None:
        self._abort.set()

    def close(self) -> None:
        self.closed = True


def solo_tokens(prompt: Sequence[int], n: int, eog_every: int | None = None, period: int | None = None) -> list[int]:
    """What the fake model generates for ``prompt`` alone, greedily, ignoring EOG."""
    history = list(prompt)
    out = []
    for _ in range(n):
        token = next_token(history, eog_every, period)
        history.append(token)
        out.append(token)
    return out
