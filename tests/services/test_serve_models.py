"""The models of ``aiollama serve --models-dir --models-preset``: each model's engine and server
options from the command line, its preset section and the preset's ``[*]``, in that order."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiollama.cli import parser
from aiollama.serve_command import add_serve, app_options, engine_options
from aiollama.serve_models import model_settings


def settings(argv: list[str]) -> tuple[list, dict]:
    import argparse

    args = parser().parse_args(["serve", *argv])
    serve = argparse.ArgumentParser(add_help=False)
    add_serve(serve)
    return model_settings(serve, args, engine_options, app_options)


@pytest.fixture
def folder(tmp_path: Path, tiny_path: Path) -> Path:
    (tmp_path / "models").mkdir()
    for name in ("a", "b"):
        (tmp_path / "models" / f"{name}.gguf").symlink_to(tiny_path)
    return tmp_path


def test_the_command_line_then_the_section_then_every_model(folder: Path, tiny_path: Path) -> None:
    preset = folder / "p.ini"
    preset.write_text(f"version = 1\n[*]\nc = 1024\ntemp = 0.5\n[a]\nc = 2048\nalias = x, y\nkeep-alive = 9\n"
                      f"load-on-startup = true\nbackend-sampling = true\n[c]\nmodel = {tiny_path}\nrerank = true\n")
    entries, apps = settings(["--models-dir", str(folder / "models"), "--models-preset", str(preset), "-np", "3"])
    by_name = {e.name: e for e in entries}
    assert sorted(by_name) == ["a", "b", "c"]
    a, b, c = by_name["a"], by_name["b"], by_name["c"]
    assert (a.options["n_ctx"], b.options["n_ctx"]) == (2048, 1024)  # the section over [*]
    assert a.options["n_seq_max"] == b.options["n_seq_max"] == 3  # the command line over both
    assert a.aliases == ("x", "y") and a.keep_alive == 9.0 and a.load_on_startup and not b.load_on_startup
    assert a.options["backend_sampling"] and not b.options["backend_sampling"]
    assert c.options["pooling"] == "rank" and c.path == tiny_path
    assert apps["a"]["sampling"] == {"temperature": 0.5} and apps["a"]["model_name"] == "a"


@pytest.mark.parametrize(("text", "error"), [
    ("[a]\nLLAMA_ARG_CTX_SIZE = 5\n", "environment variable"),
    ("[a]\nno-such-flag = 1\n", "not a flag"),
    ("[a]\nbackend-sampling = maybe\n", "a switch"),
    ("[zz]\nc = 5\n", "no model of that name"),
    ("[a\n", "not an INI file"),
])
def test_a_preset_it_cannot_read_is_refused(folder: Path, text: str, error: str) -> None:
    preset = folder / "p.ini"
    preset.write_text(text)
    with pytest.raises(ValueError, match=error):
        settings(["--models-dir", str(folder / "models"), "--models-preset", str(preset)])
