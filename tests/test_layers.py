"""The package's layering (docs: DESIGN.md section 1), read from the source with `ast`.

Lowest first: ir < simulator < passes < schedules; the lowering uses ir only;
the planner, frontend, runtime and CLI sit above. Every import counts, also
the ones inside functions (a lazy import is still a dependency), and no two
modules may import each other, directly or around a longer loop.
"""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pjit_pipe"

# Which layers each layer may import (itself included). "" is the package's own
# facade (pjit_pipe/__init__.py, __main__.py), which sits with the CLI on top;
# "errors" (pjit_pipe/errors.py, the exception classes) sits below everything.
_CORE = {"errors", "ir", "simulator", "passes", "schedules"}
ALLOWED: dict[str, set[str]] = {
    "errors": {"errors"},
    "ir": {"errors", "ir"},
    "simulator": {"errors", "ir", "simulator"},
    "lowering": {"errors", "ir", "lowering"},
    "passes": {"errors", "ir", "simulator", "passes"},
    "schedules": _CORE,
    "planner": _CORE | {"planner"},
    "frontend": _CORE | {"lowering", "planner", "frontend"},
    "runtime": _CORE | {"lowering", "planner", "frontend", "runtime"},
    "cli": _CORE | {"lowering", "planner", "frontend", "runtime", "cli", ""},
    "": _CORE | {"lowering", "planner", "frontend", "runtime", "cli", ""},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """The nodes inside `if TYPE_CHECKING:` blocks."""
    return {
        inner
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }


def imports_of(
    me: str, is_package: bool, source: str, modules: Iterable[str], runtime_only: bool = False
) -> set[str]:
    """The package modules that module `me` imports anywhere in `source` (functions included).

    `from pkg import name` counts as importing `pkg.name` when that is a
    module, else `pkg` itself. `runtime_only` leaves out `if TYPE_CHECKING:` imports.
    """
    modules = set(modules)
    package = me if is_package else me.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(source, me)
    skipped = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {name for name in found if name in modules and name != me}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return ""
    return parts[1]


def import_graph(runtime_only: bool = False) -> dict[str, set[str]]:
    modules = all_modules()
    return {
        name: imports_of(name, path.name == "__init__.py", path.read_text(), modules, runtime_only)
        for name, path in modules.items()
    }


def test_the_parser_sees_lazy_and_relative_imports() -> None:
    modules = {"pjit_pipe.ir", "pjit_pipe.ir.ops", "pjit_pipe.schedules", "pjit_pipe.passes.x"}
    source = (
        "import os\n"
        "from ..ir import ops\n"
        "def f():\n"
        "    from pjit_pipe.schedules import make_schedule\n"
    )
    found = imports_of("pjit_pipe.passes.x", False, source, modules)
    assert found == {"pjit_pipe.ir.ops", "pjit_pipe.schedules"}
    assert layer("pjit_pipe.passes.x") == "passes" and layer("pjit_pipe.__main__") == ""


def test_every_module_has_a_known_layer() -> None:
    unknown = {m for m in all_modules() if layer(m) not in ALLOWED}
    assert not unknown, f"modules outside the known layers: {sorted(unknown)}; add them to ALLOWED"


def test_no_upward_import() -> None:
    bad = [
        f"{src} imports {dst}"
        for src, targets in import_graph().items()
        for dst in sorted(targets)
        if layer(dst) not in ALLOWED[layer(src)]
    ]
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycle() -> None:
    """No runtime cycle: imports under `if TYPE_CHECKING:` only name types, so they do not count."""
    try:
        graphlib.TopologicalSorter(import_graph(runtime_only=True)).prepare()
    except graphlib.CycleError as cycle:
        pytest.fail("modules that import each other: " + " -> ".join(cycle.args[1]))


MAX_LINES = 400


def test_modules_stay_readable() -> None:
    too_long = {
        name: n
        for name, path in all_modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"modules over {MAX_LINES} lines (split them): {too_long}"
