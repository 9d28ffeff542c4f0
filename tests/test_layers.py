"""The package's layering, read from its source: the folders are the layers, each imports only from
the layers its rule names, the imports form no cycle, and no module or class outgrows the limits.
Imports under ``TYPE_CHECKING`` and inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import aiollama

PACKAGE = Path(aiollama.__file__).resolve().parent

# The layers, bottom up, and what each may import besides itself. "base" is the top-level modules
# everything stands on; "face" the package's lazy public namespace; the services use only it.
BASE = {"aiollama._validate", "aiollama.errors", "aiollama.models", "aiollama.config", "aiollama.sampling"}
SERVICES = {"aiollama.cli", "aiollama.serve_command", "aiollama.serve_flags", "aiollama.serve_models",
            "aiollama.plan_command", "aiollama.live", "aiollama.ray", "aiollama.__main__", "aiollama.server"}
RULES: dict[str, set[str]] = {
    "base": {"base"},
    "formats": {"base"},
    "sched": {"base", "formats"},
    "native": {"base"},
    "core": {"base", "formats", "sched"},
    "runner": {"base", "formats", "sched", "native"},
    "api": {"base", "formats", "sched", "core", "runner", "native"},
    "face": {"base", "core", "api", "native"},
    "services": {"face", "base", "formats", "services"},
}
# what may use an event loop library, or the compiled binding
EVENT_LOOP_LAYERS = {"api", "services"}
EVENT_LOOP_LIBRARIES = {"anyio", "sniffio", "trio", "asyncio"}
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250
# the scheduler's face (the package's namespace) and the step types: all the decode thread imports
# of sched/, and all that any module outside sched/ sees of its state
SCHED_FACE = {"aiollama.sched", "aiollama.sched.step"}
# what sched/ keeps to itself: the KV manager, its queues, planner and sequences
SCHED_PRIVATE = {"aiollama.sched.kvcache", "aiollama.sched.recurrent", "aiollama.sched.queues",
                 "aiollama.sched.planner", "aiollama.sched.sequence", "aiollama.sched.hostcache",
                 "aiollama.sched.checkpoints", "aiollama.sched.sharing", "aiollama.sched.idle", "aiollama.sched.room"}
# attributes by which a scheduler's KV manager or queues would be reached from outside
SCHED_INSIDES = {"_kv", "_queues", "_plan", "_rules", "memory_rules"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    if module == "aiollama":
        return "face"
    if module in BASE:
        return "base"
    if any(module == s or module.startswith(s + ".") for s in SERVICES):
        return "services"
    folder = module.split(".")[1]
    assert folder in RULES, f"{module} is in no layer"
    return folder


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            for alias in node.names:  # "from aiollama.formats import chat" imports a module
                sub = f"{node.module}.{alias.name}"
                base = PACKAGE.parent / sub.replace(".", "/")
                found.add(sub if base.with_suffix(".py").exists() or (base / "__init__.py").exists() else node.module)
    return found


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def ours(name: str) -> bool:
    return (name == "aiollama" or name.startswith("aiollama.")) and name != "aiollama._llama_cffi"


def test_the_folders_are_the_layers() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {"formats", "sched", "native", "core", "runner", "api", "server"}
    assert all(layer(m) in RULES for m in MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_rules(module: str) -> None:
    here = layer(module)
    bad = sorted(n for n in imports(MODULES[module]) if ours(n) and layer(n) != here and layer(n) not in RULES[here])
    assert bad == [], f"{module} ({here}) may import only {sorted(RULES[here])}: {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) == "core"))
def test_the_decode_thread_sees_only_the_schedulers_face(module: str) -> None:
    sched = sorted(n for n in imports(MODULES[module]) if n.startswith("aiollama.sched") and n not in SCHED_FACE)
    assert sched == [], f"{module} may import of sched/ only {sorted(SCHED_FACE)}: {sched}"


def _name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) != "sched"))
def test_no_module_outside_sched_touches_the_kv_manager(module: str) -> None:
    private = sorted(imports(MODULES[module]) & SCHED_PRIVATE)
    assert private == [], f"{module} imports what sched/ keeps to itself: {private}"
    tree = ast.parse(MODULES[module].read_text())
    reached = sorted({f"line {node.lineno}: .{node.attr}" for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and node.attr in SCHED_INSIDES})
    assert reached == [], f"{module} reaches into a scheduler: {reached}"
    kv = sorted({f"line {node.lineno}" for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and node.attr == "kv" and _name(node.value) in {"scheduler", "sched"}})
    assert kv == [], f"{module} reads a scheduler's KV manager: {kv}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_event_loops_and_the_binding_stay_where_they_belong(module: str) -> None:
    here = layer(module)
    names = imports(MODULES[module])
    roots = {n.split(".")[0] for n in names}
    if here not in EVENT_LOOP_LAYERS:
        assert not roots & EVENT_LOOP_LIBRARIES, f"{module} imports an event loop library"
    if module != "aiollama.native.binding":
        assert not roots & {"cffi", "_cffi_backend"} and "aiollama._llama_cffi" not in names


def test_no_import_cycle_between_modules() -> None:
    edges = {m: {n for n in imports(p) if n in MODULES and n != m} for m, p in MODULES.items()}
    edges["aiollama"] = set()  # the face imports lazily, by name
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


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_and_classes_stay_small(module: str) -> None:
    source = MODULES[module].read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{module} has {len(source.splitlines())} lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert size <= MAX_CLASS_LINES, f"{module}.{node.name} has {size} lines"


def test_public_names_match_their_type_stubs() -> None:
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    stubs: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module is not None
                stubs.update({alias.name: stmt.module for alias in stmt.names})
    assert stubs == aiollama._EXPORTS
