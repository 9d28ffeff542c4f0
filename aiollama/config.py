"""The engine's settings: one frozen, checked value, the only place their defaults are written."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from aiollama._validate import MAX_SEQ, integer
from aiollama.errors import InvalidRequestError
from aiollama.sampling import MAX_DRAFT_TOKENS

# a draft model's drafts, unless draft_tokens says otherwise
DRAFT_MODEL_TOKENS = 8

# a chat template's thinking switch by default, as llama-server's --reasoning
REASONING_MODES = ("auto", "on", "off")

# how embeddings pool a text's hidden states (llama-server's --pooling; rank is a reranker's)
POOLING_TYPES = ("none", "mean", "cls", "last", "rank")

# the KV cache element types llama.cpp can use (llama-server's --cache-type-k/-v)
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# ... and the bytes each element takes (a quantized block of 32 elements shares its scales)
CACHE_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                    "q5_0": 22 / 32, "q5_1": 24 / 32}

# llama.cpp reserves an output row of n_vocab floats per seq id; the default spends this much on them.
OUTPUT_ROWS_BYTES = 64 * 2**20


@dataclass(frozen=True)
class EngineConfig:
    """An engine's settings, checked on creation; the only place their defaults are written.

    ``model_path`` None means the default model (fetched on first use). ``n_ctx`` is the KV cache
    shared by every conversation; ``n_seq_max`` how many generations share a batch; ``n_batch`` the
    most tokens one ``llama_decode`` takes; ``step_tokens`` the per-step token budget (decode rows of
    running streams first, prompt chunks share the rest); ``n_threads`` None takes a thread per
    physical core this process may use, as llama.cpp's tools do (see :mod:`aiollama.native.threads`);
    ``max_queued`` bounds the generations waiting for a seq id.

    ``cache_seq_ids`` is how many seq ids the context holds beyond ``n_seq_max``, for idle
    conversations and cached prefixes to keep their cells under (the total is at most 256). Each id
    costs llama.cpp an output row of ``n_vocab`` floats, so None takes as many as fit in 64 MiB of
    them (all 256 for a 49k vocabulary, 64 for a 262k one), and at least 32.
    ``host_cache_bytes`` is the host memory that cached prefixes and preempted streams are parked in
    when the context needs their cells (0 turns it off: they are dropped and evaluated again when
    needed). ``cache_dir`` adds a tier on disk under it, of at most ``cache_disk_bytes`` for the
    whole directory: closed conversations' cached prefixes and states leaving host memory are
    written there, least recently used removed first, and a prompt that begins with one reads it
    back instead of evaluating it, after a restart too; engines of one host may share the
    directory. ``checkpoint_bytes`` is the host memory for checkpoints of recurrent states, with a
    recurrent or hybrid model (Mamba, LFM2, Granite-4.0-H, Qwen3.5...): with none (0), a rewind or a
    prefix that ends before what a holder holds evaluates from the start. ``context_shift`` is the
    default policy for a history that outgrows the context: False
    raises ``ContextFull`` (a generation that reaches the end finishes with ``length``); True keeps
    the first ``n_keep`` tokens and drops the older half of the rest. Streams may choose otherwise.
    ``draft_tokens`` > 0 turns on n-gram speculation: decode steps carry drafts of up to that many
    tokens taken from the conversation's own history (0: off; streams may choose otherwise).
    ``draft_model`` is a smaller model with the same vocabulary whose greedy guesses replace the
    n-gram drafts (``draft_tokens`` then defaults to ``DRAFT_MODEL_TOKENS``). ``mtp`` drafts with
    the model's own multi-token-prediction layers instead (GLM-4.5, DeepSeek V3, Qwen3.5...: a GGUF
    that carries them; ``draft_tokens`` defaults as for a draft model).
    ``backend_sampling`` runs each stream's sampler chain inside the decode graph where the chain
    allows it (greedy, top-k/p, min-p, temperature, penalties, logit bias; no log-probabilities,
    logits processors, guidance, constraints or drafts): no logits row is read. It pays where rows
    are costly to move (a GPU); each change of a sequence's stream rebuilds the graph.
    ``overlap`` plans and starts each step's decode before the last step's tokens are delivered,
    so that the finish rules, detokenizing and delivery run while the device computes (see
    docs/architecture.md, "Overlapped steps"); a row of a stream that the last step ended is decoded
    and thrown away. None (the default) turns it on where the decode runs on a GPU: on a CPU,
    ``llama_decode`` computes before it returns, so there is nothing to overlap.
    ``deterministic`` makes each conversation's logits independent of what runs beside it (see the
    README's numerics section for what is and is not promised): ggml-cpu's reference kernels, flash
    attention, no repacked weights, each sequence's cells in position order; CPU only.
    ``n_gpu_layers`` is how many layers go to the GPU: ``"auto"`` (the default) as many as fit
    (llama.cpp's own fitting, as ``llama-server -ngl auto``; none in a build or on a machine without
    a GPU), -1 all of them, 0 none. ``cache_type_k`` and ``cache_type_v`` are the KV cache's element
    types (f16, q8_0, q4_0...; a quantized V cache needs flash attention); ``flash_attn`` None lets
    llama.cpp choose.
    ``kv_unified`` False splits the cache: each seq id gets ``n_ctx`` / (its number of ids) cells of
    its own (``n_seq_max`` ids, plus ``cache_seq_ids``, which then defaults to 0). A step's attention
    then reads each sequence's own cells instead of passing over everyone's, which is faster with
    many streams; but a conversation holds at most that many tokens, and a fork or a cached prefix
    is copied instead of shared. Not with ``deterministic``.
    ``lora`` names LoRA adapter files (``{"name": path}``), loaded once; a conversation chooses
    among them (``engine.conversation(lora={"name": scale})``).
    ``mmproj`` is an image projector for the model (libmtmd's ``mmproj`` GGUF): prompts may then
    hold pictures (:class:`aiollama.Image`).
    ``chat_template`` replaces the chat template the GGUF carries (or lacks): its Jinja text, or a
    path to a file holding it (llama-server's ``--chat-template`` and ``--chat-template-file``).
    ``reasoning`` is the default of a template's thinking switch, as llama-server's
    ``--reasoning``: "auto" thinks where the template can, "on" and "off" set the switch.
    ``pooling`` is how ``embed()`` pools a text's hidden states (llama-server's ``--pooling``):
    "mean", "cls", "last", or "none" (a vector per token); None takes the model's own (mean for a
    generative model).
    """

    model_path: Path | None = None
    n_ctx: int = 8192
    n_seq_max: int = 16
    n_batch: int = 512
    step_tokens: int = 256
    n_threads: int | None = None
    n_gpu_layers: int | str = "auto"
    max_queued: int = 1024
    cache_seq_ids: int | None = None
    host_cache_bytes: int = 2 * 2**30
    cache_dir: Path | None = None
    cache_disk_bytes: int = 20 * 2**30
    checkpoint_bytes: int = 512 * 2**20
    context_shift: bool = False
    n_keep: int = 0
    draft_tokens: int = 0
    draft_model: Path | None = None
    mtp: bool = False
    deterministic: bool = False
    backend_sampling: bool = False
    overlap: bool | None = None
    kv_unified: bool = True
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: bool | None = None
    lora: Mapping[str, Path] = field(default_factory=dict)
    mmproj: Path | None = None
    chat_template: str | None = None
    reasoning: str = "auto"
    pooling: str | None = None

    def __post_init__(self) -> None:
        integer("n_ctx", self.n_ctx, low=1)
        integer("n_seq_max", self.n_seq_max, low=1, high=MAX_SEQ)
        integer("n_batch", self.n_batch, low=1)
        integer("step_tokens", self.step_tokens, low=1)
        if self.n_threads is not None:
            integer("n_threads", self.n_threads, low=1)
        if self.n_gpu_layers != "auto":
            integer("n_gpu_layers", self.n_gpu_layers, low=-1)
        for name in ("cache_type_k", "cache_type_v"):
            if getattr(self, name) not in CACHE_TYPES:
                raise InvalidRequestError(f"{name} must be one of {', '.join(CACHE_TYPES)}, got {getattr(self, name)!r}")
        if self.flash_attn is not None and not isinstance(self.flash_attn, bool):
            raise InvalidRequestError(f"flash_attn must be True, False or None, got {self.flash_attn!r}")
        if self.flash_attn is False and self.cache_type_v not in ("f32", "f16", "bf16"):
            raise InvalidRequestError(f"a {self.cache_type_v} V cache needs flash attention: give flash_attn=True or None")
        integer("max_queued", self.max_queued, low=0)
        if self.cache_seq_ids is not None:
            integer("cache_seq_ids", self.cache_seq_ids, low=0)
        integer("draft_tokens", self.draft_tokens, low=0, high=MAX_DRAFT_TOKENS)
        integer("host_cache_bytes", self.host_cache_bytes, low=0)
        integer("checkpoint_bytes", self.checkpoint_bytes, low=0)
        integer("cache_disk_bytes", self.cache_disk_bytes, low=1)
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)):
                raise InvalidRequestError(f"cache_dir must be a path, got {self.cache_dir!r}")
            object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        integer("n_keep", self.n_keep, low=0)
        if not isinstance(self.context_shift, bool):
            raise InvalidRequestError(f"context_shift must be a bool, got {self.context_shift!r}")
        if not isinstance(self.deterministic, bool):
            raise InvalidRequestError(f"deterministic must be a bool, got {self.deterministic!r}")
        if not isinstance(self.backend_sampling, bool):
            raise InvalidRequestError(f"backend_sampling must be a bool, got {self.backend_sampling!r}")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise InvalidRequestError(f"overlap must be a bool or None, got {self.overlap!r}")
        if not isinstance(self.kv_unified, bool):
            raise InvalidRequestError(f"kv_unified must be a bool, got {self.kv_unified!r}")
        if self.deterministic and not self.kv_unified:
            raise InvalidRequestError("deterministic mode keeps its cells in one unified cache: give kv_unified=True")
        if self.deterministic and self.n_gpu_layers not in (0, "auto"):
            raise InvalidRequestError("deterministic mode runs on the CPU: give n_gpu_layers=0")
        if self.deterministic and (self.cache_type_k, self.cache_type_v) != ("f16", "f16"):
            raise InvalidRequestError("deterministic mode keeps an f16 KV cache")
        if self.model_path is not None:
            object.__setattr__(self, "model_path", Path(self.model_path))
        if self.draft_model is not None:
            if not isinstance(self.draft_model, (str, os.PathLike)):
                raise InvalidRequestError(f"draft_model must be a path, got {self.draft_model!r}")
            object.__setattr__(self, "draft_model", Path(self.draft_model))
            if self.draft_tokens == 0:
                object.__setattr__(self, "draft_tokens", DRAFT_MODEL_TOKENS)
        if not isinstance(self.mtp, bool):
            raise InvalidRequestError(f"mtp must be a bool, got {self.mtp!r}")
        if self.mtp:
            if self.draft_model is not None:
                raise InvalidRequestError("mtp drafts with the model's own layers: give no draft_model with it")
            if self.draft_tokens == 0:
                object.__setattr__(self, "draft_tokens", DRAFT_MODEL_TOKENS)
        if self.mmproj is not None:
            if not isinstance(self.mmproj, (str, os.PathLike)):
                raise InvalidRequestError(f"mmproj must be a path, got {self.mmproj!r}")
            object.__setattr__(self, "mmproj", Path(self.mmproj))
        if not isinstance(self.lora, Mapping) or not all(
                isinstance(k, str) and k and isinstance(v, (str, os.PathLike)) for k, v in self.lora.items()):
            raise InvalidRequestError(f"lora must map names to adapter files, got {self.lora!r}")
        object.__setattr__(self, "lora", {k: Path(v) for k, v in self.lora.items()})
        object.__setattr__(self, "chat_template", _template_text(self.chat_template))
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if self.reasoning not in REASONING_MODES:
            raise InvalidRequestError(f"reasoning must be one of {', '.join(REASONING_MODES)}, got {self.reasoning!r}")

    def context_seq_ids(self, n_vocab: int) -> int:
        """The seq ids of the context: ``n_seq_max`` generating, the rest holding cached prefixes."""
        extra = self.cache_seq_ids
        if extra is None and not self.kv_unified:
            extra = 0  # every id splits the cache further
        elif extra is None:
            extra = max(32, OUTPUT_ROWS_BYTES // (4 * max(1, n_vocab)))
        return min(MAX_SEQ, self.n_seq_max + extra)

    @classmethod
    def from_options(cls, model_path: Any = None, **options: Any) -> EngineConfig:
        """Build from keyword options; an unknown name raises ``InvalidRequestError`` naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidRequestError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(model_path, **options)


def _template_text(template: Any) -> str | None:
    """A chat template given as text, or read from the file a path names."""
    if template is None:
        return None
    if isinstance(template, os.PathLike):
        try:
            return Path(template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"cannot read the chat template file {template}: {exc}") from None
    if not isinstance(template, str) or not template.strip():
        raise InvalidRequestError("chat_template must be a template's text or a path to its file")
    return template
