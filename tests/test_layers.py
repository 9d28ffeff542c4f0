"""The package's layering, read from its source: each module imports only modules of lower layers,
so the imports form a DAG, and the rules of DESIGN.md hold. Imports under ``TYPE_CHECKING`` and
inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import aiollama

PACKAGE = Path(aiollama.__file__).resolve().parent

# Lower number, lower layer. A module may import modules of strictly lower layers, and modules of
# its own subpackage (native/, server/).
LAYERS: dict[str, int] = {
    # base: no aiollama imports beyond each other
    "aiollama._validate": 1, "aiollama.errors": 0, "aiollama.models": 0,
    "aiollama.reasoning": 1,
    # pure: the plan, the rules, what crosses the thread boundary
    "aiollama.sampling": 2, "aiollama.text": 2, "aiollama.speculation": 2, "aiollama.kvtree": 2, "aiollama.savefile": 2,
    "aiollama.hostcache": 3, "aiollama.constraints": 3, "aiollama.toolcalls": 2,
    "aiollama.step": 3,
    "aiollama.kvcache": 4, "aiollama.chat": 4, "aiollama.boundary": 4,
    "aiollama.scheduler": 5, "aiollama.outbox": 5,
    "aiollama.generations": 6,
    # llama.cpp
    "aiollama.native": 2,
    "aiollama.tokenizer": 7, "aiollama.executor": 8,
    # the decode thread, which sees llama.cpp only through the Executor interface
    "aiollama.engine_core": 7, "aiollama.decode_loop": 8, "aiollama.embedder": 7,
    "aiollama.drafter": 7, "aiollama.ordered": 7,
    # the callers' side
    "aiollama.portal": 7, "aiollama.stream": 8, "aiollama.client": 9, "aiollama.chat_turns": 10,
    "aiollama.conversation": 11, "aiollama.engine": 12,
    # services: the public API only
    "aiollama.live": 13, "aiollama.server": 14, "aiollama.ray": 15, "aiollama.cli": 16, "aiollama.__main__": 17,
}
PURE = {"aiollama.sampling", "aiollama.text", "aiollama.step", "aiollama.kvcache", "aiollama.chat",
        "aiollama.boundary", "aiollama.scheduler", "aiollama.outbox", "aiollama.generations",
        "aiollama.hostcache", "aiollama.savefile", "aiollama.kvtree", "aiollama.constraints", "aiollama.toolcalls",
        "aiollama.reasoning", "aiollama.speculation"}
NO_EVENT_LOOP = PURE | {"aiollama.engine_core", "aiollama.decode_loop", "aiollama.executor", "aiollama.embedder",
                        "aiollama.drafter", "aiollama.ordered", "aiollama.tokenizer", "aiollama.native",
                        "aiollama.errors", "aiollama._validate"}
NATIVE_USERS = {"aiollama.native", "aiollama.tokenizer", "aiollama.executor", "aiollama.embedder", "aiollama.drafter",
                "aiollama.ordered"}
SERVICES = {"aiollama.live", "aiollama.server", "aiollama.ray", "aiollama.cli", "aiollama.__main__"}
PUBLIC = {"aiollama", "aiollama.errors", "aiollama.models", "aiollama.sampling", "aiollama.toolcalls",
          "aiollama.reasoning"}
EVENT_LOOP_LIBRARIES = {"anyio", "sniffio", "trio", "asyncio"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def group(module: str) -> str:
    """The entry of LAYERS a module belongs to (a subpackage counts as one)."""
    for sub in ("aiollama.native", "aiollama.server"):
        if module == sub or module.startswith(sub + "."):
            return sub
    return module


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            for alias in node.names:  # "from aiollama import savefile" imports a module
                sub = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                found.add(sub if is_module else node.module)
    return found


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if module_name(p) != "aiollama"}


def test_every_module_has_a_layer() -> None:
    assert sorted(m for m in MODULES if group(m) not in LAYERS) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    here = group(module)
    bad = []
    for name in imports(MODULES[module]):
        if name == "aiollama._llama_cffi" or not (name == "aiollama" or name.startswith("aiollama.")):
            continue
        target = group(name)
        if target == here:
            continue
        if target == "aiollama":
            ok = here in SERVICES  # the public facade, for services only
        else:
            ok = target in LAYERS and LAYERS[target] < LAYERS[here]
        if here in SERVICES and target not in PUBLIC | SERVICES:
            ok = False
        if not ok:
            bad.append(name)
    assert bad == [], f"{module} imports upward or sideways: {bad}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layer_rules(module: str) -> None:
    here = group(module)
    names = imports(MODULES[module])
    roots = {n.split(".")[0] for n in names}
    if here in NO_EVENT_LOOP:
        assert not roots & EVENT_LOOP_LIBRARIES, f"{module} imports an event loop library"
    if here not in NATIVE_USERS:
        assert not any(group(n) == "aiollama.native" for n in names), f"{module} imports the native layer"
    if module != "aiollama.native.binding":
        assert not roots & {"cffi", "_cffi_backend"} and "aiollama._llama_cffi" not in names


def test_no_import_cycle() -> None:
    graph = {m: {group(n) for n in imports(p) if group(n) in LAYERS and group(n) != group(m)}
             for m, p in MODULES.items()}
    edges: dict[str, set[str]] = {}
    for m, targets in graph.items():
        edges.setdefault(group(m), set()).update(targets)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in edges.get(node, ()):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(path + [node, nxt])}"
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in edges:
        if node not in state:
            visit(node, [])


def test_public_names_match_their_type_stubs() -> None:
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    stubs: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module is not None
                stubs.update({alias.name: stmt.module for alias in stmt.names})
    assert stubs == aiollama._EXPORTS
