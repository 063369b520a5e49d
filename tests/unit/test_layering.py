"""Imports only go downward (DESIGN.md "Layout and layers"), and the core is stdlib-only.

Read from the source with ast, so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MECHANISMS = {"errors", "budget", "probe", "admission", "drain", "discovery", "engine",
              "registry", "signal_guard", "signal_engine", "generation", "drain_cost",
              "eta"}
LIFECYCLE = {"lifecycle", "lifecycle_state", "shutdown"}
FACES = {"cli", "demo", "__main__", "__init__", "metrics", "server", "worker", "admin_client",
         "dynamo_worker",
         "pod_deletion_cost",
         "serve_options", "openai_api", "openai_protocol", "status_format"}
ENGINE_IMPORTS = {"vllm": {"vllm"}, "sglang": {"sglang"}, "trtllm": {"tensorrt_llm"},
                  "nvml": {"pynvml"}, "etcd": {"aetcd"}, "dynamo": {"dynamo"}}
"""Third-party packages an adapter may import, lazily (inside a function) only."""
THIRD_PARTY_ALLOWED_IN_FACES = {"fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client",
                                "httpx"}


def modules() -> list[tuple[str, Path]]:
    out = [(f"quiesce.{p.stem}", p) for p in sorted((ROOT / "core").glob("*.py"))]
    adapters = ROOT / "adapters"
    out += [("quiesce.adapters." + ".".join(p.relative_to(adapters).with_suffix("").parts), p)
            for p in sorted(adapters.rglob("*.py"))]
    return out


def imported(path: Path, module_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def layer(module: str) -> int:
    """0 = mechanisms, 1 = lifecycle, 2 = faces; adapters sit beside the mechanisms."""
    leaf = module.rsplit(".", maxsplit=1)[-1]
    if module.startswith("quiesce.adapters"):
        return 0
    if leaf in MECHANISMS:
        return 0
    if leaf in LIFECYCLE:
        return 1
    assert leaf in FACES, f"{module} is in no layer: add it to tests/unit/test_layering.py"
    return 2


@pytest.mark.parametrize("module,path", modules(), ids=str)
def test_imports_only_go_downward(module: str, path: Path) -> None:
    own = layer(module)
    for name in imported(path):
        top = name.split(".")[0]
        if top == "quiesce":
            if name in ("quiesce", "quiesce.adapters"):
                continue
            target = layer(name)
            assert target <= own, f"{module} (layer {own}) imports {name} (layer {target})"
            if module.startswith("quiesce.adapters") and not name.startswith("quiesce.adapters"):
                assert name.split(".")[-1] in MECHANISMS, f"adapter {module} imports {name}"
            if own == 0 and not module.startswith("quiesce.adapters"):
                assert not name.startswith("quiesce.adapters"), f"{module} imports an adapter"
        elif top not in sys.stdlib_module_names:
            if module.startswith("quiesce.adapters."):
                adapter = module.split(".")[2]
                assert top in ENGINE_IMPORTS.get(adapter, set()), (
                    f"adapter {module} imports {name!r}, which is not its engine")
                assert name not in imported(path, module_level_only=True), (
                    f"adapter {module} imports its engine {name!r} at import time: make it lazy")
                continue
            assert own == 2 and top in THIRD_PARTY_ALLOWED_IN_FACES, (
                f"{module} imports third-party {name!r}; the core is standard library only")
