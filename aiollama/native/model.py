"""Model and Vocab: the loaded weights and the tokenizer that comes with them."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from aiollama._validate import integer
from aiollama.errors import (
    ClosedError,
    InvalidRequestError,
    InvalidTokenError,
    ModelIsADirectory,
    ModelLoadError,
    ModelNotFound,
)
from aiollama.native.binding import clear_recent_errors, ffi, lib, recent_errors
from aiollama.native.devices import Fitted
from aiollama.native.handle import Handle, count

GGUF_MAGIC = b"GGUF"
# magic, version, tensor count and metadata count: a file shorter than this cannot be a GGUF model
GGUF_HEADER_SIZE = 4 + 4 + 8 + 8


def _check_gguf(path: str) -> None:
    if not os.path.exists(path):
        raise ModelNotFound(f"model file not found: {path}")
    if os.path.isdir(path):
        raise ModelIsADirectory(f"model path is a directory, not a GGUF file: {path}")
    with open(path, "rb") as f:
        head = f.read(GGUF_HEADER_SIZE)
    if head[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC!r}): {path}")
    if len(head) < GGUF_HEADER_SIZE:
        raise ModelLoadError(f"GGUF file truncated inside its header ({len(head)} bytes): {path}")


class Model(Handle):
    """Weights loaded from a GGUF file.

    ``close()`` ends the caller's use of the model. Contexts and samplers created from it keep the
    native model alive until they are closed too, so handles can be closed in any order.

    Raises:
        ModelNotFound, ModelIsADirectory: no file at ``path`` (also FileNotFoundError and
            IsADirectoryError).
        ModelLoadError: not GGUF, truncated, or refused by llama.cpp (the message carries its log).
    """

    _kind = "model"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_gpu_layers: int = 0,
        vocab_only: bool = False,
        use_mmap: bool = True,
        repack: bool = True,
        fitted: Fitted | None = None,
        no_alloc: bool = False,
        load_mtp: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        integer("n_gpu_layers", n_gpu_layers, low=-1)
        _check_gguf(self.path)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        if fitted is not None:  # what devices.fit chose (n_gpu_layers, and any split of the tensors)
            fitted.apply(params)
        self._fitted = fitted
        self.n_gpu_layers: int = params.n_gpu_layers
        params.vocab_only = vocab_only
        params.no_alloc = no_alloc  # metadata only: a context over it simulates its allocations (a plan)
        # a plan maps nothing (llama.cpp's fitting loads the same way)
        params.load_mode = lib.LLAMA_LOAD_MODE_AUTO if use_mmap and not no_alloc else lib.LLAMA_LOAD_MODE_NONE
        params.use_extra_bufts = repack  # repacked weights run rows in groups of 4 (batch-shape dependent)
        params.load_mtp = load_mtp  # the multi-token-prediction (NextN) layers, which an MTP context runs
        clear_recent_errors()
        ptr = lib.llama_model_load_from_file(os.fsencode(self.path), params)
        if ptr == ffi.NULL:
            why = "; ".join(recent_errors()) or "no reason given"
            raise ModelLoadError(f"llama.cpp could not load {self.path}: {why}")
        self._native = ptr
        self._own(ptr)  # the caller's view; the native model is freed once nobody holds it
        self._users = 0
        self._lock = threading.Lock()
        self.vocab = Vocab(self)
        self.n_ctx_train: int = lib.llama_model_n_ctx_train(ptr)
        self.n_embd: int = lib.llama_model_n_embd(ptr)
        self.n_cls_out: int = 0 if vocab_only else lib.llama_model_n_cls_out(ptr)  # a reranker's scores per input
        self.n_layer: int = lib.llama_model_n_layer(ptr)
        self.n_layer_nextn: int = lib.llama_model_n_layer_nextn(ptr)  # > 0: it carries MTP layers
        # heads are per layer: a vocabulary-only model has none to ask about (llama.cpp aborts)
        self.n_head: int = 0 if vocab_only else lib.llama_model_n_head(ptr)
        self.n_head_kv: int = 0 if vocab_only else lib.llama_model_n_head_kv(ptr)
        self.n_params: int = lib.llama_model_n_params(ptr)
        # the weights' element type, as llama.cpp names it ("Q4_1", "all F32", ...)
        self.ftype: str = ffi.string(lib.llama_ftype_name(lib.llama_model_ftype(ptr))).decode("utf-8", "replace")
        self.size: int = lib.llama_model_size(ptr)
        self.n_swa: int = lib.llama_model_n_swa(ptr)  # > 0: a sliding-window attention model
        # Recurrent and hybrid memories cannot drop the tail of a sequence (seq_rm of a partial range):
        # their recurrent state is only ever the state after a sequence's last position
        self.is_hybrid: bool = bool(lib.llama_model_is_hybrid(ptr))
        self.is_recurrent: bool = self.is_hybrid or bool(lib.llama_model_is_recurrent(ptr))

    # Lifetime: _ptr is the caller's view (None once closed); _native is freed only when the
    # caller has closed the model and no dependent handle holds it any more.
    def close(self) -> None:
        with self._lock:
            self._ptr = None
            self._free_if_unused()

    def _free_if_unused(self) -> None:
        if self._ptr is None and self._users == 0 and self._native is not None:
            native, self._native = self._native, None
            lib.llama_model_free(native)
            count(self._kind, -1)

    def _acquire(self) -> Any:
        """Keep the native model alive for a dependent handle; the model must still be open."""
        with self._lock:
            ptr = self._get()
            self._users += 1
            return ptr

    def _acquire_native(self) -> Any:
        """Like _acquire, but only needs the native model alive (held by some dependent)."""
        with self._lock:
            native = self._alive()
            self._users += 1
            return native

    def _release(self) -> None:
        with self._lock:
            self._users -= 1
            self._free_if_unused()

    def _alive(self) -> Any:
        """The native pointer while anyone still holds the model, for use by dependents."""
        native = self._native
        if native is None:
            raise ClosedError("the model is closed")
        return native

    def description(self) -> str:
        buf = ffi.new("char[256]")
        lib.llama_model_desc(self._get(), buf, 256)
        return str(ffi.string(buf).decode("utf-8", "replace"))

    def metadata(self, key: str) -> str | None:
        """The GGUF metadata value for ``key`` as a string, or None if absent."""
        ptr = self._get()
        k = key.encode()
        n = lib.llama_model_meta_val_str(ptr, k, ffi.NULL, 0)
        if n < 0:
            return None
        buf = ffi.new("char[]", n + 1)
        lib.llama_model_meta_val_str(ptr, k, buf, n + 1)
        return str(ffi.string(buf).decode("utf-8", "replace"))

    def chat_template(self, name: str | None = None) -> str | None:
        """The chat template stored in the GGUF file (``tokenizer.chat_template``), or None."""
        raw = lib.llama_model_chat_template(self._get(), name.encode() if name else ffi.NULL)
        return None if raw == ffi.NULL else str(ffi.string(raw).decode("utf-8", "replace"))

    def __repr__(self) -> str:
        state = "closed" if self._ptr is None else "open"
        return f"<Model {os.path.basename(self.path)!r} {state}>"


QUANT_TYPES = {"f16": "LLAMA_FTYPE_MOSTLY_F16", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
               "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
               "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def quantize(source: str | os.PathLike[str], dest: str | os.PathLike[str], kind: str, *, n_threads: int = 0) -> None:
    """Write ``source`` (an F32 or F16 GGUF model) to ``dest`` quantized to ``kind`` (one of
    ``QUANT_TYPES``: every weight matrix in that type, llama-quantize's ``--pure``).

    Raises InvalidRequestError for an unknown kind, ModelNotFound/ModelLoadError for a missing or
    bad source, and ModelLoadError when llama.cpp fails.
    """
    if kind not in QUANT_TYPES:
        raise InvalidRequestError(f"kind must be one of {sorted(QUANT_TYPES)}, got {kind!r}")
    _check_gguf(os.fspath(source))
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, QUANT_TYPES[kind])
    params.nthread = integer("n_threads", n_threads, low=0)
    params.pure = True
    params.quantize_output_tensor = True
    clear_recent_errors()
    if lib.llama_model_quantize(os.fsencode(source), os.fsencode(dest), ffi.new("llama_model_quantize_params *", params)):
        why = "; ".join(recent_errors()) or "no reason given"
        raise ModelLoadError(f"llama.cpp could not quantize {source} to {kind}: {why}")


class Vocab:
    """The model's tokenizer. Usable while the native model is alive (see :class:`Model`).

    Tokenizer calls are thread-safe in llama.cpp, so any thread may use a Vocab.
    """

    def __init__(self, model: Model) -> None:
        self._model = model
        ptr = lib.llama_model_get_vocab(model._alive())
        self.n_tokens: int = lib.llama_vocab_n_tokens(ptr)
        self.bos: int = lib.llama_vocab_bos(ptr)
        self.eos: int = lib.llama_vocab_eos(ptr)
        self.eot: int = lib.llama_vocab_eot(ptr)
        self.add_bos: bool = bool(lib.llama_vocab_get_add_bos(ptr))
        self.add_eos: bool = bool(lib.llama_vocab_get_add_eos(ptr))
        self.add_sep: bool = bool(lib.llama_vocab_get_add_sep(ptr))
        self.sep: int = lib.llama_vocab_sep(ptr)
        # fill-in-the-middle: prefix, suffix, middle, repository and file separator tokens (-1: none)
        self.fim: dict[str, int] = {name: int(getattr(lib, f"llama_vocab_fim_{name}")(ptr))
                                    for name in ("pre", "suf", "mid", "rep", "sep")}
        self._specials: list[tuple[int, str, int]] | None = None

    def _get(self) -> Any:
        return lib.llama_model_get_vocab(self._model._alive())

    @contextlib.contextmanager
    def pinned(self) -> Iterator[Vocab]:
        """Keep the native model alive for the block: another thread may close it meanwhile.

        Raises ClosedError if it is already gone.
        """
        self._model._acquire_native()
        try:
            yield self
        finally:
            self._model._release()

    def special_tokens(self) -> list[tuple[int, str, int]]:
        """``(id, text, attributes)`` of every token the tokenizer splits out of text before
        anything else (control, user-defined and unknown tokens), longest text first, as llama.cpp's
        tokenizer tries them. Attributes are ``LLAMA_TOKEN_ATTR_*`` bits."""
        if self._specials is None:
            ptr = self._get()
            wanted = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_USER_DEFINED | lib.LLAMA_TOKEN_ATTR_UNKNOWN
            found = []
            for token in range(self.n_tokens):
                attr = int(lib.llama_vocab_get_attr(ptr, token))
                if attr & wanted:
                    text = ffi.string(lib.llama_vocab_get_text(ptr, token)).decode("utf-8", "replace")
                    if text:
                        found.append((token, text, attr))
            found.sort(key=lambda t: (-len(t[1].encode()), t[0]))
            self._specials = found
        return self._specials

    def chat_template(self, name: str | None = None) -> str | None:
        """The model's chat template from its GGUF metadata, or None."""
        raw = lib.llama_model_chat_template(self._model._alive(), name.encode() if name else ffi.NULL)
        return None if raw == ffi.NULL else str(ffi.string(raw).decode("utf-8", "replace"))

    def check_token(self, token: int) -> int:
        """Return ``token`` if it is a valid id of this vocabulary, else raise InvalidTokenError."""
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.n_tokens:
            raise InvalidTokenError(f"token id {token!r} is outside the vocabulary [0, {self.n_tokens})")
        return token

    def check_tokens(self, tokens: Iterable[int]) -> list[int]:
        out = list(tokens)
        if out and (min(out) < 0 or max(out) >= self.n_tokens):
            bad = next(t for t in out if not 0 <= t < self.n_tokens)
            raise InvalidTokenError(f"token id {bad} is outside the vocabulary [0, {self.n_tokens})")
        return out

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT and the model's other EOG ids)."""
        return bool(lib.llama_vocab_is_eog(self._get(), self.check_token(token)))

    def is_control(self, token: int) -> bool:
        return bool(lib.llama_vocab_is_control(self._get(), self.check_token(token)))

    def token_text(self, token: int) -> str:
        """The token's text as stored in the vocabulary (not detokenized)."""
        raw = lib.llama_vocab_get_text(self._get(), self.check_token(token))
        return str(ffi.string(raw).decode("utf-8", "replace"))

    def tokenize(self, text: str | bytes, *, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids for ``text``.

        ``add_special`` adds BOS/EOS as the model's metadata asks; ``parse_special`` turns the text of
        special tokens (``<|im_start|>``) into those tokens instead of plain text.
        """
        try:
            data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        except UnicodeEncodeError as exc:  # a lone surrogate: text JSON can carry but Unicode cannot
            raise InvalidRequestError(f"the text is not valid Unicode: a lone surrogate at character {exc.start}") from None
        ptr = self._get()
        capacity = len(data) + 8
        buf = ffi.new("llama_token[]", capacity)
        n = lib.llama_tokenize(ptr, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            if n == -(2**31):
                raise InvalidRequestError("text too long to tokenize")
            capacity = -n
            buf = ffi.new("llama_token[]", capacity)
            n = lib.llama_tokenize(ptr, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[0:n])

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token. They may end inside a UTF-8 character."""
        ptr = self._get()
        self.check_token(token)
        buf = ffi.new("char[64]")
        n = lib.llama_token_to_piece(ptr, token, buf, 64, 0, special)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = lib.llama_token_to_piece(ptr, token, buf, -n, 0, special)
        return bytes(ffi.buffer(buf, n))

    def detokenize_bytes(
        self, tokens: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False
    ) -> bytes:
        ids = self.check_tokens(tokens)
        if not ids:
            return b""
        ptr = self._get()
        arr = ffi.new("llama_token[]", ids)
        capacity = max(64, 8 * len(ids))
        buf = ffi.new("char[]", capacity)
        n = lib.llama_detokenize(ptr, arr, len(ids), buf, capacity, remove_special, unparse_special)
        if n < 0:
            capacity = -n
            buf = ffi.new("char[]", capacity)
            n = lib.llama_detokenize(ptr, arr, len(ids), buf, capacity, remove_special, unparse_special)
        return bytes(ffi.buffer(buf, n))

    def detokenize(
        self, tokens: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False
    ) -> str:
        """Text for ``tokens``; bytes that are not valid UTF-8 become U+FFFD."""
        raw = self.detokenize_bytes(tokens, remove_special=remove_special, unparse_special=unparse_special)
        return raw.decode("utf-8", "replace")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        template: str | None = None,
        add_assistant: bool = True,
    ) -> str:
        """Render ``messages`` ({"role", "content"} mappings) with llama.cpp's built-in templates.

        ``template`` defaults to the model's own. llama.cpp recognizes templates by pattern, without
        Jinja; an unrecognized template raises InvalidRequestError.
        """
        tmpl = template if template is not None else self._model.chat_template()
        if tmpl is None:
            raise InvalidRequestError("the model has no chat template; pass template=")
        keep: list[Any] = []
        chat = ffi.new("llama_chat_message[]", len(messages))
        for i, message in enumerate(messages):
            try:
                role, content = message["role"], message["content"]
            except (KeyError, TypeError):
                raise InvalidRequestError(f"message {i} needs 'role' and 'content'") from None
            if not isinstance(role, str) or not isinstance(content, str):
                raise InvalidRequestError(f"message {i}: role and content must be str")
            keep.append(ffi.new("char[]", role.encode()))
            keep.append(ffi.new("char[]", content.encode()))
            chat[i].role = keep[-2]
            chat[i].content = keep[-1]
        tmpl_c = tmpl.encode()
        capacity = 256 + 2 * sum(len(m["content"]) + len(m["role"]) for m in messages)
        buf = ffi.new("char[]", capacity)
        n = lib.llama_chat_apply_template(tmpl_c, chat, len(messages), add_assistant, buf, capacity)
        if n < 0:
            raise InvalidRequestError("llama.cpp does not recognize this chat template")
        if n > capacity:
            capacity = n
            buf = ffi.new("char[]", capacity)
            n = lib.llama_chat_apply_template(tmpl_c, chat, len(messages), add_assistant, buf, capacity)
        return bytes(ffi.buffer(buf, n)).decode("utf-8", "replace")


def with_model(model: Model, create: Callable[[Any], Any], fail: Callable[[str], Exception]) -> Any:
    """``create(model pointer)`` for a handle that keeps the model alive; if it gives NULL, the
    model is let go and ``fail(llama.cpp's logged reason)`` is raised."""
    model_ptr = model._acquire()
    clear_recent_errors()
    ptr = create(model_ptr)
    if ptr == ffi.NULL:
        model._release()
        raise fail("; ".join(recent_errors()) or "no reason given")
    return ptr
