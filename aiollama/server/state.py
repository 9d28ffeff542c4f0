"""What every endpoint of one app shares: the engine it serves, its metrics, and how engine errors
and bodies become HTTP answers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.abc

from aiollama import Engine, Statistics
from aiollama.errors import (
    AiollamaError,
    ClosedError,
    ContextFull,
    EngineDead,
    InvalidRequestError,
    Overloaded,
)
from aiollama.server.background import Runs
from aiollama.server.bad_request import BadRequest
from aiollama.server.fetch import Fetcher
from aiollama.server.guard import Guard
from aiollama.server.metrics import Metrics
from aiollama.server.store import ResponseStore

# a chat reply runs to the turn's end; the sampling defaults are llama-server's (the engine's)
CHAT_DEFAULTS: dict[str, Any] = {"max_tokens": None}


@dataclass
class State:
    """The app's engine (None outside its lifespan when the app owns it), its name and metrics."""

    model_name: str
    retry_after: int
    engine: Engine | None = None
    owns_engine: bool = False
    guard: Guard = field(default_factory=Guard)
    responses: ResponseStore = field(default_factory=ResponseStore)
    runs: Runs = field(default_factory=lambda: Runs(3600.0))  # background responses
    task_group: anyio.abc.TaskGroup | None = None  # the app's, for work no request holds (background responses)
    longest_piece: int = 0  # the most bytes one token stands for (0: not looked up yet)
    defaults: dict[str, Any] = field(default_factory=dict)  # stream parameters a request may override
    fetcher: Fetcher | None = None  # how image URLs are fetched; None: they are not
    reasoning_format: str = "auto"  # how replies' thinking is returned, where a request does not say
    props_writable: bool = False  # POST /props answers (it changes nothing), as llama-server's --props
    load_error: BaseException | None = None  # why the engine the app loads failed to start
    chat_defaults: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs, reasoning_effort
    embd_normalize: int = 2  # /embedding's normalisation where a request gives none
    replica: str = ""  # this app's name among replicas, in its response ids
    metrics: Metrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.statistics, self.settings, self.gauges)

    def name(self) -> str:
        """The model id clients see: as given, else the served file's name."""
        path = self.engine.model_path if self.engine is not None else None
        return self.model_name or (Path(path).stem if path is not None else "default")

    async def close_engine(self) -> None:
        """End what still runs (streams get an error event, requests a 503) by closing an engine
        this app owns; an engine the caller owns is left alone."""
        if self.owns_engine and self.engine is not None:
            await self.engine.aclose()

    def params(self, given: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
        """A request's stream parameters over the server's defaults (``--temp``, ``-n``,
        ``--reasoning-budget``...) over the API's own (``base``: OpenAI's temperature 1, and no
        length limit for chat; llama-server's native endpoints have the engine's, which are
        llama-server's)."""
        return {**base, **self.defaults, **given}

    def chat(self, given: dict[str, Any]) -> dict[str, Any]:
        """A request's chat options over the server's defaults (``--reasoning-format``,
        ``--reasoning-effort``, and ``--chat-template-kwargs`` under the request's own)."""
        out = {"reasoning_format": self.reasoning_format, **given}
        for name, value in self.chat_defaults.items():
            if name == "chat_template_kwargs":
                out[name] = {**value, **(given.get(name) or {})}
            elif given.get(name) is None:
                out[name] = value
        return out

    def settings(self) -> dict[str, str] | None:
        """The engine's settings that its flags chose, as labels."""
        if self.engine is None:
            return None
        c = self.engine.config
        flash = {True: "on", False: "off", None: "auto"}[c.flash_attn]
        return {"n_ctx": str(c.n_ctx), "n_seq_max": str(c.n_seq_max), "kv_unified": str(c.kv_unified).lower(),
                "cache_type_k": c.cache_type_k, "cache_type_v": c.cache_type_v, "flash_attn": flash,
                "pooling": c.pooling or "model"}

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The server's own gauges: what its response store holds."""
        store = self.responses
        return {"responses_stored": ("Responses kept for previous_response_id", len(store.items)),
                "responses_stored_bytes": ("Bytes their conversations hold (KV cells, pictures, JSON)", store.size)}

    def statistics(self) -> Statistics | None:
        try:
            return None if self.engine is None else self.engine.statistics()
        except AiollamaError:
            return None


def check_prompt_size(state: State, engine: Engine, texts: Iterable[str], room: int) -> None:
    """A 400 for prompt text that cannot fit ``room`` tokens, decided before tokenizing it: no
    token stands for more bytes than the vocabulary's longest piece, so text of more bytes than
    ``room`` such pieces cannot fit. Tokenizing runs on the event loop, so a huge prompt would
    hold every other request up for seconds."""
    if state.longest_piece == 0:
        state.longest_piece = max(len(engine.token_bytes(t)) for t in range(engine.n_vocab)) or 1
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > room * state.longest_piece:
        raise BadRequest(f"the prompt ({size} bytes) cannot fit the context of {room} tokens",
                         code="context_length_exceeded")


def lora_names(engine: Engine, chosen: list[tuple[str | int, float]]) -> dict[str, float]:
    """A request's adapters by name (an ``id`` is an index into those the server loaded, in the
    order given); a 400 naming one that is not loaded."""
    loaded = list(engine.config.lora)
    out: dict[str, float] = {}
    for key, scale in chosen:
        name = loaded[key] if isinstance(key, int) and 0 <= key < len(loaded) else key
        if not isinstance(name, str) or name not in loaded:
            raise BadRequest(f"no LoRA adapter {key!r} is loaded (loaded: {', '.join(loaded) or 'none'})",
                             param="lora")
        out[name] = out.get(name, 0.0) + scale
    return out


def serving_engine(state: State) -> Engine:
    engine = state.engine
    if engine is not None and engine.serving:
        return engine
    if state.load_error is not None:
        raise BadRequest(f"the model failed to load: {state.load_error}", status=503, code="unavailable")
    if engine is None and state.owns_engine:
        raise BadRequest("Loading model", status=503, code="unavailable")  # llama-server's words
    raise BadRequest("the engine is not serving", status=503, code="unavailable")


def translate(exc: AiollamaError) -> BadRequest:
    if isinstance(exc, Overloaded):
        return BadRequest(str(exc), status=503, code="overloaded")
    if isinstance(exc, ContextFull):  # with llama-server's fields where the engine knows them
        extra = {} if exc.n_ctx is None else {"n_prompt_tokens": exc.n_prompt_tokens, "n_ctx": exc.n_ctx}
        return BadRequest(str(exc), code="context_length_exceeded", extra=extra)
    if isinstance(exc, InvalidRequestError):
        return BadRequest(str(exc), param=exc.param)
    if isinstance(exc, (ClosedError, EngineDead)):
        return BadRequest(str(exc), status=503, code="unavailable")
    return BadRequest(str(exc), status=500, code="internal_error")
