"""The layering, read from the source: cli → master | storenode | connector → protocol.

``kvpool.<package>`` is the top-level folder of that name (pyproject.toml maps them). The
protocol imports none of the other packages; master, storenode and connector never import
each other or cli; and no module imports itself back through others, not even for type
checking (a loop is a part that should be split, see docs/development.md)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "master", "storenode", "connector", "cli")
ALLOWED = {"protocol": set(), "master": {"protocol"}, "storenode": {"protocol"}, "connector": {"protocol"},
           "cli": {"protocol", "master", "storenode", "connector"}}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(("kvpool", *parts[:-1])) if parts[-1] == "__init__" else ".".join(("kvpool", *parts))
            out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvpool modules ``path`` imports, anywhere in it (lazy and type-only ones too)."""
    got = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        got.update(n for n in names if n in modules)
    return got


def test_packages_import_only_downward():
    modules = _modules()
    bad = []
    for name, path in modules.items():
        pkg = name.split(".")[1]
        for dep in _imports(path, modules):
            dpkg = dep.split(".")[1]
            if dpkg != pkg and dpkg not in ALLOWED[pkg]:
                bad.append(f"{name} imports {dep}")
    assert not bad, "layering broken (cli → master|storenode|connector → protocol):\n" + "\n".join(bad)


def test_no_import_loops():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components (iterative depth is small)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not loops, "import loops:\n" + "\n".join(" ↔ ".join(c) for c in loops)
