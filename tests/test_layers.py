"""The package layering of ``driver/``, read from the source (function-level imports included).

- No import cycles between modules, anywhere under ``driver/``.
- driver's parts (top-level modules and subpackages) import only the ones below them
  (``DRIVER_LAYERS``), inside functions too;
- the controller's subpackages import only the ones below them (``CONTROLLER_LAYERS``); the
  allocator imports nothing of the product but its errors, and no I/O library.
- The product never imports the demo or the embedded cluster (``driver.cli`` alone starts them, from
  inside the ``demo`` and ``apiserver`` commands); the embedded cluster never imports the demo.
- Each subpackage of the controller and the embedded cluster says in its docstring what it owns and
  what it may import, and names its surface in ``__all__``.
- Nothing in the repository points at a design document outside it.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import driver

PACKAGE = Path(driver.__file__).resolve().parent
REPO_ROOT = PACKAGE.parent

# driver's own parts (its top-level modules and subpackages), lowest first: each may import itself
# and what is listed for it, at module level or inside a function alike. ``driver`` itself (the
# package, which holds only the version) may be imported by any.
DRIVER_LAYERS: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "jsondepth": frozenset(),
    "probes": frozenset(),
    "gpu_usage": frozenset(),
    "gang_sources": frozenset({"errors"}),
    "inventory": frozenset({"errors"}),
    "config": frozenset({"errors", "gang_sources", "inventory"}),
    "allocator": frozenset({"errors"}),
    "kube": frozenset({"errors"}),
    "slices": frozenset({"inventory"}),
    "publisher": frozenset({"errors", "inventory", "kube", "slices"}),
    "controller": frozenset(
        {
            "allocator",
            "config",
            "errors",
            "gang_sources",
            "inventory",
            "jsondepth",
            "kube",
            "probes",
            "slices",
        }
    ),
    "plugin": frozenset(
        {"config", "errors", "inventory", "jsondepth", "kube", "probes", "publisher", "slices"}
    ),
    "cluster": frozenset({"allocator", "errors", "jsondepth", "kube", "plugin"}),
    "status": frozenset({"config", "controller", "gpu_usage", "kube"}),
    "why": frozenset({"allocator", "config", "controller", "errors", "kube"}),
    "demo": frozenset({"allocator", "cluster", "config", "errors", "gpu_usage", "kube", "slices"}),
    "cli": frozenset(
        {
            "cluster",
            "config",
            "controller",
            "demo",
            "errors",
            "inventory",
            "plugin",
            "slices",
            "status",
            "why",
        }
    ),
    "__main__": frozenset({"cli"}),
}
# driver.controller's parts, lowest first: each may import itself and what is listed for it.
CONTROLLER_LAYERS: dict[str, frozenset[str]] = {
    "model": frozenset(),
    "sizing": frozenset({"model"}),
    "view": frozenset({"model"}),
    "writes": frozenset({"model"}),
    "metrics": frozenset({"sizing"}),
    "kueue": frozenset({"model", "sizing", "writes"}),
    "gangs": frozenset({"model", "view", "metrics", "kueue"}),
    "preemption": frozenset({"model", "view", "writes", "metrics", "gangs"}),
    "consolidation": frozenset({"model", "view", "writes", "metrics", "gangs", "preemption"}),
    "diagnosis": frozenset({"model", "sizing", "kueue", "gangs"}),
    "guard": frozenset({"model", "view", "metrics"}),
    "loop": frozenset(
        {
            "model",
            "sizing",
            "view",
            "writes",
            "metrics",
            "kueue",
            "gangs",
            "preemption",
            "consolidation",
            "diagnosis",
            "guard",
        }
    ),
}
# What only the demo and the tests run: never imported by the product.
TEST_DOUBLES = ("driver.demo", "driver.cluster")
# Modules that may import from the test doubles, and only inside a function (the CLI's `demo` and
# `apiserver` commands need the `demo` extra; the agent and the controller never load them).
LAZY_DOUBLE_IMPORTERS = frozenset({"driver.cli"})
# Design and reference documents that live beside the repository, not in it (a pattern, so that
# this file, which names them, does not cite them).
OUTSIDE_DOCUMENTS = re.compile(
    r"\b(DESIGN|STYLE|dra-api|kubelet-protocol|gpu-sharing|real-cluster|ai-conformance)\.md"
    r"|reference/(gangs|kueue)\.md|\.\./shared/"
)
IO_LIBRARIES = frozenset(
    {"grpc", "http", "kubernetes", "requests", "socket", "subprocess", "urllib", "urllib3"}
)


@dataclass(frozen=True, slots=True)
class Import:
    importer: str
    imported: str
    top_level: bool  # at module level, not inside a function or class body


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if "proto_gen" not in path.parts
    }


def _imports(module: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, id(node) in top)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                yield Import(module, f"{source}.{alias.name}", id(node) in top)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported dotted name lives in (``a.b.c`` may be the name ``c`` of module ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for found in _imports(name, path):
            target = _resolve(found.imported, modules) if found.imported.startswith("driver") else None
            # importing a package's own module from its __init__ (or a module from its package) is no edge
            if target is None or target == name or (name.startswith(target + ".") and target != "driver"):
                continue
            graph[name].add(target)
    return graph


@functools.cache
def _all_imports() -> list[Import]:
    return [found for name, path in _modules().items() for found in _imports(name, path)]


def _part_of_controller(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["driver", "controller"]:
        return None
    return parts[2]


def test_no_import_cycles_between_modules() -> None:
    graph = _graph()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "import cycle: " + " -> ".join((*path[path.index(module) :], module))
        if module in done:
            return
        for imported in sorted(graph[module]):
            if imported != "driver":  # the root package holds only the driver's name
                visit(imported, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_the_allocators_state_never_reaches_up_to_placement_or_batch() -> None:
    """``state`` is the data placement and batch decide on (function-level imports included)."""
    graph = _graph()
    assert not graph["driver.allocator.state"] & {"driver.allocator.placement", "driver.allocator.batch"}


def _part_of_driver(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "driver" or len(parts) < 2:
        return None  # not ours, or the driver package itself
    return parts[1]


def test_the_drivers_parts_import_only_the_parts_below_them() -> None:
    """Function-level imports count: a bottom module (``driver.config``) reaching up into the
    controller inside a function is as much a layering fault as one at the top of the file."""
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()}
    parts -= {"__init__", "__pycache__"}
    assert parts == set(DRIVER_LAYERS), "a new part of driver needs its place in DRIVER_LAYERS"
    modules = _modules()
    wrong = []
    for found in _all_imports():
        target = _resolve(found.imported, modules) if found.imported.startswith("driver.") else None
        source, part = _part_of_driver(found.importer), _part_of_driver(target or "")
        if source is None or part is None or source == part:
            continue
        if part not in DRIVER_LAYERS[source]:
            where = "at module level" if found.top_level else "inside a function"
            wrong.append(f"{found.importer} imports {found.imported} {where} ({source} may import "
                         f"{sorted(DRIVER_LAYERS[source])})")  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_the_controllers_parts_import_only_the_parts_below_them() -> None:
    controller = PACKAGE / "controller"
    parts = {p.stem if p.is_file() else p.name for p in controller.iterdir() if not p.name.startswith("__")}
    assert parts == set(CONTROLLER_LAYERS), "a new part of driver.controller needs its place in LAYERS"
    wrong = []
    for found in _all_imports():
        source, target = _part_of_controller(found.importer), _part_of_controller(found.imported)
        if source is None or target is None or source == target:
            continue
        if target not in CONTROLLER_LAYERS[source]:
            allowed = sorted(CONTROLLER_LAYERS[source])
            wrong.append(f"{found.importer} imports {found.imported} ({source} may import {allowed})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("table", [DRIVER_LAYERS, CONTROLLER_LAYERS], ids=["driver", "controller"])
def test_the_layer_table_itself_has_no_cycle(table: dict[str, frozenset[str]]) -> None:
    order = list(table)
    for part, allowed in table.items():
        assert all(order.index(lower) < order.index(part) for lower in allowed), part


def test_the_product_never_imports_the_demo_or_the_embedded_cluster() -> None:
    wrong = []
    for found in _all_imports():
        if not found.imported.startswith(TEST_DOUBLES):
            continue
        if found.importer.startswith(TEST_DOUBLES):
            if found.importer.startswith("driver.cluster") and found.imported.startswith("driver.demo"):
                wrong.append(f"{found.importer} (the embedded cluster) imports {found.imported} (the demo)")
            continue
        if found.importer in LAZY_DOUBLE_IMPORTERS and not found.top_level:
            continue
        wrong.append(f"{found.importer} imports {found.imported}")
    assert not wrong, "\n".join(wrong)


def test_nothing_under_driver_imports_the_tests() -> None:
    assert not [f for f in _all_imports() if f.imported.split(".")[0] in {"tests", "bench", "hack"}]


def test_the_allocator_is_pure() -> None:
    wrong = []
    for found in _all_imports():
        if not found.importer.startswith("driver.allocator"):
            continue
        root = found.imported.split(".")[0]
        if root in IO_LIBRARIES:
            wrong.append(f"{found.importer} imports {found.imported} (I/O)")
        elif root == "driver" and not found.imported.startswith(("driver.allocator", "driver.errors")):
            wrong.append(f"{found.importer} imports {found.imported}")
    assert not wrong, "\n".join(wrong)


def _subpackages() -> list[Path]:
    found = []
    for parent in (PACKAGE / "controller", PACKAGE / "cluster"):
        found.append(parent / "__init__.py")
        found.extend(sorted(p for p in parent.glob("*/__init__.py") if p.parent.name != "proto_gen"))
    return found


@pytest.mark.parametrize("path", _subpackages(), ids=lambda p: str(p.parent.relative_to(PACKAGE)))
def test_each_subpackage_says_what_it_owns_and_shows_a_surface(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstring = ast.get_docstring(tree) or ""
    assert len(docstring.splitlines()) >= 3, f"{path}: a docstring saying what the package owns"
    if path.parent.name in CONTROLLER_LAYERS and path.parent.parent.name == "controller":
        assert "May import" in docstring, f"{path}: the docstring names what the package may import"
    if path.parent.name != "cluster":  # driver.cluster itself is only a map of its parts
        assert any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)
            for node in tree.body
        ), f"{path}: __all__ names the package's surface"


def test_no_sibling_crowd_in_the_controller_or_the_embedded_cluster() -> None:
    """Each folder holds a handful of modules of one concern; the API emulator is one concern."""
    for folder in (PACKAGE / "controller", PACKAGE / "cluster"):
        for directory in [folder, *(p for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__")]:
            if directory.name in {"proto_gen", "apiserver"}:
                continue
            modules = [p for p in directory.glob("*.py") if p.name != "__init__.py"]
            assert len(modules) <= 8, f"{directory}: {len(modules)} modules side by side"


def test_nothing_points_at_a_design_document_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    offending = []
    for name in tracked:
        path = REPO_ROOT / name
        if (
            path.suffix not in {".py", ".md", ".yaml", ".yml", ".tpl", ".toml", ".sh", ".txt"}
            or not path.is_file()
        ):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if OUTSIDE_DOCUMENTS.search(text):
            offending.append(name)
    assert not offending, f"cite docs/architecture.md instead: {offending}"
