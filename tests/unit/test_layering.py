"""Imports go one way between the rooms of the package (ARCHITECTURE.md), and the library is
standard library only.

A module's room is read from where it sits:

==========  ==============  =======================  ==========================================
room        where           import path              what
==========  ==============  =======================  ==========================================
library     ``core/*.py``   ``quiesce.*``            what a worker backend imports
adapters    ``adapters/``   ``quiesce.adapters.*``   one module or package per outside system
admin       ``core/admin/`` ``quiesce.admin.*``      the operator surface a worker embeds
serve       ``core/serve/`` ``quiesce.serve.*``      the reference worker and worker faces
ops         ``core/ops/``   ``quiesce.ops.*``        the operator's tools
==========  ==============  =======================  ==========================================

``ops → serve → admin → library ← adapters`` (and ``serve``, ``ops`` → ``adapters``): a room
imports only the rooms in :data:`MAY_IMPORT`. Inside the library, the lifecycle
(:data:`LIFECYCLE`) sits above the mechanisms, and adapters import mechanisms only. The
package's own faces are ``quiesce`` (``core/__init__.py``: re-exports of mechanisms, nothing
else) and ``quiesce.__main__`` (runs the CLI). A module anywhere else is in no room and fails.

Read from the source with ast, so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"
ADAPTERS = ROOT / "adapters"

ROOMS_IN_CORE = {"admin", "serve", "ops"}
"""Subpackages of ``core/``, each a room of its own; ``core/*.py`` is the library."""
MAY_IMPORT = {
    "library": {"library"},
    "adapters": {"library", "adapters"},
    "admin": {"library", "admin"},
    "serve": {"library", "adapters", "admin", "serve"},
    "ops": {"library", "adapters", "admin", "serve", "ops"},
    # The package's faces: the re-exports a backend imports, and `python -m quiesce`.
    "face": {"library"},
    "main": {"ops"},
}
LIFECYCLE = {"quiesce.lifecycle", "quiesce.lifecycle_state", "quiesce.shutdown"}
"""The library's upper layer (the state machine, drain runs, signal handling, one budget);
every other library module is a mechanism: pure logic, no engine and no HTTP."""
ENGINE_IMPORTS = {"vllm": {"vllm"}, "sglang": {"sglang"}, "trtllm": {"tensorrt_llm"},
                  "nvml": {"pynvml"}, "etcd": {"aetcd"}, "dynamo": {"dynamo"}}
"""Third-party packages an adapter may import, lazily (inside a function) only."""
THIRD_PARTY_OUTSIDE_THE_LIBRARY = {"fastapi", "starlette", "uvicorn", "pydantic",
                                   "prometheus_client", "httpx"}
"""What admin, serve and ops may import: the ``server`` extra (and what FastAPI brings)."""


def module_name(path: Path) -> str:
    if path.is_relative_to(ADAPTERS):
        parts = ("quiesce", "adapters", *path.relative_to(ADAPTERS).with_suffix("").parts)
    else:
        parts = ("quiesce", *path.relative_to(CORE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(path: Path) -> str | None:
    """The room a source file sits in, or None where there is no room."""
    if path.is_relative_to(ADAPTERS):
        return "adapters"
    inside = path.relative_to(CORE).parts
    if len(inside) == 1:
        return {"__init__.py": "face", "__main__.py": "main"}.get(inside[0], "library")
    return inside[0] if inside[0] in ROOMS_IN_CORE else None


def sources() -> list[Path]:
    return sorted([*CORE.rglob("*.py"), *ADAPTERS.rglob("*.py")])


MODULES = {module_name(p): p for p in sources()}


def imported(module: str, path: Path, module_level_only: bool = False) -> set[str]:
    """The modules `path` imports: ``from a import b`` is ``a.b`` where that is a module
    of the package (``from quiesce.ops import cli``), else ``a``; relative imports are
    resolved."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    package = module if path.name == "__init__.py" else module.rsplit(".", maxsplit=1)[0]
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.rsplit(".", maxsplit=node.level - 1)[0] if node.level > 1 else package
                base = f"{up}.{base}" if base else up
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in MODULES else base)
    return names


def room_of_module(name: str) -> str:
    """The room of an imported module; ``quiesce`` itself re-exports mechanisms only
    (:func:`test_package_face_only_reexports_mechanisms`), so it counts as the library."""
    assert name in MODULES, f"{name} is no module of the package"
    room = room_of(MODULES[name]) or "none"
    return "library" if room == "face" else room


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_is_in_a_room(path: Path) -> None:
    assert room_of(path) is not None, (
        f"{path.relative_to(ROOT)} is in no room: put it in core/ (the library), adapters/ or "
        f"one of core/{{{','.join(sorted(ROOMS_IN_CORE))}}}/, or add its room to "
        "tests/unit/test_layering.py and ARCHITECTURE.md")


def test_rooms_form_no_cycle() -> None:
    graph = {room: targets - {room} for room, targets in MAY_IMPORT.items()}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:  # pragma: no cover - the table above is acyclic
        pytest.fail(f"rooms import each other in a cycle: {e.args[1]}")
    assert {room_of(p) for p in sources()} <= set(MAY_IMPORT)


def test_lifecycle_modules_exist() -> None:
    """The table names real library modules (a rename must not void the rule)."""
    for name in LIFECYCLE:
        assert room_of_module(name) == "library", name


def test_package_face_only_reexports_mechanisms() -> None:
    """``core/__init__.py`` holds imports, ``__version__`` and ``__all__``: nothing else."""
    path = CORE / "__init__.py"
    tree = ast.parse(path.read_text())
    for node in tree.body[1:]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        assert isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id in ("__version__", "__all__")
            for t in node.targets), f"core/__init__.py line {node.lineno} is not a re-export"
    for name in imported("quiesce", path):
        assert name not in LIFECYCLE, f"quiesce re-exports from {name}, not a mechanism"


@pytest.mark.parametrize("room", sorted(ROOMS_IN_CORE))
def test_room_package_imports_nothing(room: str) -> None:
    """A room's ``__init__`` is its docstring: importing ``quiesce.serve.options`` must not
    bring in the HTTP stack."""
    assert not imported(f"quiesce.{room}", CORE / room / "__init__.py")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_one_way(module: str) -> None:
    path = MODULES[module]
    own = room_of(path)
    assert own is not None, f"{module} is in no room"
    for name in imported(module, path):
        top = name.split(".")[0]
        if top == "quiesce":
            target = room_of_module(name)
            assert target in MAY_IMPORT[own], (
                f"{module} ({own}) imports {name} ({target}); {own} may import "
                f"{', '.join(sorted(MAY_IMPORT[own]))}")
            if own in ("adapters", "face"):
                assert name not in LIFECYCLE, f"{module} imports {name}: mechanisms only"
            if own == "library" and module not in LIFECYCLE:
                assert name not in LIFECYCLE, f"mechanism {module} imports {name} (lifecycle)"
        elif top not in sys.stdlib_module_names:
            if own == "adapters" and module.count(".") >= 2:
                adapter = module.split(".")[2]
                assert top in ENGINE_IMPORTS.get(adapter, set()), (
                    f"adapter {module} imports {name!r}, which is not its engine")
                assert name not in imported(module, path, module_level_only=True), (
                    f"adapter {module} imports its engine {name!r} at import time: make it lazy")
                continue
            assert own in ("admin", "serve", "ops") and top in THIRD_PARTY_OUTSIDE_THE_LIBRARY, (
                f"{module} ({own}) imports third-party {name!r}; the library is standard "
                "library only")
