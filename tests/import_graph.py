"""The package's import graph as Python resolves it, read from the source (nothing imported).

Every ``import`` and ``from ... import`` counts, at module level, inside functions and
under ``TYPE_CHECKING`` alike; ``from pkg import name`` is an edge to ``pkg.name`` when that
is a module of the package, else to ``pkg``; relative imports are resolved against the
importing module. What is imported by name at run time (the registry's dotted paths,
``importlib``) is no edge: those are the lazy seams, loaded on use.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "weightsync"


#: The layers, bottom up: a module belongs to the longest prefix that names it, and imports
#: only from its own layer or those below (docs/architecture.md draws the same picture, and
#: tests/test_architecture_doc.py checks that it does).
LAYERS = {
    "weightsync.core.wire": 0,
    "weightsync.mechanisms": 1,
    "weightsync.core": 2,
    "weightsync.transports": 3,
    "weightsync": 4,  # the package's face (__init__, packed_tensor): what users and vllm/ import
    "weightsync.glue": 4,
    "weightsync.compat": 4,
    "weightsync.vllm": 5,
    "weightsync.tools": 6,
    "weightsync.__main__": 7,
}


def layer_prefix(module: str) -> str:
    """The entry of :data:`LAYERS` that ``module`` belongs to."""
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def layer(module: str) -> int:
    return LAYERS[layer_prefix(module)]


def module_name(path: Path) -> str:
    """``weightsync/core/wire/__init__.py`` -> ``weightsync.core.wire``."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def modules() -> dict[str, Path]:
    """Every module of the package (packages by their ``__init__``), by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@dataclass(frozen=True)
class Graph:
    edges: dict[str, set[str]]
    """Per module, the package's modules it imports."""

    external: dict[str, set[str]]
    """Per module, the modules it imports from outside the package (the standard library aside)."""

    def cycle(self) -> list[str] | None:
        """One import cycle (its modules in order, the first repeated at the end), or None."""
        state: dict[str, int] = {}  # 1: on the current path, 2: done
        path: list[str] = []

        def visit(node: str) -> list[str] | None:
            state[node] = 1
            path.append(node)
            for nxt in sorted(self.edges.get(node, ())):
                if state.get(nxt) == 1:
                    return [*path[path.index(nxt) :], nxt]
                if nxt not in state:
                    found = visit(nxt)
                    if found:
                        return found
            path.pop()
            state[node] = 2
            return None

        for start in sorted(self.edges):
            if start not in state:
                found = visit(start)
                if found:
                    return found
        return None


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` import reads from."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def build() -> Graph:
    known = modules()
    edges: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for name, path in known.items():
        inside: set[str] = set()
        outside: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(name, path.name == "__init__.py", node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                if target == "weightsync" or target.startswith("weightsync."):
                    while target not in known:  # ``import weightsync.x.y`` of an attribute: its module
                        target = target.rpartition(".")[0]
                    if target != name:
                        inside.add(target)
                elif target and target.split(".")[0] not in sys.stdlib_module_names:
                    outside.add(target)
        edges[name] = inside
        external[name] = outside
    return Graph(edges=edges, external=external)
