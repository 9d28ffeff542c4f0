"""The disk tier's files: written whole or not at all, found by prefix, checked when read (a bad file
is removed, never read as a state), bounded by bytes, shared by engines of one directory."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from aiollama.core.diskcache import DiskCache
from aiollama.formats.kvfile import SUFFIX

MODEL = {"model": "tiny", "n_vocab": 100, "kv": "f16,unified"}
TOKENS = tuple(range(1, 41))
STATE = bytes(range(256)) * 40


def settle(cache: DiskCache) -> None:
    cache.flush(10)


def read(cache: DiskCache, tokens: tuple[int, ...], salt: str | None = None) -> bytes | None:
    entry, n = cache.best(tokens, len(tokens), salt)
    assert entry is not None and n == len(entry.tokens)
    cache.read(entry)
    deadline = time.monotonic() + 10
    while True:
        arrived = cache.arrivals()
        if arrived:
            [(name, got_tokens, got_salt, data)] = arrived
            assert (name, got_tokens, got_salt) == (entry.name, entry.tokens, entry.salt)
            return data
        assert time.monotonic() < deadline
        cache.wait(0.05)


@pytest.fixture
def cache(tmp_path: Path):
    c = DiskCache(tmp_path, 10 * 2**20, MODEL, "1")
    yield c
    c.close()


def only_file(directory: Path) -> Path:
    [path] = [p for p in directory.iterdir() if p.suffix == SUFFIX]
    return path


def test_a_state_written_is_found_by_prefix_and_read_back(cache: DiskCache, tmp_path: Path) -> None:
    cache.write(TOKENS, None, STATE)
    settle(cache)
    assert cache.has(TOKENS, None) and not cache.has(TOKENS, "other salt") and not cache.has(TOKENS[:-1], None)
    entry, n = cache.best(TOKENS[:30] + (999, 998), 32, None)
    assert entry is not None and entry.tokens == TOKENS and n == 30
    assert cache.best(TOKENS, len(TOKENS), "salted") == (None, 0)  # a salt finds only its own
    assert read(cache, TOKENS) == STATE
    assert cache.n_entries == 1 and cache.n_bytes == only_file(tmp_path).stat().st_size
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # written whole, then renamed


def test_a_state_is_written_once(cache: DiskCache) -> None:
    cache.write(TOKENS, None, STATE)
    cache.write(TOKENS, None, STATE)
    settle(cache)
    assert cache.writes == 1


def test_another_engine_finds_what_one_wrote(tmp_path: Path) -> None:
    first, second = DiskCache(tmp_path, 2**24, MODEL, "1"), DiskCache(tmp_path, 2**24, MODEL, "1")
    try:
        first.write(TOKENS, "s", STATE)
        settle(first)
        deadline = time.monotonic() + 10  # the second one's worker looks again when idle
        while second.best(TOKENS, len(TOKENS), "s")[0] is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert read(second, TOKENS, "s") == STATE
        first.clear()
        settle(first)
        deadline = time.monotonic() + 10
        while second.n_entries:  # a file another engine removed is forgotten
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "renamed"])
def test_a_bad_file_is_ignored_with_a_warning_and_removed(tmp_path: Path, damage: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    with DiskCache(tmp_path, 2**24, MODEL, "1") as writer:
        writer.write(TOKENS, None, STATE)
        writer.write(TOKENS[:20], None, STATE)
    path = tmp_path / (writer.name_of(TOKENS, None) + SUFFIX)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-1000]
    elif damage == "header":
        raw[20:40] = b"\xff" * 20
    path.write_bytes(bytes(raw))
    if damage == "renamed":  # a file whose contents are not what its name says
        path.unlink()
        os.replace(tmp_path / (writer.name_of(TOKENS[:20], None) + SUFFIX), path)
    with caplog.at_level(logging.WARNING, logger="aiollama.disk"), DiskCache(tmp_path, 2**24, MODEL, "1") as cache:
        entry, n = cache.best(TOKENS, len(TOKENS), None)
        if n == len(TOKENS):  # the head it was indexed by was whole: the damage shows on reading
            assert entry is not None and damage == "flip"
            cache.read(entry)
            settle(cache)
            [(_, _, _, data)] = cache.arrivals()
            assert data is None
        assert cache.best(TOKENS, len(TOKENS), None)[1] < len(TOKENS)
    assert not path.exists()
    assert any("removing" in r.getMessage() for r in caplog.records)


def test_another_models_files_are_left_alone(tmp_path: Path) -> None:
    with DiskCache(tmp_path, 2**24, {**MODEL, "model": "another"}, "1") as other:
        other.write(TOKENS, None, STATE)
    with DiskCache(tmp_path, 2**24, MODEL, "1") as ours, DiskCache(tmp_path, 2**24, MODEL, "2") as newer:
        assert ours.best(TOKENS, len(TOKENS), None) == (None, 0)
        assert newer.best(TOKENS, len(TOKENS), None) == (None, 0)  # another version: another namespace
    assert only_file(tmp_path).exists()


def test_the_directory_stays_within_its_bytes_least_recently_used_first(tmp_path: Path) -> None:
    size = len(STATE) + 1000
    with DiskCache(tmp_path, 3 * size, MODEL, "1") as cache:
        for i in range(3):
            cache.write((i,) + TOKENS, None, STATE)
            settle(cache)
            time.sleep(0.02)  # distinct modification times
        assert read(cache, (0,) + TOKENS) == STATE  # used: now the most recent
        time.sleep(0.02)
        cache.write((3,) + TOKENS, None, STATE)
        settle(cache)
        kept = {e.tokens[0] for e in cache._entries.values()}
        assert kept == {0, 2, 3}
        assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 3 * size
        cache.write((4,) + TOKENS, None, bytes(4 * size))  # larger than the whole budget: not written
        settle(cache)
        assert not cache.has((4,) + TOKENS, None)


def test_a_temporary_file_left_by_a_dead_writer_goes(tmp_path: Path) -> None:
    stale = tmp_path / ".abc.1.2.tmp"
    stale.write_bytes(b"half")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    with DiskCache(tmp_path, 2**24, MODEL, "1"):
        pass
    assert not stale.exists()


def test_a_files_identity_tells_apart_files_of_one_size(tmp_path: Path) -> None:
    from aiollama.core.diskcache import file_identity

    base = bytes(range(256)) * (3 * 2**12)  # 3 MiB
    one, copy, other = tmp_path / "one", tmp_path / "copy", tmp_path / "other"
    one.write_bytes(base)
    copy.write_bytes(base)
    other.write_bytes(base[:-1] + b"\0")  # another finetune: the same shape, other weights
    assert file_identity(one) == file_identity(copy) != file_identity(other)


def test_states_beyond_the_write_queue_are_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from aiollama.core import diskcache

    release = threading.Event()
    real = diskcache.encode

    def slow(*args: object) -> list[bytes]:  # a disk slower than the states coming
        release.wait(10)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(diskcache, "encode", slow)
    monkeypatch.setattr(diskcache, "MAX_QUEUED_BYTES", len(STATE) + 10)
    with DiskCache(tmp_path, 2**24, MODEL, "1") as cache:
        cache.write(TOKENS, None, STATE)
        cache.write(TOKENS[:30], None, STATE)  # would hold twice the bound in memory: not kept
        release.set()
        settle(cache)
        assert cache.skipped == 1 and cache.has(TOKENS, None) and not cache.has(TOKENS[:30], None)
        cache.write(TOKENS[:30], None, STATE)  # the queue emptied: kept again
        settle(cache)
        assert cache.has(TOKENS[:30], None)
