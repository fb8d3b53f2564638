"""Fails on an upward import or an import cycle in the ``lightning_fthsdp`` package; prints each one found.

    python scripts/check_layers.py [SRC]          # SRC defaults to src/ of this checkout

Planes, lowest first; a module may import its own package and any package of a lower plane, nothing else.
Imports inside functions or under ``if TYPE_CHECKING:`` count for the planes (a lazy import is still a dependency)
but not for cycles (they do not run at import time); the rest must form no cycle, also inside one package. The root
package (``lightning_fthsdp/__init__.py``, which registers the Lightning strategy) is the top plane.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "lightning_fthsdp"

PLANES: tuple[frozenset[str], ...] = (
    frozenset({"config", "faults", "netcluster", "protocol"}),  # netcluster: hosts on network namespaces, stdlib only
    frozenset({"lighthouse", "membership", "exchange", "recovery", "data"}),  # the service and the ranks' side
    frozenset({"manager"}),
    frozenset({"lightning", "accelerate", "models", "recipes", "sim"}),
    frozenset({"launch"}),
    frozenset({"demo", "slurm", "k8s", "testing"}),  # over the launcher: the demo, a cluster's jobs, run checks
    frozenset({"cli", "__init__"}),
)


def plane_of(part: str) -> int | None:
    return next((index for index, members in enumerate(PLANES) if part in members), None)


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def imports(tree: ast.Module, module: str, is_package: bool,
            known: set[str]) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, runs at import time) for every import of our package, relative ones resolved; for
    ``from pkg import name`` the submodule ``pkg.name`` where one exists, else ``pkg`` (its ``__init__``)."""
    for node, at_import in _statements(tree, True):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                yield name, node.lineno, at_import


def _statements(node: ast.AST, at_import: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every node under ``node``, with whether it runs when the module is imported: not inside a function or
    lambda, not under ``if TYPE_CHECKING:`` (module-level ``try``, ``if`` and class bodies do run)."""
    for child in ast.iter_child_nodes(node):
        yield child, at_import
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _statements(child, False)
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for statement in child.body:
                yield statement, False
                yield from _statements(statement, False)
            for statement in child.orelse:
                yield statement, at_import
                yield from _statements(statement, at_import)
        else:
            yield from _statements(child, at_import)


def check(src: Path) -> list[str]:
    root = src / PACKAGE
    known = {module_name(p, src): p for p in root.rglob("*.py")}
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in sorted(known.items()):
        tree = ast.parse(path.read_text(), str(path))
        parts = module.split(".")
        own = parts[1] if len(parts) > 1 else "__init__"
        if plane_of(own) is None:
            problems.append(f"{path}: {PACKAGE}.{own} is in no plane: add it to PLANES in {__file__}")
            continue
        for target, line, module_level in imports(tree, module, path.name == "__init__.py", set(known)):
            if target not in known:
                continue
            target_parts = target.split(".")
            theirs = target_parts[1] if len(target_parts) > 1 else "__init__"
            theirs_plane = plane_of(theirs)
            if theirs != own and theirs_plane is not None and theirs_plane >= plane_of(own):  # type: ignore[operator]
                problems.append(f"{path}:{line}: {module} imports {target}: {PACKAGE}.{theirs} is not in a plane "
                                f"below {PACKAGE}.{own} (planes, lowest first: {[sorted(p) for p in PLANES]})")
            if module_level and target != module:
                graph[module].add(target)
    problems += [f"import cycle among: {', '.join(cycle)}" for cycle in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each import cycle: every strongly connected component of more than one (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main(argv: list[str]) -> int:
    src = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "src"
    problems = check(src)
    for problem in problems:
        print(problem)
    print(f"check_layers: {len(problems)} problem(s) in {src / PACKAGE}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
