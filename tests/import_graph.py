"""The import graph of tessera's packages, read from source with `ast` (nothing is imported or
run): the imports that go up a floor, and those that close a cycle between modules.

Every `import` and `from ... import` counts, at module level or inside a function or an
`if TYPE_CHECKING:` block; relative imports are resolved against the importing file.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Set
from dataclasses import dataclass
from pathlib import Path

# Imports run one way: a package may import only from its own floor or below.
# NOTE: generated code under gateway/_proto is gateway's; the `tessera` command joins floor 3
# when it leaves runtime/.
FLOORS = {"kernels": 0, "runtime": 1, "gateway": 2, "ops": 3, "loadtest": 3}


@dataclass(frozen=True, order=True)
class Edge:
    file: str  # relative to the root, with forward slashes
    line: int
    source: str  # dotted module names
    target: str

    @property
    def pair(self) -> tuple[str, str]:
        return self.source, self.target

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.source} -> {self.target}"


@dataclass(frozen=True, order=True)
class Violation:
    kind: str  # "upward" or "cycle"
    edge: Edge

    def __str__(self) -> str:
        return f"{self.kind}: {self.edge}"


def find_violations(root: Path) -> list[Violation]:
    """Upward edges and edges inside an import cycle, each once, in file and line order."""
    edges = import_edges(root)
    upward = [Violation("upward", e) for e in edges if floor(e.source) < floor(e.target)]
    cyclic = [Violation("cycle", e) for e in cyclic_edges(edges)]
    return sorted(upward + cyclic, key=lambda v: (v.edge, v.kind))


def import_edges(root: Path) -> list[Edge]:
    files = {module_name(path.relative_to(root)): path
             for package in FLOORS if (root / package).is_dir()
             for path in sorted((root / package).rglob("*.py"))}
    modules = set(files)
    edges: set[Edge] = set()
    for source, path in files.items():
        relative = path.relative_to(root).as_posix()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=relative)):
            for target in _targets(node, source, is_package, modules):
                if target != source:
                    edges.add(Edge(relative, node.lineno, source, target))
    return sorted(edges)


def module_name(relative: Path) -> str:
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> int:
    return FLOORS[module.partition(".")[0]]


def cyclic_edges(edges: list[Edge]) -> list[Edge]:
    """The edges whose two ends lie in one strongly connected component: exactly the edges
    that stand on some cycle."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
    component = _components(graph)
    return [e for e in edges
            if e.source in component and component[e.source] == component.get(e.target)]


def _targets(node: ast.AST, source: str, is_package: bool, modules: Set[str]) -> Iterator[str]:
    """The tessera modules one import statement names (other packages are not followed)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = source.split(".") if is_package else source.split(".")[:-1]
            anchor = package[:len(package) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        names = [f"{base}.{alias.name}" for alias in node.names]
        names = [n if n in modules else base for n in names]
    else:
        return
    for name in names:
        if name.partition(".")[0] not in FLOORS:
            continue
        while name not in modules and "." in name:
            name = name.rpartition(".")[0]  # `import a.b.c` where only a.b is a file
        yield name


def _components(graph: dict[str, set[str]]) -> dict[str, str]:
    """Tarjan's algorithm: each node -> a representative of its strongly connected component;
    nodes on no cycle are left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    component: dict[str, str] = {}

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                component.update({m: node for m in members})

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return component
