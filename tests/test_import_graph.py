"""The core's module-level imports form no cycle (imports inside functions and under
``TYPE_CHECKING`` do not count): each module can be imported on its own, and layers stay
layered (attention below plugins below the engine)."""

from __future__ import annotations

import ast
from pathlib import Path

import hitchllm

ROOT = Path(hitchllm.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path, name: str) -> set[str]:
    """hitchllm modules imported at module level by the file (``from pkg import mod`` counts
    as importing ``pkg.mod`` when that is a module)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    skipped = {id(n) for top in tree.body
               if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
               for n in ast.walk(top)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hitchllm.")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.startswith("hitchllm"):
                # The root package is being imported by everything below it: not an edge.
                found |= {base} - {"hitchllm"}
                found |= {f"{base}.{a.name}" for a in node.names}
    return found


def test_module_level_imports_have_no_cycle():
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {name: {m for m in top_level_imports(path, name) if m in modules and m != name}
             for name, path in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt):], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
