"""The shape of the code: no import circles, dependencies point down the layers, rooms for the big
third-party libraries, modules under 450 non-blank lines, no test support in the package.

Reads the sources with ``ast`` (nothing is imported), the rules of /work/shared/tools/structure_check.py:
an import names the longest known module it reaches; an edge to a package's ``__init__`` (a package
face re-exporting its children) is not a circle of design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("diloco", "gloo_bridge", "swift_plugin")
MAX_LINES = 450

LAYERS: dict[str, int] = {
    # 0: facts, bytes and leaf helpers: the protocol, the wire, the codec, layouts, the gloo bridge
    "diloco.protocol": 0, "diloco.wire": 0, "diloco.quant": 0, "diloco.hostmem": 0, "diloco.digest": 0,
    "diloco.keys": 0, "diloco.security": 0, "diloco.outer": 0, "diloco.corpus": 0, "diloco.layout": 0,
    "gloo_bridge": 0,
    # 1: the plan, the per-process config, the step log; the pure cores (syncer.core, island planner)
    "diloco.plan": 1, "diloco.config": 1, "diloco.steplog": 1, "diloco.steplog_scalars": 1,
    "diloco.steplog_report": 1, "diloco.syncer.core": 1, "diloco.island.planner": 1,
    "diloco.island.orders": 1,
    # 2: the drivers: the syncer's loop/data plane/store, the island's client/executor
    "diloco.syncer": 2, "diloco.island": 2,
    # 3: on top: the demo, the ms-swift plugin, the command-line tools
    "diloco.demo": 3, "swift_plugin": 3, "diloco.keys_cli": 3,
}
"""Each module belongs to the longest prefix listed here; it may import modules of its own group or of a
group whose layer is not higher. A new top-level module must be placed here (the test says so)."""

STRICT: dict[str, tuple[str, ...]] = {
    "diloco.protocol": ("diloco.protocol",),
    "diloco.wire": ("diloco.wire", "diloco.protocol"),
}
"""The bottom: these import nothing of the repository but what is listed (never syncer/island/demo)."""

NEVER: tuple[tuple[str, str], ...] = (("diloco.syncer", "diloco.island"), ("diloco.island", "diloco.syncer"))
"""The syncer and the island meet only through the wire (the island starts a syncer as a process)."""

THIRD_PARTY_ROOMS: dict[str, tuple[str, ...]] = {
    "megatron": ("diloco.layout.megatron", "diloco.demo", "swift_plugin"),
    "swift": ("swift_plugin",),
}
"""Only these modules may import these libraries, so everything else runs and is tested on a CPU."""

NO_TORCH_DISTRIBUTED = ("diloco.protocol", "diloco.wire", "diloco.quant", "diloco.syncer")
"""The wire format and the syncer know nothing of torch.distributed."""


KNOWN_CIRCLE_ROOMS: tuple[str, ...] = ()
"""Rooms allowed an import circle inside them (none now); a circle anywhere else, or across rooms,
fails at once."""


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[mod.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _trees() -> dict[str, ast.Module]:
    return {m: ast.parse(p.read_text(encoding="utf-8"), str(p)) for m, p in MODULES.items()}


TREES = _trees()


def _imported_names(mod: str) -> list[tuple[str, int]]:
    """Every dotted name an import statement of ``mod`` names (relative imports resolved), with its line."""
    path = MODULES[mod]
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    names: list[tuple[str, int]] = []
    for node in ast.walk(TREES[mod]):
        if isinstance(node, ast.Import):
            names += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
            names += [(base, node.lineno)] + [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return names


def _edges(mod: str) -> dict[str, int]:
    """Repository modules ``mod`` imports (the longest known prefix of each name) -> first line."""
    found: dict[str, int] = {}
    for name, line in _imported_names(mod):
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != mod:
            found.setdefault(name, line)
    return found


EDGES = {m: _edges(m) for m in MODULES}


def _group(mod: str) -> str | None:
    best = None
    for key in LAYERS:
        if (mod == key or mod.startswith(key + ".")) and (best is None or len(key) > len(best)):
            best = key
    return best


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def _is_face(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def test_the_rules_see_the_code() -> None:
    assert len(MODULES) > 50 and sum(len(e) for e in EDGES.values()) > 100
    # the circle finder finds a planted circle
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _import_circles() -> list[list[str]]:
    return _circles({m: {d for d in e if not _is_face(d)} for m, e in EDGES.items()})


def _known(circle: list[str]) -> bool:
    return any(all(m == k or m.startswith(k + ".") for m in circle) for k in KNOWN_CIRCLE_ROOMS)


def test_no_new_import_circles() -> None:
    new = [c for c in _import_circles() if not _known(c)]
    assert not new, "import circles: " + "; ".join(" <-> ".join(c) for c in new)


def test_no_import_circles() -> None:
    circles = _import_circles()
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in MODULES if m != "diloco" and _group(m) is None)
    assert not missing, f"place these modules in LAYERS of tests/test_structure.py: {missing}"


def test_dependencies_point_down() -> None:
    upward = []
    for mod, edges in EDGES.items():
        g = _group(mod)
        if g is None:
            continue
        for dep, line in edges.items():
            d = _group(dep)
            if d is None or d == g:
                continue
            if LAYERS[d] > LAYERS[g]:
                upward.append(f"{MODULES[mod].relative_to(ROOT)}:{line} ({g}, layer {LAYERS[g]}) imports "
                              f"{dep} ({d}, layer {LAYERS[d]})")
            for a, b in NEVER:
                if g.startswith(a) and d.startswith(b):
                    upward.append(f"{MODULES[mod].relative_to(ROOT)}:{line}: {a} must not import {b}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_protocol_and_wire_stay_at_the_bottom() -> None:
    bad = []
    for mod, edges in EDGES.items():
        for room, allowed in STRICT.items():
            if mod == room or mod.startswith(room + "."):
                bad += [f"{mod} imports {dep}" for dep in edges
                        if dep != "diloco" and not any(dep == a or dep.startswith(a + ".") for a in allowed)]
    assert not bad, bad


def test_third_party_libraries_stay_in_their_rooms() -> None:
    bad = []
    for mod in MODULES:
        for name, line in _imported_names(mod):
            top = name.split(".")[0]
            rooms = THIRD_PARTY_ROOMS.get(top)
            if rooms is not None and not any(mod == r or mod.startswith(r + ".") for r in rooms):
                bad.append(f"{MODULES[mod].relative_to(ROOT)}:{line} imports {name}")
            if name.startswith("torch.distributed") and any(mod == r or mod.startswith(r + ".")
                                                            for r in NO_TORCH_DISTRIBUTED):
                bad.append(f"{MODULES[mod].relative_to(ROOT)}:{line} imports {name}")
    assert not bad, bad


def _long_modules() -> dict[str, int]:
    out = {}
    for path in MODULES.values():
        n = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
        if n > MAX_LINES:
            out[str(path.relative_to(ROOT))] = n
    return out


def test_no_long_modules() -> None:
    long = _long_modules()
    assert not long, f"modules over {MAX_LINES} non-blank lines (split them by concept): {long}"


def test_no_test_support_in_the_package() -> None:
    shipped = sorted(m for m in MODULES if {"testing", "tests", "conftest"} & set(m.split(".")))
    assert not shipped, shipped
    toml = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["diloco*", "gloo_bridge*", "swift_plugin*"]' in toml
