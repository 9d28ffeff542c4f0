"""The engine: one model, one context, one decode thread, any number of conversations.

``Engine`` serves async code (asyncio or trio, through anyio); ``SyncEngine`` serves plain threads.
Both put their conversations into the same batches: neither takes a lock around decoding, and no
caller gets a context of its own.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio

from aiollama._validate import lora_set
from aiollama.api.chat_turns import ChatTurns
from aiollama.api.client import EngineClient
from aiollama.api.conversation import Completion, Conversation
from aiollama.api.images import Image, pictures
from aiollama.api.pooled import answer, embed_request, pair_tokens, reply, rerank_request
from aiollama.api.portal import AsyncSink, current_portal
from aiollama.config import EngineConfig
from aiollama.core.commands import ClearCache, Load, NewConversation
from aiollama.core.outputs import Statistics
from aiollama.errors import (
    ConversationFileError,
    EngineClosed,
    EngineDead,
    InvalidRequestError,
)
from aiollama.formats import savefile
from aiollama.formats.chat import ChatTemplate
from aiollama.formats.infill import infill_tokens, text_or_tokens
from aiollama.formats.messages import Messages, normalize
from aiollama.formats.tokens import Tokenizer
from aiollama.models import default_model
from aiollama.runner.executor import NativeExecutor
from aiollama.sampling import seed_for
from aiollama.sched.step import Executor

ExecutorFactory = Callable[[EngineConfig], Executor]


def _native(config: EngineConfig) -> Executor:
    assert config.model_path is not None
    return NativeExecutor(config, config.model_path)


class Engine:
    """Serves many concurrent conversations from one llama.cpp context, for asyncio and trio.

    ``async with Engine(path, ...) as engine`` loads the model (``path`` None means the default
    model, fetched on first use) and starts the decode thread; leaving the block ends running
    generations (their streams raise ``EngineClosed``) and frees everything, and raises
    ``EngineDead`` if the decode thread had failed. The engine belongs to the event loop that
    started it (elsewhere: ``WrongEventLoop``; plain threads use ``SyncEngine``, which drives one).

    ``options`` are the fields of :class:`~aiollama.config.EngineConfig`: ``n_ctx``, ``n_seq_max``,
    ``n_batch``, ``step_tokens``, ``n_threads``, ``n_gpu_layers``, ``max_queued``...; an unknown or
    out-of-range one raises ``InvalidRequestError`` at once. ``step_tokens`` is the per-step token
    budget: decode rows of running streams go first, prompt chunks share the rest, so a long prompt
    never stalls streams. ``max_queued`` bounds the generations waiting for a seq id; beyond it
    ``stream()`` raises ``Overloaded``. ``executor`` replaces llama.cpp with another
    :class:`~aiollama.sched.step.Executor` (a fake one in tests), built on the decode thread from the
    config.
    """

    def __init__(self, model_path: str | os.PathLike[str] | None = None, *,
                 executor: ExecutorFactory | None = None, **options: Any) -> None:
        self._config = EngineConfig.from_options(model_path, **options)
        self._executor = executor
        self._engine_client: EngineClient | None = None

    def __del__(self) -> None:
        client = getattr(self, "_engine_client", None)
        if client is not None and not client.closed:
            warnings.warn("unclosed aiollama engine: use 'async with' / 'with', or close it",
                          ResourceWarning, source=self, stacklevel=2)
            client.close_nowait()  # asks the decode thread to stop; does not wait

    def _start(self, owner: Any = None) -> None:
        if self._engine_client is not None:
            raise RuntimeError("the engine was already started")
        self._config, self._engine_client = open_client(self._config, self._executor, owner)

    @property
    def config(self) -> EngineConfig:
        """The engine's settings (with the default model's path once started without one)."""
        return self._config

    @property
    def model_path(self) -> os.PathLike[str] | None:
        """The GGUF file the engine serves (None before an engine of the default model starts)."""
        return self._config.model_path

    @property
    def _client(self) -> EngineClient:
        if self._engine_client is None:
            raise EngineClosed("the engine is not started: use 'async with' / 'with', or start it")
        return self._engine_client

    @property
    def serving(self) -> bool:
        """True while the engine takes requests: started, not closed, its decode thread alive."""
        return self._engine_client is not None and self._engine_client.usable

    def tokenize(self, text: str, *, add_special: bool = False, special: bool = False) -> list[int]:
        """Token ids for ``text``; thread-safe, does not wait for the decode thread."""
        return self._client.tokenize(text, add_special=add_special, special=special)

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        """The text of ``tokens``, joined as llama.cpp's ``llama_detokenize`` joins them (the space a
        SentencePiece model puts before the text dropped from the first piece, a picture's
        placeholders left out);
        ``special``: special tokens as their text (as llama-server shows a prompt), otherwise left
        out. Thread-safe, does not wait for the decode thread."""
        return self._client.detokenize(tokens, special=special)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (special tokens as their text); thread-safe."""
        return self._client.tokenizer.piece(token)

    def render_chat(self, messages: Messages, *, add_generation_prompt: bool = True, **options: Any) -> str:
        """The text the model's chat template makes of ``messages``, as llama.cpp renders it (the
        prompt llama-server evaluates for the same request, and ``chat()`` for a new conversation);
        ``options`` are ``chat()``'s (``tools``, ``tool_choice``, ``chat_template_kwargs``,
        ``reasoning_effort``, ``continue_final_message``...). Raises ``ChatTemplateError`` for
        malformed messages or kwargs, or what the template refuses, and ``InvalidRequestError``
        for a malformed tool."""
        options.pop("reasoning_format", None)  # how a reply is read: nothing of the prompt
        rendered = self._client.chat_template.render(normalize(pictures(messages)[0]),
                                                     add_generation_prompt=add_generation_prompt, **options)
        return rendered.prompt

    def chat_template_reads(self, name: str) -> bool:
        """Whether the model's chat template reads the variable ``name`` (``enable_thinking``, say),
        so that ``chat_template_kwargs`` can set it."""
        return self._client.chat_template.reads(name)

    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template as llama.cpp reads it: its ``source``, ``caps`` (what it
        supports: tools, a system role, thinking...) and ``supports_thinking``."""
        return self._client.chat_template

    def statistics(self) -> Statistics:
        """The engine's counters after the latest decode step (conversations, KV cells, tokens, time)."""
        return self._client.statistics()

    def open_conversations(self) -> int:
        """The conversations of this engine not closed yet (forks included)."""
        return 0 if self._engine_client is None else self._engine_client.open_conversations()

    @property
    def n_ctx(self) -> int:
        """The tokens one conversation can hold: ``n_ctx`` as given, or its share of a split cache
        (``kv_unified=False``)."""
        return self._client.n_ctx

    @property
    def n_vocab(self) -> int:
        """The model's vocabulary size: the length of a logits row."""
        return self._client.tokenizer.n_vocab

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (thread-safe): ``tokenize``, ``piece``, ``check_token``, its
        ``bos``, ``eos`` and ``fim`` tokens."""
        return self._client.tokenizer

    @property
    def model_info(self) -> Mapping[str, str | int]:
        """The served model: ``description`` (llama.cpp's), ``ftype`` (its weights' type),
        ``n_params``, ``size`` (bytes), ``n_embd``, ``n_ctx_train`` and ``n_vocab``."""
        self._client.check()
        return self._client.model_info

    @property
    def fim_tokens(self) -> Mapping[str, int]:
        """The vocabulary's fill-in-the-middle tokens: "pre", "suf", "mid", "rep", "sep" (-1 where
        it has none)."""
        return dict(self._client.tokenizer.fim)

    def infill_tokens(self, prefix: str | Sequence[str | int], suffix: str | Sequence[str | int], *,
                      extra: Sequence[Mapping[str, str]] = (), prompt: str | Sequence[int] = "",
                      n_predict: int = -1) -> list[int]:
        """The prompt that fills in the middle of a file between ``prefix`` and ``suffix`` (text,
        token ids, or a list mixing both), with ``extra`` chunks of other files first
        (``{"filename", "text"}``) and ``prompt`` after the prefix, as llama-server's ``/infill``
        builds it: the prefix and suffix cut to fit one batch, 3 to 1, and the extra chunks to what
        the context leaves past a batch and ``n_predict`` tokens. Raises InvalidRequestError for a
        model without FIM tokens."""
        tokenizer = self._client.tokenizer
        tail = tokenizer.tokenize(prompt, add_special=False, special=True) if isinstance(prompt, str) \
            else text_or_tokens(tokenizer, prompt, "prompt")
        config = self._client.config
        return infill_tokens(tokenizer, prefix, suffix, extra, tail, n_batch=config.n_batch,
                             n_predict=n_predict, n_ctx=self.n_ctx)

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            await self.aclose()
        except EngineDead:
            if exc is None:
                raise  # otherwise the body's own exception (often this EngineDead) goes on

    async def start(self) -> None:
        """Load the model and start the decode thread (in a worker thread: the loop keeps running).

        The engine then belongs to this event loop; anywhere else it raises ``WrongEventLoop``.
        """
        owner = current_portal().owner
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._start, owner)

    async def aclose(self) -> None:
        """Cancel running generations, stop the decode thread and free all native memory.

        Raises ``EngineDead`` if the decode thread had failed (every stream got it too).
        """
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(close_client, self._engine_client)

    def close_nowait(self) -> None:
        """Ask the engine to stop without waiting (running streams end with ``EngineClosed``)."""
        if self._engine_client is not None:
            self._engine_client.close_nowait()

    def conversation(self, prompt: str | Sequence[int] | None = None, *, cache_salt: str | None = None,
                     lora: Mapping[str, float] | None = None) -> Conversation:
        """A new, empty conversation (or one holding ``prompt``). Cheap: it takes no seq id yet.
        With ``cache_salt`` it (and its forks) share KV cells, cached or live, only with
        conversations of the same salt: callers with different salts never see each other's cache.
        ``lora`` maps adapters loaded with the engine (its ``lora`` option) to their scales: every
        decode of this conversation and its forks applies them. Conversations of different adapter
        sets decode in separate steps, taking turns, and share no cells."""
        return new_conversation(self._client, prompt, cache_salt, lora)

    async def embed(self, texts: str | Sequence[str] | Sequence[Sequence[int]], *,
                    normalize: bool = True) -> list[Any]:
        """One embedding per text (or token list), mean-pooled over a generative model's last
        hidden states, or pooled as a dedicated embedding model (BERT and its kin) says, or as the
        engine's ``pooling`` option says (``"none"``: a list of one vector per token for each
        text); normalised to unit length unless ``normalize=False``. Many texts go into one decode.

        Raises ContextFull for a text longer than the embeddings context (2048 tokens at most),
        InvalidRequestError for an empty one.
        """
        return await answer(self._client, lambda sink: embed_request(self._client, texts, normalize, sink))

    async def rerank(self, query: str, documents: Sequence[str]) -> list[float]:
        """Each document's relevance to ``query`` (higher: more), in order: a reranker's first
        classifier output for the pair, built as llama-server's ``/rerank`` builds it. Needs a
        model pooled by rank (or ``pooling="rank"``), else InvalidRequestError; ContextFull for a
        pair longer than the embeddings context. The pairs share decodes, between steps."""
        rows = await answer(self._client, lambda sink: rerank_request(self._client, query, documents, sink))
        return [float(row[0]) for row in rows]

    def rerank_tokens(self, query: str, document: str) -> list[int]:
        """The tokens :meth:`rerank` scores for one pair (their count is what it costs)."""
        return pair_tokens(self._client, query, document)

    async def encode_images(self, images: Sequence[Image]) -> None:
        """Encode pictures on a worker thread, so that the prompts or chats that send them next do
        not encode them on the event loop. Raises ImageError as a prompt with them would."""
        client = self._client
        for image in images:
            await anyio.to_thread.run_sync(client.images.tokens, image)

    async def clear_cache(self) -> None:
        """Drop the prefix cache: what closed conversations left in the KV cache, every state
        parked in host memory, and this model's files in ``cache_dir``. Conversations still open
        keep theirs."""
        await reply(self._client, lambda sink: self._client.send(ClearCache(sink)))

    async def load(self, path: str | os.PathLike[str]) -> Conversation:
        """A conversation saved with ``Conversation.save``: :meth:`restore` of the file's bytes."""
        return await self.restore(await anyio.to_thread.run_sync(_read_file, path))

    async def restore(self, data: bytes) -> Conversation:
        """A conversation from ``Conversation.snapshot``: its tokens, its chat, and its KV cells
        when it has them and they fit (evaluated again when it next streams, otherwise).
        ConversationFileError: damaged, cut short, or not a saved conversation; ModelMismatch:
        saved from another model or cache layout; nothing changes in the engine then."""
        convs: list[Conversation] = []
        await reply(self._client, lambda sink: convs.append(load_request(self._client, data, sink)))
        return convs[0]

    async def generate_parallel(self, prompts: Sequence[str | Sequence[int]], **params: Any) -> list[Completion]:
        """One completion per prompt, in order, generated in the same batches. With a ``seed``,
        prompt ``i`` is sampled with ``seed + i``."""
        return await generate_parallel(self, prompts, params)

def _read_file(path: str | os.PathLike[str]) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _seeded(params: dict[str, Any], i: int) -> dict[str, Any]:
    if params.get("seed") is None:
        return params
    return {**params, "seed": seed_for(params["seed"], i)}


def new_conversation(client: EngineClient, prompt: str | Sequence[int] | None, salt: str | None = None,
                     lora: Any = None) -> Conversation:
    client.check()
    if client.owner is not None:
        client.check_loop()
    if salt is not None and not isinstance(salt, str):
        raise InvalidRequestError(f"cache_salt must be a str, got {salt!r}")
    adapters = lora_set(lora, client.config.lora)
    conv = Conversation(client, client.new_id())
    client.send(NewConversation(conv.id, salt=salt, lora=adapters))
    if prompt is not None:
        conv.prompt(prompt)
    return conv


def load_request(client: EngineClient, data: bytes, sink: AsyncSink) -> Conversation:
    """Check a saved conversation and ask the decode thread to bring it back into ``sink``."""
    client.check()
    saved = savefile.load(data, client.fingerprint)
    savefile.check_tokens(saved.tokens, client.tokenizer.n_vocab, {n: r for n, _, r in saved.images})
    tokens, images = client.images.loaded(saved.tokens, saved.images)
    try:
        chat = ChatTurns.from_state(saved.chat)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConversationFileError(f"the saved conversation's chat is malformed: {exc!r}") from None
    conv = Conversation(client, client.new_id(), tokens=tokens)
    conv._chat = chat
    client.send(Load(conv.id, tuple(tokens), saved.n_cached, saved.state, sink, images))
    return conv


def open_client(config: EngineConfig, factory: ExecutorFactory | None, owner: Any) -> tuple[EngineConfig, EngineClient]:
    """Start an engine's decode thread: the config it runs (the default model's path filled in) and
    its client."""
    if factory is None:
        factory = _native
        if config.model_path is None:
            config = dataclasses.replace(config, model_path=default_model())
    run, executor = config, factory
    client = EngineClient(run, lambda: executor(run), owner)
    client.start()
    return config, client


def close_client(client: EngineClient | None) -> None:
    if client is None:
        return
    if not client.closed:
        client.close()
    elif client.dead is not None:
        raise client.dead


async def generate_parallel(engine: Engine, prompts: Sequence[str | Sequence[int]],
                            params: dict[str, Any]) -> list[Completion]:
    convs = [engine.conversation(p) for p in prompts]
    results: list[Completion | None] = [None] * len(convs)
    try:
        streams = [c.stream(**_seeded(params, i)) for i, c in enumerate(convs)]

        async def collect(i: int) -> None:
            results[i] = await streams[i]

        async with anyio.create_task_group() as tg:
            for i in range(len(streams)):
                tg.start_soon(collect, i)
    finally:
        for conv in convs:
            await conv.aclose()
    return [r for r in results if r is not None]
