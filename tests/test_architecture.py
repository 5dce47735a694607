"""The import graph holds the architecture: no circles, no reaching into another module's private names,
the planner torch-free, third parties' documented imports where they were.

The graph is read from the source (``ast``), so it includes imports under ``TYPE_CHECKING`` (a circle
there is still a circle a reader has to follow) and imports inside functions (reported separately: they
break no start-up, but are still a dependency)."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package's source lives (pyproject's package-dir).
PACKAGES = {"kvtier": ROOT / "kvtier", "kvtier.backends": ROOT / "backends", "kvtier.policies": ROOT / "policies"}


def _modules() -> dict[str, tuple[Path, bool]]:
    out: dict[str, tuple[Path, bool]] = {}
    for pkg, d in PACKAGES.items():
        for f in d.rglob("*.py"):
            parts = [p for p in f.relative_to(d).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = (f, f.name == "__init__.py")
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The kvtier module ``name`` (a module or a name in one) belongs to."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def _imports(mod: str) -> list[tuple[str, str | None, bool]]:
    """(imported module, imported name or None, inside a function) for each kvtier import of ``mod``."""
    path, is_pkg = MODULES[mod]
    tree = ast.parse(path.read_text())
    lazy = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out: list[tuple[str, str | None, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                owner = _owner(full if full in MODULES else target)
                if owner and owner != mod:
                    out.append((owner, None if full in MODULES else alias.name, id(node) in lazy))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                owner = _owner(alias.name)
                if owner and owner != mod:
                    out.append((owner, None, id(node) in lazy))
    return out


def _cycles(include_lazy: bool) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    edges = {m: sorted({t for t, _, lazy in _imports(m) if include_lazy or not lazy}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in MODULES:
        if m not in index:
            visit(m)
    return out


def test_no_import_circle():
    assert _cycles(include_lazy=False) == []
    # Function-level imports too: the last one (layout <-> rows) went when layout's codec calls moved to
    # the memory room (kvtier.memory.rows.gather / scatter / to_payload).
    assert _cycles(include_lazy=True) == []


# The rooms, lowest first: a room imports only rooms of lower layers (function-level imports included), so
# the package reads bottom-up and nothing imports upward.  A root module is a room of its own.
LAYERS: list[set[str]] = [
    {"units", "config_errors", "threads", "plugins", "keys", "quota"},
    {"index", "format", "kvtier"},  # kvtier: the package's __init__ (re-exports keys)
    {"memory", "security"},
    {"backend_api", "policy_api", "config", "metrics", "plans"},
    {"backends", "policies", "tiering"},
    {"stack"},
    {"integrations", "workload"},
    {"simulate", "testing"},
    {"tools"},
    {"__main__", "backend", "policy", "blockformat"},  # the entry point and the deprecated names
]


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvtier"


def test_rooms_import_only_rooms_below_them():
    layer = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
    assert {_room(m) for m in MODULES} == set(layer), "every room has a layer, every layer's room exists"
    upward = sorted({f"{m} -> {t}" for m in MODULES for t, _, _ in _imports(m)
                     if _room(m) != _room(t) and layer[_room(t)] >= layer[_room(m)]})
    assert upward == []


def test_the_layer_check_sees_an_upward_import():
    layer = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
    assert layer["tools"] > layer["memory"] > layer["format"]  # so format -> memory would be reported


# Underscored names imported across modules: this list may only shrink.  The benchmark of vLLM's Redis
# rows speaks RESP to a server through the redis backend's own connection.
KNOWN_PRIVATE_IMPORTS = {
    ("kvtier.tools.bench.vllm", "kvtier.backends._resp", "Connection"),
}


def _private_imports() -> set[tuple[str, str, str]]:
    """(importer, module, name) for a private name, or a private module of another package, imported."""
    out: set[tuple[str, str, str]] = set()
    for m in MODULES:
        for target, name, _ in _imports(m):
            leaf = target.rpartition(".")[2]
            if name is not None and name.startswith("_") and not name.startswith("__"):
                out.add((m, target, name))
            elif leaf.startswith("_") and not leaf.startswith("__") and target.rpartition(".")[0] != m.rpartition(".")[0]:
                out.add((m, target, name or leaf))
    return out


def test_no_new_imports_of_private_names():
    found = _private_imports()
    assert not found - KNOWN_PRIVATE_IMPORTS, sorted(found - KNOWN_PRIVATE_IMPORTS)
    assert not {(m, t, n) for m, t, n in found if "tiering" in m or "tiering" in t or m == "kvtier.stack"}


STACK_FILES = [ROOT / "kvtier" / "stack.py", *sorted((ROOT / "kvtier" / "tiering").glob("*.py"))]
REACH_IN = re.compile(r"\b(?!self\b|cls\b|super\(\))([A-Za-z_]\w*)\._(?!_)[a-z]\w*")


def test_the_tier_stack_reaches_into_no_other_objects_private_state():
    """``s._lock``, ``stack._writing``: each object's state is changed through its own methods only."""
    hits = []
    for f in STACK_FILES:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for m in REACH_IN.finditer(code):
                if not code.lstrip().startswith(("from ", "import ")):
                    hits.append(f"{f.relative_to(ROOT)}:{n}: {m.group(0)}")
    assert hits == []


def test_the_reach_in_check_sees_a_reach_in():
    assert REACH_IN.search("with s._lock:") and REACH_IN.search("x = stack._writing")
    assert not REACH_IN.search("self._lock") and not REACH_IN.search("super().__init__()")


def test_the_stack_modules_are_in_one_room_and_the_old_ones_are_gone():
    assert not list((ROOT / "kvtier").glob("_stack_*.py"))
    assert not (ROOT / "kvtier" / "_load_plan.py").exists() and not (ROOT / "kvtier" / "manager.py").exists()


def test_planner_and_scheduler_half_are_torch_free_by_import():
    code = ("import sys, kvtier.tiering.planner, kvtier.tiering.manager, kvtier.memory.host_slots; "
            "bad = [m for m in ('torch', 'numpy.testing') if m in sys.modules]; "
            "print(bad); sys.exit(1 if 'torch' in bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_third_party_imports_stay_where_they_were_documented():
    from kvtier.backend_api import StorageBackend
    from kvtier.policy_api import EvictionPolicy, PrefetchPolicy, WritePolicy
    from kvtier.stack import LoadResult, LookupResult, StoreResult, TierStack
    from kvtier.testing import BackendConformance

    assert all(isinstance(c, type) for c in (StorageBackend, EvictionPolicy, PrefetchPolicy, WritePolicy,
                                             TierStack, LoadResult, LookupResult, StoreResult,
                                             BackendConformance))
