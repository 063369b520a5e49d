"""Reading the installed ai-dynamo's source with ``ast`` (for the contract tests).

``dynamo.sglang.main`` and ``dynamo.trtllm.main`` do not import without their engines
(SGLang, TensorRT-LLM), so the contract tests read their files: what each module defines
or imports at module level, and how its functions call those names. Nothing here imports
the module it reads.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

Function = ast.FunctionDef | ast.AsyncFunctionDef


def source_path(module: str) -> Path:
    """The installed file of ``module`` (a package's ``__init__.py``), found without
    importing it or any package below ``dynamo``."""
    top, *parts = module.split(".")
    spec = importlib.util.find_spec(top)
    assert spec is not None and spec.submodule_search_locations, f"{top} is not installed"
    for root in spec.submodule_search_locations:
        base = Path(root).joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    raise AssertionError(f"no source for {module} in {list(spec.submodule_search_locations)}")


def parse(module: str) -> ast.Module:
    return ast.parse(source_path(module).read_text(), filename=str(source_path(module)))


def module_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    """Every name the module binds at its top level: defs, classes, imports, assignments."""
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
    return names


def imported_from(tree: ast.Module, name: str) -> str | None:
    """The module ``name`` is imported from at top level (``from X import name``), or None."""
    node = module_level_names(tree).get(name)
    return node.module if isinstance(node, ast.ImportFrom) else None


def function(tree: ast.Module | ast.ClassDef | Function, name: str) -> Function:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise AssertionError(f"no function {name}")


def class_def(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"no class {name}")


def calls_of(node: ast.AST, name: str) -> list[ast.Call]:
    """Calls of the bare name ``name`` inside ``node``: looked up in the module's globals
    at call time, so a replacement installed before the call is what runs."""
    return [c for c in ast.walk(node) if isinstance(c, ast.Call)
            and isinstance(c.func, ast.Name) and c.func.id == name]


def awaited(node: ast.AST, call: ast.Call) -> bool:
    return any(isinstance(a, ast.Await) and a.value is call for a in ast.walk(node))


def arg_name(call: ast.Call, index: int) -> str | None:
    """The source text of positional argument ``index`` of ``call``, or None."""
    return ast.unparse(call.args[index]) if len(call.args) > index else None


def keywords(call: ast.Call) -> set[str]:
    return {k.arg for k in call.keywords if k.arg is not None}


def parameters(func: Function) -> tuple[list[str], list[str]]:
    """(positional parameter names, keyword-only parameter names)."""
    return ([a.arg for a in func.args.posonlyargs + func.args.args],
            [a.arg for a in func.args.kwonlyargs])


def decorators(func: Function) -> list[str]:
    return [ast.unparse(d) for d in func.decorator_list]


def yields(func: Function) -> Iterator[ast.expr | None]:
    return (n.value for n in ast.walk(func) if isinstance(n, ast.Yield))


def dynamo_args_flags(func: Function) -> set[str]:
    """Attributes ``X`` read as ``config.dynamo_args.X`` in the ``if`` tests of ``func``."""
    flags = set()
    for node in ast.walk(func):
        if isinstance(node, ast.If):
            for sub in ast.walk(node.test):
                if isinstance(sub, ast.Attribute) and ast.unparse(sub.value) == \
                        "config.dynamo_args":
                    flags.add(sub.attr)
    return flags


def attribute_calls(node: ast.AST, attribute: str) -> list[ast.Call]:
    """Calls of ``<anything>.attribute(...)`` inside ``node``."""
    return [c for c in ast.walk(node) if isinstance(c, ast.Call)
            and isinstance(c.func, ast.Attribute) and c.func.attr == attribute]


def dict_literal(tree: ast.Module, name: str) -> dict[str, str]:
    """The module-level dict literal assigned to ``name``: source text of each key and
    value (string keys unquoted)."""
    node = module_level_names(tree).get(name)
    assert isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict), name
    return {str(k.value) if isinstance(k, ast.Constant) else ast.unparse(k): ast.unparse(v)
            for k, v in zip(node.value.keys, node.value.values, strict=True) if k is not None}


def dict_displays(func: Function) -> list[dict[str, str]]:
    """The dict literals ``func`` yields: source text of each key and value (string keys
    unquoted)."""
    return [{str(k.value) if isinstance(k, ast.Constant) else ast.unparse(k): ast.unparse(v)
             for k, v in zip(y.keys, y.values, strict=True) if k is not None}
            for y in yields(func) if isinstance(y, ast.Dict)]
