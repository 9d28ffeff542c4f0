"""Several models in one process: an :class:`Engine` per model, opened on first use, closed when
idle or when room is needed.

A :class:`ModelSet` holds :class:`ModelEntry` values (a name, a GGUF file, the engine's options, and
aliases) and opens each one's engine when it is first used. Memory stays bounded:

- at most ``max_loaded`` engines at once, and at most ``memory_bytes`` of them together (a number
  for all devices, or a budget per device: ``{"CPU": ..., "CUDA0": ...}``), each counted by its
  plan (:func:`aiollama.plan`: what llama.cpp will allocate, per device);
- to make room, the least recently used idle model is closed first;
- a model idle for its ``keep_alive`` seconds is closed (per model, or per use as Ollama's
  ``keep_alive``: negative keeps it loaded, 0 closes it as soon as it is idle);
- a model in use is never closed under its users: a use (``async with models.use(name)``), a
  running stream, and (unless the set is told otherwise) an open conversation all hold it.

Concurrent first uses of one model load it once.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio

from aiollama.api.engine import Engine
from aiollama.api.plan import Plan, plan
from aiollama.errors import AiollamaError, ModelBusy, ModelNotLoaded, Overloaded, UnknownModel

REAP_SECONDS = 0.25  # how often idle models are looked for
ALL = "*"  # a budget of every device together


@dataclass(frozen=True)
class ModelEntry:
    """One model of a set: its ``name`` (and ``aliases``), its GGUF file, the :class:`Engine`
    ``options`` it is opened with, and its ``keep_alive`` (None: the set's)."""

    name: str
    path: Path
    options: Mapping[str, Any] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    keep_alive: float | None = None
    load_on_startup: bool = False


@dataclass(frozen=True)
class ModelStatus:
    """Where one model of a set stands. ``state`` is "unloaded", "loading" or "loaded";
    ``kind`` ("chat", "embedding" or "rerank") is known once it has loaded; ``bytes`` is its
    estimate before that, and what it took after; ``users`` counts uses, streams and
    conversations; ``expires_in`` is the seconds it has left while idle (None: not counting);
    ``load_seconds`` what its last load took, and ``loads`` how often it was loaded."""

    name: str
    aliases: tuple[str, ...]
    path: Path
    state: str
    kind: str | None
    bytes: int
    users: int
    expires_in: float | None
    load_seconds: float | None
    loads: int


@dataclass
class _Slot:
    entry: ModelEntry
    engine: Engine | None = None
    loading: anyio.Event | None = None
    error: BaseException | None = None
    uses: int = 0
    last_used: float = 0.0
    keep_alive: float | None = None  # the last use's, over the entry's
    measured: int | None = None  # bytes the loaded engine took
    load_seconds: float | None = None
    loads: int = 0


def engine_bytes(engine: Engine) -> int:
    """What a loaded engine holds, as llama.cpp accounts it: weights, memory, compute buffers."""
    info = engine.model_info
    return sum(int(info.get(key, 0)) for key in ("weights_bytes", "memory_bytes", "compute_bytes"))


def engine_kind(engine: Engine) -> str:
    return str(engine.model_info.get("kind", "chat"))


class ModelSet:
    """Models opened on first use. ``async with ModelSet(entries, ...) as models`` starts it (and
    the models marked ``load_on_startup``); leaving the block closes every engine.

    ``max_loaded`` (0: no limit) and ``memory_bytes`` (None: no limit) bound what is loaded at
    once; ``keep_alive`` is the seconds a model stays loaded once idle (negative: forever);
    ``autoload`` False makes a use of an unloaded model raise ``ModelNotLoaded`` (load it with
    :meth:`load`). ``conversations_hold`` False lets idle conversations be closed with their model
    (a server whose only lasting conversations are its stored responses); True by default: a
    conversation keeps its engine loaded. ``on_close(name)`` is called before a model's engine
    closes. ``opener`` makes an unstarted engine of an entry (``Engine(path, **options)``)."""

    def __init__(self, entries: Iterable[ModelEntry], *, max_loaded: int = 4,
                 memory_bytes: int | Mapping[str, int] | None = None,
                 keep_alive: float = 300.0, autoload: bool = True, conversations_hold: bool = True,
                 on_close: Callable[[str], Any] | None = None,
                 opener: Callable[[ModelEntry], Engine] | None = None) -> None:
        self._slots: dict[str, _Slot] = {}
        self._names: dict[str, str] = {}
        for entry in entries:
            for name in (entry.name, *entry.aliases):
                if not name or name in self._names:
                    raise ValueError(f"model name {name!r} is empty or given twice")
                self._names[name] = entry.name
            self._slots[entry.name] = _Slot(entry)
        budgets = memory_bytes.values() if isinstance(memory_bytes, Mapping) else \
            [] if memory_bytes is None else [memory_bytes]
        if max_loaded < 0 or any(b <= 0 for b in budgets) or not math.isfinite(keep_alive):
            raise ValueError("max_loaded must be >= 0, memory_bytes > 0, keep_alive a number of seconds")
        self.max_loaded, self.keep_alive = max_loaded, keep_alive
        self.memory_bytes: dict[str, int] | None = None if memory_bytes is None else \
            dict(memory_bytes) if isinstance(memory_bytes, Mapping) else {ALL: memory_bytes}
        self.autoload, self.conversations_hold = autoload, conversations_hold
        self._on_close = on_close
        self._opener = opener or (lambda entry: Engine(entry.path, **entry.options))
        self._lock = anyio.Lock()
        self._tg: anyio.abc.TaskGroup | None = None
        self._planned: dict[str, Plan | None] = {}  # each model's plan (None: it could not be planned)

    async def __aenter__(self) -> ModelSet:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._reap)
        self._tg.start_soon(self._plan_all)
        for slot in self._slots.values():
            if slot.entry.load_on_startup:
                await self.load(slot.entry.name)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        self._tg = None
        await self.close_all()

    async def close_all(self) -> None:
        """Close every loaded engine now, in use or not (its streams end with EngineClosed)."""
        with anyio.CancelScope(shield=True):
            for slot in self._slots.values():
                await self._close(slot)

    def entry(self, name: str) -> ModelEntry:
        """The entry a name or alias stands for; UnknownModel for any other."""
        key = self._names.get(name) if isinstance(name, str) else None
        if key is None:
            raise UnknownModel(f"no model {name!r} here (models: {', '.join(self._slots) or 'none'})", param="model")
        return self._slots[key].entry

    def names(self) -> list[str]:
        return list(self._slots)

    def loaded(self, name: str) -> Engine | None:
        """The model's engine while it is loaded and serving, else None."""
        engine = self._slots[self.entry(name).name].engine
        return engine if engine is not None and engine.serving else None

    def status(self) -> list[ModelStatus]:
        now = time.monotonic()
        out = []
        for slot in self._slots.values():
            engine, users = slot.engine, self._users(slot)
            state = "loading" if slot.loading is not None else "loaded" if engine is not None else "unloaded"
            keep = self._keep_alive(slot)
            expires = max(0.0, slot.last_used + keep - now) if engine is not None and not users and keep >= 0 else None
            planned = self._planned.get(slot.entry.name)
            kind = engine_kind(engine) if engine is not None else planned.kind if planned is not None else None
            out.append(ModelStatus(slot.entry.name, slot.entry.aliases, slot.entry.path, state, kind, self._bytes(slot),
                                   users,
                                   expires, slot.load_seconds, slot.loads))
        return out

    @asynccontextmanager
    async def use(self, name: str, *, keep_alive: float | None = None,
                  autoload: bool | None = None) -> AsyncIterator[Engine]:
        """The model's engine, loaded if it must be (and ``autoload``, the set's by default,
        allows), held for the block: it is not closed while any use holds it. ``keep_alive``
        sets how long it stays loaded once idle, from now on (Ollama's per-request keep_alive)."""
        slot = self._slots[self.entry(name).name]
        slot.uses += 1
        try:
            engine = slot.engine if slot.engine is not None and slot.engine.serving else None
            if engine is None:
                if not (self.autoload if autoload is None else autoload):
                    raise ModelNotLoaded(f"model {slot.entry.name!r} is not loaded, and loading on use is off: "
                                         "load it first", param="model")
                engine = await self._load(slot)
            if keep_alive is not None:
                slot.keep_alive = float(keep_alive)
            yield engine
        finally:
            slot.uses -= 1
            slot.last_used = time.monotonic()

    async def load(self, name: str) -> Engine:
        """Load the model now (closing idle ones to make room), or return its engine if loaded."""
        async with self.use(name, autoload=True) as engine:
            return engine

    async def unload(self, name: str, *, wait: bool = True) -> bool:
        """Close the model's engine. While it is in use (uses, streams, and conversations where they
        hold it) this waits for them to end, or with ``wait=False`` raises ModelBusy. False if it
        was not loaded."""
        slot = self._slots[self.entry(name).name]
        while slot.loading is not None:
            await slot.loading.wait()
        if slot.engine is None:
            return False
        while self._users(slot):
            if not wait:
                raise ModelBusy(f"model {slot.entry.name!r} is in use ({self._users(slot)} uses, streams or "
                                "conversations)")
            await anyio.sleep(0.05)
        await self._close(slot)
        return True

    async def _load(self, slot: _Slot) -> Engine:
        while True:
            if slot.engine is not None and slot.engine.serving:
                return slot.engine
            if slot.loading is None:
                break
            await slot.loading.wait()  # another use is loading it: share its result
            if slot.error is not None:
                raise slot.error
        slot.loading, slot.error = anyio.Event(), None
        try:
            async with self._lock:
                if self.memory_bytes is not None:
                    await self._plan_of(slot.entry)
                await self._make_room(slot)
            started = time.perf_counter()
            engine = self._opener(slot.entry)
            await engine.start()
            slot.load_seconds, slot.loads = time.perf_counter() - started, slot.loads + 1
            slot.engine, slot.measured, slot.last_used = engine, engine_bytes(engine), time.monotonic()
            return engine
        except BaseException as exc:
            slot.error = exc
            raise
        finally:
            event, slot.loading = slot.loading, None
            event.set()

    async def _make_room(self, slot: _Slot) -> None:
        """Close idle models, least recently used first, until ``slot`` fits the limits."""
        while True:
            loaded = [s for s in self._slots.values() if s is not slot and (s.engine is not None or s.loading)]
            over_count = self.max_loaded and len(loaded) + 1 > self.max_loaded
            over_bytes = self._over_budget(slot, loaded)
            if not over_count and not over_bytes:
                return
            idle = sorted((s for s in loaded if s.engine is not None and not self._users(s)), key=lambda s: s.last_used)
            if not idle:
                why = f"{len(loaded)} models are loaded (at most {self.max_loaded})" if over_count else \
                    f"it needs {self._device_bytes(slot)} bytes and the loaded models leave less of " \
                    f"{self.memory_bytes}"
                raise Overloaded(f"no room to load model {slot.entry.name!r}: {why}, and all are in use")
            await self._close(idle[0])

    async def _reap(self) -> None:
        while True:
            await anyio.sleep(REAP_SECONDS)
            now = time.monotonic()
            for slot in list(self._slots.values()):
                keep = self._keep_alive(slot)
                if slot.engine is not None and keep >= 0 and now - slot.last_used >= keep and not self._users(slot):
                    await self._close(slot)

    async def _close(self, slot: _Slot) -> None:
        engine, slot.engine = slot.engine, None
        if engine is None:
            return
        slot.keep_alive = None
        if self._on_close is not None:
            self._on_close(slot.entry.name)
        with anyio.CancelScope(shield=True):
            await engine.aclose()

    def _users(self, slot: _Slot) -> int:
        """What holds the model: uses, running or queued streams, and (where they hold it) open
        conversations."""
        engine = slot.engine
        if engine is None or not engine.serving:
            return slot.uses
        stats = engine.statistics()
        streams = stats.active + stats.queued
        if self.conversations_hold:
            return slot.uses + max(streams, engine.open_conversations())
        return slot.uses + streams

    def _keep_alive(self, slot: _Slot) -> float:
        for value in (slot.keep_alive, slot.entry.keep_alive):
            if value is not None:
                return value
        return self.keep_alive

    async def _plan_of(self, entry: ModelEntry) -> Plan | None:
        if entry.name not in self._planned:
            self._planned[entry.name] = await anyio.to_thread.run_sync(_planned, entry)
        return self._planned[entry.name]

    async def _plan_all(self) -> None:
        """Plan every model once, in the background: its bytes and kind are known before it loads."""
        for slot in list(self._slots.values()):
            await self._plan_of(slot.entry)

    def _device_bytes(self, slot: _Slot) -> dict[str, int]:
        """What the model takes (or will) on each device: its plan's; what it holds once loaded
        where it could not be planned, else its file's size."""
        planned = self._planned.get(slot.entry.name)
        if planned is not None:
            return planned.by_device()
        return {"CPU": slot.measured if slot.measured is not None else _file_bytes(slot.entry)}

    def _bytes(self, slot: _Slot) -> int:
        return sum(self._device_bytes(slot).values())

    def _over_budget(self, slot: _Slot, loaded: list[_Slot]) -> bool:
        if self.memory_bytes is None:
            return False
        used: dict[str, int] = {}
        for s in (*loaded, slot):
            for device, size in self._device_bytes(s).items():
                key = ALL if ALL in self.memory_bytes else device
                used[key] = used.get(key, 0) + size
        return any(size > self.memory_bytes.get(device, size) for device, size in used.items())


def _planned(entry: ModelEntry) -> Plan | None:
    """The plan of an engine of ``entry``; None where it cannot be planned (its load will say why)."""
    try:
        return plan(entry.path, **entry.options)
    except (AiollamaError, OSError, ValueError):
        return None


def _file_bytes(entry: ModelEntry) -> int:
    try:
        return os.path.getsize(entry.path)
    except OSError:
        return 0


def models_in(folder: str | os.PathLike[str], **options: Any) -> list[ModelEntry]:
    """An entry for each ``*.gguf`` file of ``folder`` (named by its file's stem), and for each
    subfolder holding one model (llama-server's layout: the model and its ``mmproj*`` projector),
    each with ``options``."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"no folder {root}")
    out = []
    for item in sorted(root.iterdir()):
        if item.is_file() and item.suffix == ".gguf" and not item.name.startswith("mmproj"):
            out.append(ModelEntry(item.stem, item, dict(options)))
        elif item.is_dir():
            files = sorted(f for f in item.glob("*.gguf") if not f.name.startswith("mmproj"))
            projector = sorted(item.glob("mmproj*.gguf"))
            if files:
                extra = {"mmproj": projector[0]} if projector else {}
                out.append(ModelEntry(item.name, files[0], {**options, **extra}))
    return out
