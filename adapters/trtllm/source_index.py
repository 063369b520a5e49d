"""What each class of a TensorRT-LLM source file defines, read with :mod:`ast` only.

Used by :mod:`.doctor`; nothing is imported or run. For every class in a file (nested
ones too) :func:`classes` records, per name:

- its **kinds**: ``method`` (a plain ``def``, ``staticmethod``/``classmethod``
  included), ``property`` (a ``def`` decorated ``property``, ``cached_property`` or
  ``<name>.setter``/``.getter``), ``attribute`` (assigned on ``self`` anywhere in the
  class, or in the class body);
- the constructor of the first value assigned to it (``list``, ``dict``, ``Queue`` for
  ``queue.Queue()``/``Queue()``/an annotation ``queue.Queue[...]``), or ``other``;
- whether the class **reads** ``self.<name>`` (a load anywhere in its body: the loop,
  or ``__init__`` handing it to a helper) and whether it **bumps** it
  (``self.<name> += ...``).

:class:`Sources` parses each file once and says why a file could not be used: absent
(``None``: the caller tells a partial install from drift), or unparseable (a string).
Errors reading a file that exists raise :class:`SourceUnreadable`.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Final

from quiesce.errors import QuiesceError

PROPERTY_DECORATORS: Final = frozenset({"property", "cached_property"})


class DoctorError(QuiesceError):
    """The drift check could not run; nothing was checked."""


class SourceNotFound(DoctorError):
    """No TensorRT-LLM sources where they were looked for."""


class SourceUnreadable(DoctorError):
    """A directory or file exists but cannot be read."""


@dataclasses.dataclass
class ClassInfo:
    """The names one class defines (module docstring)."""

    kinds: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    values: dict[str, str] = dataclasses.field(default_factory=dict)
    reads: set[str] = dataclasses.field(default_factory=set)
    bumps: set[str] = dataclasses.field(default_factory=set)

    def add(self, name: str, kind: str) -> None:
        self.kinds.setdefault(name, set()).add(kind)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return _dotted(node.value)
    return "other"


def value_kind(value: ast.expr | None, annotation: ast.expr | None = None) -> str:
    """The constructor of an assigned value (``list``, ``dict``, ``Queue``...)."""
    if isinstance(value, (ast.List, ast.ListComp)):
        return "list"
    if isinstance(value, (ast.Dict, ast.DictComp)):
        return "dict"
    if isinstance(value, ast.Call):
        return _dotted(value.func)
    if annotation is not None:
        return _dotted(annotation)
    return "other"


def targets(node: ast.AST) -> list[tuple[ast.expr, ast.expr | None, ast.expr | None]]:
    """(target, value, annotation) of each name an assignment statement binds."""
    if isinstance(node, ast.Assign):
        flat: list[ast.expr] = []
        for target in node.targets:
            flat.extend(target.elts if isinstance(target, ast.Tuple) else [target])
        return [(t, node.value, None) for t in flat]
    if isinstance(node, ast.AnnAssign):
        return [(node.target, node.value, node.annotation)]
    if isinstance(node, ast.AugAssign):
        return [(node.target, node.value, None)]
    return []


def _def_kind(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    for decorator in node.decorator_list:
        name = _dotted(decorator)
        if name in PROPERTY_DECORATORS or name in ("setter", "getter", "deleter"):
            return "property"
    return "method"


def _self_attr(node: ast.AST) -> str | None:
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self"):
        return node.attr
    return None


def _scan(cls: ast.ClassDef, info: ClassInfo) -> None:
    for item in cls.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            info.add(item.name, _def_kind(item))
        for target, value, annotation in targets(item):
            if isinstance(target, ast.Name):
                info.add(target.id, "attribute")
                info.values.setdefault(target.id, value_kind(value, annotation))
    for node in ast.walk(cls):
        for target, value, annotation in targets(node):
            name = _self_attr(target)
            if name is not None:
                info.add(name, "attribute")
                info.values.setdefault(name, value_kind(value, annotation))
                if isinstance(node, ast.AugAssign):
                    info.bumps.add(name)
        name = _self_attr(node)
        if name is not None and isinstance(getattr(node, "ctx", None), ast.Load):
            info.reads.add(name)


def classes(tree: ast.Module) -> dict[str, ClassInfo]:
    """Every class in the module (nested ones too) and what it defines."""
    found: dict[str, ClassInfo] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        _scan(cls, found.setdefault(cls.name, ClassInfo()))
    return found


class Sources:
    """Parses each file of the package once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._parsed: dict[str, dict[str, ClassInfo] | str | None] = {}

    def classes(self, relative: str) -> dict[str, ClassInfo] | str | None:
        """The file's classes; None when the file does not exist; else why it could not
        be parsed. Raises :class:`SourceUnreadable` when it exists but cannot be read."""
        if relative not in self._parsed:
            path = self.root / relative
            try:
                text = path.read_text(encoding="utf-8")
            except FileNotFoundError:
                self._parsed[relative] = None
            except (OSError, UnicodeDecodeError) as exc:
                raise SourceUnreadable(f"cannot read {path}: {exc}") from exc
            else:
                try:
                    self._parsed[relative] = classes(ast.parse(text, str(path)))
                except SyntaxError as exc:
                    self._parsed[relative] = f"does not parse ({exc.msg}, line {exc.lineno})"
                except ValueError as exc:  # NUL bytes: Python 3.11 raises ValueError
                    self._parsed[relative] = f"does not parse ({exc})"
        return self._parsed[relative]
