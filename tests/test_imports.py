"""No import cycles among the project's modules: every `import train.x` / `from train.x import y`,
at module level or inside a function, is an edge of the graph, and the graph has no cycle (a
package's `__init__` is its own node: importing `train.a.b` is an edge to `train.a.b` only)."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / "train").rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                if target in files and target != name:
                    graph[name].add(target)
    return graph


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 30 and graph["train.trainer.grpo"]  # the walk found the package
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
