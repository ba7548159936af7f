"""The package layout (README "Code map"): no module imports another that imports it back, and the
arrows between packages go one way. Every import counts, the lazy ones inside functions included, so
this is the command that shows it: `python -m pytest tests/unit/test_layout.py`."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "toolkit"

# Which package may import which (besides itself). cli/train/generate at the top may import anything;
# config is the bottom and imports no other package.
ALLOWED = {
    "config": set(),
    "launch": {"config"},
    "plan": {"config"},
    "observe": {"config", "launch", "plan"},
    "runtime": {"config", "launch", "plan", "observe"},
}


def _module(path: Path) -> str:
    parts = ["toolkit", *path.relative_to(PKG).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every toolkit module this file imports, at the top or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from toolkit.observe import memory` names a module; `from toolkit.x import func` does not
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        out |= {n for n in names if n in known and n != "toolkit"}
    return out


def graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PKG.rglob("*.py")}
    known = set(files)
    return {mod: _imports(path, known) - {mod} for mod, path in files.items()}


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
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

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    g = graph()
    assert len(g) > 40  # the walk found the package
    assert _cycles(g) == []


def test_packages_import_downwards() -> None:
    bad = []
    for mod, deps in graph().items():
        parts = mod.split(".")
        if len(parts) < 3 or parts[1] not in ALLOWED:
            continue  # top-level entries (cli, train, generate) and package roots
        for dep in deps:
            dparts = dep.split(".")
            if len(dparts) >= 2 and dparts[1] in ALLOWED and dparts[1] != parts[1] \
                    and dparts[1] not in ALLOWED[parts[1]]:
                bad.append(f"{mod} -> {dep}")
    assert bad == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_runtime_folder_holds_more_than_twelve_modules() -> None:
    """runtime/ is grouped by capability (data, faults, speed, loops, attention, sequence, moe): a folder that grows
    past twelve modules wants a sub-package."""
    folders = {p.parent for p in (PKG / "runtime").rglob("*.py")}
    crowded = {str(f.relative_to(PKG)): n for f in folders if (n := len(list(f.glob("*.py")))) > 12}
    assert crowded == {}


def test_inside_runtime_nothing_points_up_to_the_loops() -> None:
    """The two paths (runtime/loops) sit on top of runtime's other packages: nothing in runtime imports them, and the
    record (runtime/resolved.py) imports none of the modules that apply it (it sets one DeepSpeed key, before the model
    exists: DeepSpeed's linear under compile at ZeRO-3)."""
    g = graph()
    up = [f"{m} -> {d}" for m, deps in g.items() if m.startswith("toolkit.runtime.") and
          not m.startswith("toolkit.runtime.loops") for d in deps if d.startswith("toolkit.runtime.loops")]
    assert up == []
    assert not {d for d in g["toolkit.runtime.resolved"] if d.startswith(("toolkit.runtime.loops",
                                                                           "toolkit.runtime.faults"))}
