"""The documentation stays true: it builds in strict mode, its code compiles and names what exists,
and the README's example is the quickstart that runs in tests/test_examples.py."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^```python\n(.+?)\n```", flags=re.M | re.S)
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$')


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def test_the_docs_build_in_strict_mode(tmp_path: Path) -> None:
    # strict: a broken link, a missing page, an unknown anchor, a snippet or a reference
    # to an object that does not exist fails the build
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f",
                          str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "index.html").exists()
    assert "SamplingParams" in (tmp_path / "site" / "reference" / "index.html").read_text()


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.glob("*.md"):
        assert f": {page.name}" in nav, page.name


def test_the_readme_example_is_the_quickstart() -> None:
    blocks = python_blocks(ROOT / "README.md")
    assert blocks, "the README shows an example"
    assert blocks[0] + "\n" == (ROOT / "examples" / "quickstart.py").read_text()
    assert len(blocks[0].splitlines()) <= 30


def test_every_example_is_shown_in_the_docs() -> None:
    shown = {m.group(1) for path in DOCS.glob("*.md") for block in python_blocks(path)
             if (m := SNIPPET.match(block.strip()))}
    examples = {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py")}
    assert shown == examples


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_the_code_on_each_page_compiles_and_names_what_exists(page: str) -> None:
    # the full programs are snippets of examples/ and run in tests/test_examples.py; the fragments
    # must at least parse (top-level await allowed) and every aiollama.<name> they use must exist
    text = (DOCS / page).read_text()
    for block in python_blocks(DOCS / page):
        if SNIPPET.match(block.strip()):
            assert (ROOT / SNIPPET.match(block.strip()).group(1)).is_file()  # type: ignore[union-attr]
            continue
        compile(block, page, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    for dotted in set(re.findall(r"(?<![\"'])\baiollama((?:\.[A-Za-z_]\w*)+)", text)):  # "...": a name, not code
        assert resolves("aiollama" + dotted), f"{page} names aiollama{dotted}, which does not exist"


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_the_architecture_maps_every_module() -> None:
    """docs/architecture.md's table of folders names each module of each folder, no more."""
    mapped: dict[str, set[str]] = {}
    for line in (DOCS / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("/`"):
            folder = cells[0].strip("`").removeprefix("aiollama/")
            mapped.setdefault(folder, set()).update(m.strip().strip("`") for m in cells[1].split(","))
    package = ROOT / "aiollama"
    actual = {"": {p.stem for p in package.glob("*.py")}}
    for folder in (p for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"):
        actual[f"{folder.name}/"] = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    wrong = {f"aiollama/{folder}": {"not in the table": sorted(actual.get(folder, set()) - mapped.get(folder, set())),
                                    "not in the folder": sorted(mapped.get(folder, set()) - actual.get(folder, set()))}
             for folder in mapped.keys() | actual.keys() if mapped.get(folder) != actual.get(folder)}
    assert wrong == {}
