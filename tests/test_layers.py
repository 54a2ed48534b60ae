"""The package's layering (docs: DESIGN.md section 1), read from the source with `ast`.

Lowest first: ir < simulator < passes < schedules; tick packing uses ir and the
simulator; the lowering uses ir only; the compile path (compiler) sits on all of
those; the planner, frontend, runtime and CLI sit above. Every import counts, also
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
# "errors" (pjit_pipe/errors.py, the exception classes) sits below everything;
# "models" (the example Flax models) uses nothing of the compiler.
_CORE = {"errors", "ir", "simulator", "passes", "schedules"}
# The compile path (pjit_pipe/compiler) sits on top of everything that builds a
# program; whatever uses it may use what it uses.
_BUILD = _CORE | {"tick_packing", "lowering", "compiler"}
ALLOWED: dict[str, set[str]] = {
    "errors": {"errors"},
    "models": {"models"},
    "ir": {"errors", "ir"},
    "simulator": {"errors", "ir", "simulator"},
    "lowering": {"errors", "ir", "lowering"},
    "passes": {"errors", "ir", "simulator", "passes"},
    "tick_packing": {"errors", "ir", "simulator", "tick_packing"},
    "schedules": _CORE,
    "compiler": _BUILD,
    "planner": _BUILD | {"planner"},
    "frontend": _BUILD | {"planner", "frontend"},
    "runtime": _BUILD | {"planner", "frontend", "runtime"},
    "cli": _BUILD | {"planner", "frontend", "runtime", "cli", "models", ""},
    "": _BUILD | {"planner", "frontend", "runtime", "cli", "models", ""},
}
# Packages whose every module is public vocabulary; any other package is used
# from outside through its __init__ only (its submodules are internal).
OPEN_PACKAGES = {"errors", "ir", "models"}


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


def test_packages_are_used_through_their_entry_points() -> None:
    """Outside its own package, a package is imported from its __init__ only: the
    names there are its interface, and its submodules may change freely. The
    facade (pjit_pipe/__init__.py) maps its lazy names to their modules."""
    bad = []
    for name, path in all_modules().items():
        if name == "pjit_pipe":
            continue
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                if (
                    parts[0] == "pjit_pipe"
                    and len(parts) > 2
                    and parts[1] not in OPEN_PACKAGES | {layer(name)}
                ):
                    bad.append(f"{name} imports {target}")
    assert not bad, "imports past a package's entry points:\n" + "\n".join(bad)


def test_no_module_name_repeats() -> None:
    """A module's file name says which one it is: no basename twice in the package."""
    seen: dict[str, list[str]] = {}
    for name, path in all_modules().items():
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(name)
    repeated = {base: names for base, names in seen.items() if len(names) > 1}
    assert not repeated, f"module names used twice: {repeated}"
