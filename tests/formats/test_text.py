"""Stream text assembly: whole UTF-8 characters only, stop strings never emitted, not even partly."""

from __future__ import annotations

import pytest

from aiollama.formats.text import TextAssembler


def run(pieces: list[bytes], stop: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    asm = TextAssembler(stop)
    out = [asm.feed(p) for p in pieces]
    if not asm.stopped:
        out.append(asm.finish())
    return out, asm.stopped


def test_split_characters_wait_for_their_bytes() -> None:
    data = "é🦙東".encode()
    pieces = [data[i:i + 1] for i in range(len(data))]
    out, _ = run(pieces)
    assert "".join(out) == "é🦙東"
    assert all("\ufffd" not in s for s in out)
    assert out[0] == "" and out[1] == "é"


def test_stop_string_is_never_emitted() -> None:
    out, stopped = run([b"Hello ", b"wor", b"ld\n", b"\nmore"], stop=("\n\n",))
    assert stopped
    assert "".join(out) == "Hello world"
    assert all("\n" not in s for s in out)


def test_partial_stop_prefix_is_released_when_it_is_not_a_stop() -> None:
    out, stopped = run([b"a S", b"T", b"x end"], stop=("STOP",))
    assert not stopped
    assert out[0] == "a " and out[1] == ""
    assert "".join(out) == "a STx end"


def test_earliest_of_several_stops_wins() -> None:
    out, stopped = run([b"one two three"], stop=("three", "two"))
    assert stopped and "".join(out) == "one "


def test_incomplete_character_at_the_end_becomes_replacement() -> None:
    out, _ = run(["🦙".encode()[:2]])
    assert "".join(out) == "\ufffd"


@pytest.mark.parametrize("split", range(1, 12))
def test_stop_across_any_split(split: int) -> None:
    text = b"abc<END>def"
    out, stopped = run([text[:split], text[split:]], stop=("<END>",))
    assert stopped and "".join(out) == "abc"
    assert all("<" not in s for s in out)


def test_a_stream_read_after_context_shifts_forks_where_its_history_moved() -> None:
    from aiollama.api.stream import TokenHistory
    from aiollama.core.outputs import Delta

    history = TokenHistory(list(range(10)))
    history.generating()
    first, second = Delta(history=(10,)), Delta(history=(11,), dropped=(2, 4))
    history.take(first)
    history.take(second)  # drops tokens [2, 6) before appending 11
    history.read(first)
    assert history.branch()[0] == [0, 1, 6, 7, 8, 9, 10]
    history.read(second)
    assert history.branch()[0] == [0, 1, 6, 7, 8, 9, 10, 11]
