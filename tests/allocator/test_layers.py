"""The allocator's modules import one another without cycles, function-level imports included
(state is the data placement and batch decide on; it never reaches up to them)."""

from __future__ import annotations

import ast
from pathlib import Path

import driver.allocator

PACKAGE = Path(driver.allocator.__file__).resolve().parent


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("driver.allocator."):
            found.add(node.module.rsplit(".", 1)[-1])
        elif isinstance(node, ast.Import):
            found.update(
                a.name.rsplit(".", 1)[-1] for a in node.names if a.name.startswith("driver.allocator.")
            )
    return found


def test_no_import_cycles() -> None:
    graph = {p.stem: _imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert "placement" not in graph["state"] and "batch" not in graph["state"]
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module in done:
            return
        for imported in graph.get(module, ()):
            visit(imported, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())
