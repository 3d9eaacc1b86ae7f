"""The folders form layers that import one way, `loadtest -> serving -> router -> workers -> kernels`, and no
modules import each other, directly or round a longer cycle. Every import counts, lazy ones inside
functions included, so a cycle cannot hide behind an import placed in a function body."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("loadtest", "serving", "router", "workers", "kernels")
ALLOWED_UPWARD = {
    ("serving.cli", "loadtest.bench"): "`kvrelay bench` runs the benchmark suite (lazy, inside the subcommand)",
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    lazy: bool

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.source.replace('.', '/')}.py:{self.line})"


def _module_files() -> dict[str, Path]:
    """Every module of the five folders by dotted name (a package by the name of its `__init__`)."""
    modules = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest of our modules that `name` (or a prefix of it) names; None for other packages."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[Edge]:
    """The edges from `module` to our modules: `from p import x` goes to `p.x` when that is a module, else to
    `p` itself (a package's `__init__`); relative imports resolve against the module's package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    in_functions = {id(inner) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for inner in ast.walk(node)}
    edges = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[:len(parts) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                edges.add(Edge(module, target, node.lineno, id(node) in in_functions))
    return edges


def _graph() -> tuple[dict[str, Path], list[Edge]]:
    """Our modules and every import edge between them."""
    modules = _module_files()
    edges = [e for module, path in modules.items() for e in _imports(module, path, modules)]
    return modules, edges


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def _cycles(modules: dict[str, Path], edges: list[Edge]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan's algorithm)."""
    succ: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        succ[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return [_cycle_in(component, succ) for component in components]


def _cycle_in(component: set[str], succ: dict[str, set[str]]) -> list[str]:
    """A concrete cycle inside a strongly connected component, from its first module back to it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(succ[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_the_graph_sees_lazy_and_package_imports():
    modules, edges = _graph()
    assert {"serving.cli", "workers.engine", "kernels", "loadtest.bench"} <= modules.keys()
    pairs = {(e.source, e.target): e for e in edges}
    assert pairs[("serving.cli", "loadtest.bench")].lazy
    assert ("serving", "serving.llm") in pairs  # a package __init__ re-exporting a submodule


def test_no_folder_imports_a_folder_to_its_left():
    _, edges = _graph()
    upward = [e for e in edges if _layer(e.target) < _layer(e.source)]
    unexpected = sorted(str(e) for e in upward if (e.source, e.target) not in ALLOWED_UPWARD)
    assert not unexpected, (f"imports against the layer order {' -> '.join(LAYERS)} (move the code to the layer "
                            f"that owns it):\n  " + "\n  ".join(unexpected))
    eager = sorted(str(e) for e in upward if not e.lazy)
    assert not eager, ("the allowed upward imports must stay inside the function that needs them:\n  "
                       + "\n  ".join(eager))
    stale = set(ALLOWED_UPWARD) - {(e.source, e.target) for e in upward}
    assert not stale, f"allowed exceptions no longer used; remove them from ALLOWED_UPWARD: {sorted(stale)}"


def test_no_import_cycles():
    modules, edges = _graph()
    cycles = _cycles(modules, edges)
    assert not cycles, "modules importing each other (lazy imports count):\n  " + "\n  ".join(
        " -> ".join(cycle) for cycle in cycles)
