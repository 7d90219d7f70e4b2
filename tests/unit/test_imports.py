"""The import graph of Phalanx's packages, read from the source with `ast` (imports inside functions
included: a lazy import is a dependency all the same; `if TYPE_CHECKING:` blocks left out, since
they never run): no cycle between files, none between top-level packages, and the user package
`phalanx` imports none of the platform's (DESIGN.md: it must not)."""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = tuple(p for p in ("phalanx", "server", "scheduler", "worker_agent", "stack") if (ROOT / p).is_dir())
PLATFORM = {"server", "scheduler", "worker_agent", "stack"}  # what `phalanx` must not import


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (one of PACKAGES')
    line: int

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth (functions, classes, try blocks, ...)."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and _type_checking_only(node):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))
    return found


def _nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(modules: dict[str, Path]) -> list[Import]:
    """The edges between our modules. `from a.b import c` is an edge to `a.b.c` when that is a
    module, else to `a.b` (as import-linter's grimp reads it)."""
    edges: set[Import] = set()
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            for target in targets:
                resolved = _nearest_module(target, modules)
                if resolved is not None and resolved != module:
                    edges.add(Import(module, resolved, node.lineno))
    return sorted(edges, key=lambda e: (e.source, e.line, e.target))


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node: each node of one lies on a cycle
    through every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm; the graphs here are small
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each component of `components`."""
    return [shortest_cycle(graph, component) for component in components(graph)]


def shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, set()) & component):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a component of two or more always has one


def _describe(cycle: list[str], edges: list[Import]) -> str:
    """`a (line 3) → b (line 9) → a`: where each step is imported."""
    steps = []
    for source, target in itertools.pairwise(cycle):
        lines = sorted({e.line for e in edges if e.source == source and e.target == target})
        steps.append(f"{source} (line {', '.join(map(str, lines))})")
    return " → ".join([*steps, cycle[-1]])


def test_no_import_cycle_between_files() -> None:
    edges = imports(module_files())
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in edges:
        graph[edge.source].add(edge.target)
    found = [
        f"\n  {', '.join(sorted(component))}, e.g. {_describe(shortest_cycle(graph, component), edges)}"
        for component in components(graph)
    ]
    assert not found, "files that import each other, directly or around a cycle:" + "".join(found)


def package(module: str) -> str:
    return module.split(".")[0]


def test_no_import_cycle_between_packages() -> None:
    crossing = [e for e in imports(module_files()) if package(e.source) != package(e.target)]
    edges = sorted(crossing, key=lambda e: (package(e.source), package(e.target)))
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in edges:
        graph[package(edge.source)].add(package(edge.target))
    found = []
    for component in components(graph):  # every import between its packages is on a cycle
        found.append(f"\n  {' ⇄ '.join(sorted(component))}:")
        for (source, target), group in itertools.groupby(edges, lambda e: (package(e.source), package(e.target))):
            if source in component and target in component:
                sites = sorted({f"{e.source}:{e.line}" for e in group})
                found.append(f"\n    {source} → {target}: {', '.join(sites)}")
    assert not found, "packages that import each other:" + "".join(found)


def test_the_user_package_imports_nothing_of_the_platform() -> None:
    found = [
        f"\n  {e}" for e in imports(module_files()) if package(e.source) == "phalanx" and package(e.target) in PLATFORM
    ]
    assert not found, "phalanx imports the platform:" + "".join(found)


def test_the_graph_sees_lazy_relative_and_aliased_imports(tmp_path: Path) -> None:
    """The reader itself: an import inside a function, a relative one, `from p import module` and a
    TYPE_CHECKING-only one (left out), on a made-up package."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg import b\n",
        "b.py": "from .sub import c\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.a as alias\nfrom ..b import name\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    modules = {
        ".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }
    edges = {(e.source, e.target) for e in imports(modules)}
    assert edges == {("pkg.a", "pkg.b"), ("pkg.b", "pkg.sub.c"), ("pkg.sub.c", "pkg.a"), ("pkg.sub.c", "pkg.b")}
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    del graph["pkg.sub.c"]
    assert cycles(graph) == []
