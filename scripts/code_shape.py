"""How the code reads, in numbers: lines, classes over 300 lines, functions over 60, import circles.

    .venv/bin/python scripts/code_shape.py [--list]

Counts the shipped packages (miles_core, flows, tasks, deployments) and the sleeps in tests/.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("miles_core", "flows", "tasks", "deployments")
SHAPED = ("miles_core", "flows", "tasks")
CLASS_LINES, FUNCTION_LINES = 300, 60


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports at module level or inside functions (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    resolved = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name and not name.startswith(target + "."):
            resolved.add(target)
    return resolved


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                strongconnect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="name every long class and function")
    args = parser.parse_args()
    modules = _modules()
    lines = sum(len(path.read_text().splitlines()) for path in modules.values())
    long_classes, long_functions = [], []
    for name, path in modules.items():
        if not name.startswith(SHAPED):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            span = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)} {getattr(node, 'name', '')} ({span})"
            if isinstance(node, ast.ClassDef) and span > CLASS_LINES:
                long_classes.append(where)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and span > FUNCTION_LINES:
                long_functions.append(where)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    circles = _circles(graph)
    sleeps = sum(
        len(re.findall(r"\b(?:time\.|asyncio\.)?sleep\(", path.read_text()))
        for path in (ROOT / "tests").rglob("*.py")
    )
    print(f"lines in {' + '.join(PACKAGES)}: {lines}")
    print(f"classes over {CLASS_LINES} lines: {len(long_classes)}")
    print(f"functions over {FUNCTION_LINES} lines: {len(long_functions)}")
    print(f"import circles: {len(circles)}" + "".join(f"\n  {' <-> '.join(c)}" for c in circles))
    print(f"sleep( calls in tests: {sleeps}")
    if args.list:
        print("\n".join(["", *long_classes, "", *long_functions]))


if __name__ == "__main__":
    main()
