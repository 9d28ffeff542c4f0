"""The prefix cache's disk tier: sequence states in files under one directory, which survive a
restart and which several engines (replicas on one host) may share.

Each file holds one state (what ``llama_state_seq_get_data`` copied out) and what it is the state
of: the tokens, the cache salt (with the LoRA adapters in it) and the *namespace*, a digest of the
model's fingerprint (its description, sizes, vocabulary and KV types), the model and adapter files'
identities (:func:`file_identity`), this package's version (which pins the llama.cpp build) and the
file format. A file of another namespace belongs to another model
and is left alone; a file that is truncated, corrupt, or whose contents do not match its name is
ignored with a warning and removed: it never becomes wrong tokens. Histories holding pictures are not
written (their placeholders are numbered per process).

The decode thread only looks up the index and queues work. One worker thread writes (to a temporary
file, then ``os.replace``: a reader never sees half a file), reads and checks, removes the least
recently used files while the directory holds more than ``budget`` bytes, and looks for files that
other engines wrote when it has nothing else to do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aiollama.formats.kvfile import FORMAT, SUFFIX, Damaged, encode, file_name, parse, read_head
from aiollama.sched import TokenTrie
from aiollama.sched.step import DiskEntry

log = logging.getLogger("aiollama.disk")

RESCAN_SECONDS = 1.0  # how often an idle worker looks for files other engines wrote
STALE_TEMP_SECONDS = 3600.0  # a temporary file this old was left by a process that died writing it
# States queued for writing take host memory until written: beyond this, new ones are not kept (a
# disk slower than the states coming is a cache that misses, not memory that grows)
MAX_QUEUED_BYTES = 1 << 30


class DiskCache:
    """The files of one namespace in ``directory``, within ``budget`` bytes for the whole directory."""

    def __init__(self, directory: str | os.PathLike[str], budget: int, fingerprint: Mapping[str, Any],
                 version: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        ident = json.dumps({**fingerprint, "aiollama": version, "format": FORMAT}, sort_keys=True)
        self.namespace = hashlib.sha256(ident.encode()).hexdigest()[:32]
        self.writes = self.loads = self.removed = 0
        self._lock = threading.Lock()
        self._entries: dict[str, DiskEntry] = {}
        self._bytes = 0  # of the entries: read with every step's statistics, so kept, not summed
        self._tries: dict[str | None, TokenTrie[str]] = {}
        self._known: dict[str, int] = {}  # every file looked at (any namespace) -> its size then
        self._writing: set[str] = set()
        self._queued_bytes = 0
        self.skipped = 0  # states not written: the queue was full
        self._reading: set[str] = set()
        self._arrived: list[tuple[str, tuple[int, ...], str | None, bytes | None]] = []
        self._arrival = threading.Event()
        self._jobs: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._scan()
        self._thread = threading.Thread(target=self._work, name="aiollama-disk", daemon=True)
        self._thread.start()

    # the decode thread's side

    def name_of(self, tokens: Sequence[int], salt: str | None) -> str:
        return file_name(self.namespace, tokens, salt)

    def has(self, tokens: Sequence[int], salt: str | None) -> bool:
        name = self.name_of(tokens, salt)
        with self._lock:
            return name in self._entries or name in self._writing

    def best(self, tokens: Sequence[int], limit: int, salt: str | None) -> tuple[DiskEntry | None, int]:
        """The file of ``salt`` sharing the longest prefix with ``tokens`` (at most ``limit``)."""
        with self._lock:
            trie = self._tries.get(salt)
            key, n = (None, 0) if trie is None else trie.longest(tokens, limit)
            return (None, 0) if key is None else (self._entries[key], n)

    def write(self, tokens: Sequence[int], salt: str | None, data: bytes) -> None:
        """Keep a state on disk (queued; a state already there or queued is not written twice)."""
        name = self.name_of(tokens, salt)
        with self._lock:
            if name in self._entries or name in self._writing or len(data) > self.budget:
                return
            if self._queued_bytes + len(data) > MAX_QUEUED_BYTES:
                self.skipped += 1
                return
            self._writing.add(name)
            self._queued_bytes += len(data)
        self._jobs.put(("write", (name, tuple(tokens), salt, data)))

    def read(self, entry: DiskEntry) -> None:
        """Read a state: it comes back through :meth:`arrivals` (its data None if it was bad)."""
        with self._lock:
            if entry.name in self._reading:
                return
            self._reading.add(entry.name)
        self._jobs.put(("read", entry))

    def arrivals(self) -> list[tuple[str, tuple[int, ...], str | None, bytes | None]]:
        if not self._arrived:  # every step asks: no lock while nothing came
            return []
        with self._lock:
            arrived, self._arrived = self._arrived, []
            self._arrival.clear()
        return arrived

    def wait(self, timeout: float) -> None:
        """Block until a read arrives, at most ``timeout`` seconds."""
        self._arrival.wait(timeout)

    def clear(self) -> None:
        """Remove this namespace's files (those of other models stay)."""
        with self._lock:
            names = list(self._entries)
            self._entries.clear()
            self._tries.clear()
            self._bytes = 0
        self._jobs.put(("remove", names))

    @property
    def n_entries(self) -> int:
        return len(self._entries)

    @property
    def n_bytes(self) -> int:
        return self._bytes

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until what is queued now is done."""
        done = threading.Event()
        self._jobs.put(("flush", done))
        done.wait(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Finish the queued writes and stop the worker."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def __enter__(self) -> DiskCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the worker's side

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=RESCAN_SECONDS)
            except queue.Empty:
                self._guarded(self._scan)
                continue
            if job is None:
                return
            kind, arg = job
            if kind == "write":
                self._guarded(self._write, *arg)
            elif kind == "read":
                data = self._guarded(self._read, arg)
                with self._lock:
                    self._reading.discard(arg.name)
                    self._arrived.append((arg.name, arg.tokens, arg.salt, data))
                    self._arrival.set()
            elif kind == "flush":
                arg.set()
            else:
                for name in arg:
                    self._unlink(self.directory / _file(name))

    def _guarded(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as exc:  # a full or read-only disk costs the cache, never the engine
            log.warning("the disk cache in %s: %s", self.directory, exc)
            return None

    def _write(self, name: str, tokens: tuple[int, ...], salt: str | None, data: bytes) -> None:
        temp = self.directory / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(temp, "wb") as f:
                for piece in encode(self.namespace, tokens, salt, data):
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.directory / _file(name))
            self._add(DiskEntry(name, tokens, salt, (self.directory / _file(name)).stat().st_size))
            self.writes += 1
        except OSError:  # a full disk: no half file stays
            temp.unlink(missing_ok=True)
            raise
        finally:
            with self._lock:
                self._writing.discard(name)
                self._queued_bytes -= len(data)
        for path in over_budget(self.directory, self.budget):
            self._unlink(path)

    def _read(self, entry: DiskEntry) -> bytes | None:
        path = self.directory / _file(entry.name)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = read_head(f)
                data = f.read(size - len(head))  # the state, read once into the bytes it stays in
            parsed = parse(self.namespace, entry.name, head, size, data)
        except FileNotFoundError:  # another engine removed it
            self._drop(entry.name)
            return None
        except Damaged as exc:
            self._bad(path, str(exc))
            return None
        if parsed is None or parsed[0] != entry.tokens or parsed[1] != entry.salt:
            self._bad(path, "it does not hold what its name says")
            return None
        os.utime(path)  # recently used: the last to be removed
        self.loads += 1
        return parsed[2]

    def _scan(self) -> None:
        """Index the files other engines wrote, forget those they removed, and remove temporary
        files that a process which died while writing left."""
        seen: set[str] = set()
        now = time.time()
        for item in os.scandir(self.directory):
            if item.name.endswith(".tmp"):
                if now - item.stat().st_mtime > STALE_TEMP_SECONDS:
                    self._unlink(Path(item.path))
                continue
            if not item.name.endswith(SUFFIX):
                continue
            name = item.name[:-len(SUFFIX)]
            seen.add(name)
            size = item.stat().st_size
            if self._known.get(name) == size:
                continue
            self._known[name] = size
            self._index(name, Path(item.path), size)
        for name in [n for n in self._known if n not in seen]:
            del self._known[name]
            self._drop(name)

    def _index(self, name: str, path: Path, size: int) -> None:
        try:
            with open(path, "rb") as f:
                head = read_head(f)
            parsed = parse(self.namespace, name, head, size)
        except FileNotFoundError:
            return
        except Damaged as exc:
            self._bad(path, str(exc))
            return
        if parsed is not None:
            self._add(DiskEntry(name, parsed[0], parsed[1], size))

    def _bad(self, path: Path, why: str) -> None:
        log.warning("ignoring and removing the cached state %s: %s", path.name, why)
        self._unlink(path)
        self._drop(path.name[:-len(SUFFIX)])

    def _add(self, entry: DiskEntry) -> None:
        with self._lock:
            if entry.name not in self._entries:
                self._entries[entry.name] = entry
                self._bytes += entry.n_bytes
                self._tries.setdefault(entry.salt, TokenTrie[str]()).insert(entry.tokens, entry.name)
        self._known[entry.name] = entry.n_bytes

    def _drop(self, name: str) -> None:
        with self._lock:
            entry = self._entries.pop(name, None)
            if entry is not None:
                self._bytes -= entry.n_bytes
                self._tries[entry.salt].remove(entry.tokens, name)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink()
            self.removed += 1
        except FileNotFoundError:
            pass
        self._drop(path.name[:-len(SUFFIX)])


def _file(name: str) -> str:
    return name + SUFFIX


def file_identity(path: str | os.PathLike[str]) -> str:
    """A digest of a file's size and of three MiB of it (its start, middle and end): a model or an
    adapter file told apart from another of the same shape without reading gigabytes."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for at in (0, max(0, size // 2 - 2**19), max(0, size - 2**20)):
            f.seek(at)
            h.update(f.read(2**20))
    return h.hexdigest()


def over_budget(directory: Path, budget: int) -> list[Path]:
    """The least recently used files (of any namespace) to remove for ``directory`` to hold at most
    ``budget`` bytes."""
    files = []
    for item in os.scandir(directory):
        if item.name.endswith(SUFFIX):
            try:
                st = item.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime, st.st_size, Path(item.path)))
    total, out = sum(size for _, size, _ in files), []
    for _, size, path in sorted(files):
        if total <= budget:
            break
        out.append(path)
        total -= size
    return out
