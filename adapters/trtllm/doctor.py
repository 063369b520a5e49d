"""Drift check without a GPU: do TensorRT-LLM's sources still define what the adapter reads?

``quiesce doctor trtllm [--source DIR] [--json]`` and, at a worker's start-up,
:func:`startup_check`. Nothing of TensorRT-LLM is imported (it needs CUDA, TensorRT and
NCCL to import at all): the package is located with ``importlib.util.find_spec`` (which
finds a top-level package without running it) or the distribution's file list, or taken
from ``--source`` (a checkout of the TensorRT-LLM repository, an unpacked wheel, or the
``tensorrt_llm`` package directory itself), and the files named in :mod:`.layouts` are
parsed with :mod:`ast`.

For each :class:`~.layouts.Requirement` the result is ``found`` (its newest layout),
``alternative`` (an older known layout) or ``missing``. The verdict is OK when every
*required* one is found or alternative: the in-process probe can then read every count
on this version. Where one is missing the probe still runs, but fails closed (UNKNOWN)
for good, so a drain can only end at its budget: the doctor says so and exits 1.
Optional requirements (the weaker paths, a narrower count) are reported, never fatal.

Costs: one parse of each named file (py_executor.py is ~450 KB on recent builds; about
0.2 s in all). Errors are typed: :class:`SourceNotFound` (nothing to check) and
:class:`SourceUnreadable` (a directory or file that cannot be read); neither changes
anything.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import importlib.util
import logging
from pathlib import Path
from typing import Any, Final, Literal

from quiesce.errors import QuiesceError

from .layouts import CTX_IN_TRANSMISSION, REQUIREMENTS, Layout, Member, Requirement

log = logging.getLogger("quiesce.adapters.trtllm.doctor")

PACKAGE: Final = "tensorrt_llm"
Status = Literal["found", "alternative", "missing"]


class DoctorError(QuiesceError):
    """The drift check could not run; nothing was checked."""


class SourceNotFound(DoctorError):
    """No TensorRT-LLM sources where they were looked for."""


class SourceUnreadable(DoctorError):
    """A directory or file exists but cannot be read."""


@dataclasses.dataclass
class _ClassInfo:
    members: set[str] = dataclasses.field(default_factory=set)
    values: dict[str, str] = dataclasses.field(default_factory=dict)
    """attribute → kind of the first value assigned to it (``list``, ``dict``, ...)."""


def _value_kind(node: ast.expr | None) -> str:
    if isinstance(node, (ast.List, ast.ListComp)):
        return "list"
    if isinstance(node, (ast.Dict, ast.DictComp)):
        return "dict"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id
    return "other"


def _targets(node: ast.AST) -> list[tuple[ast.expr, ast.expr | None]]:
    if isinstance(node, ast.Assign):
        flat: list[ast.expr] = []
        for target in node.targets:
            flat.extend(target.elts if isinstance(target, ast.Tuple) else [target])
        return [(t, node.value) for t in flat]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [(node.target, node.value)]
    return []


def _classes(tree: ast.Module) -> dict[str, _ClassInfo]:
    """Every class in the module (nested ones too) and the names it defines."""
    found: dict[str, _ClassInfo] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        info = found.setdefault(cls.name, _ClassInfo())
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                info.members.add(item.name)
            for target, value in _targets(item):
                if isinstance(target, ast.Name):
                    info.members.add(target.id)
                    info.values.setdefault(target.id, _value_kind(value))
        for node in ast.walk(cls):
            for target, value in _targets(node):
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self"):
                    info.members.add(target.attr)
                    info.values.setdefault(target.attr, _value_kind(value))
    return found


class _Sources:
    """Parses each file of the package once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._parsed: dict[str, dict[str, _ClassInfo] | str] = {}

    def classes(self, relative: str) -> dict[str, _ClassInfo] | str:
        """The file's classes, or why it could not be parsed."""
        if relative not in self._parsed:
            path = self.root / relative
            try:
                text = path.read_text(encoding="utf-8")
            except FileNotFoundError:
                self._parsed[relative] = "no such file"
            except (OSError, UnicodeDecodeError) as exc:
                raise SourceUnreadable(f"cannot read {path}: {exc}") from exc
            else:
                try:
                    self._parsed[relative] = _classes(ast.parse(text, str(path)))
                except SyntaxError as exc:
                    self._parsed[relative] = f"does not parse ({exc.msg}, line {exc.lineno})"
                except ValueError as exc:  # NUL bytes: Python 3.11 raises ValueError
                    self._parsed[relative] = f"does not parse ({exc})"
        return self._parsed[relative]

    def find(self, member: Member) -> tuple[str | None, str | None, str]:
        """(file that defines it or None, value kind or None, note)."""
        notes = []
        for relative in member.files:
            classes = self.classes(relative)
            if isinstance(classes, str):
                notes.append(f"{relative}: {classes}")
                continue
            info = classes.get(member.cls)
            if info is None:
                notes.append(f"{relative}: no class {member.cls}")
            elif member.name in info.members:
                return relative, info.values.get(member.name), ""
            else:
                notes.append(f"{relative}: {member.cls} has no {member.name}")
        return None, None, "; ".join(notes)


@dataclasses.dataclass(frozen=True)
class RequirementResult:
    requirement: Requirement
    status: Status
    layout: str | None
    members: tuple[tuple[str, str | None], ...]
    """(member, file that defines it or None) for the layout reported (or the newest)."""
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        req = self.requirement
        return {"key": req.key, "purpose": req.purpose, "path": req.path,
                "required": req.required, "status": self.status, "layout": self.layout,
                "members": [{"name": name, "file": file, "found": file is not None}
                            for name, file in self.members],
                "note": self.note}


def _check_layout(sources: _Sources, layout: Layout
                  ) -> tuple[bool, tuple[tuple[str, str | None], ...], str, str]:
    """(holds, members, notes, label with the value kind where it tells layouts apart)."""
    members, notes, label = [], [], layout.label
    for member in layout.members:
        file, kind, note = sources.find(member)
        members.append((member.describe(), file))
        if note:
            notes.append(note)
        if layout.label == CTX_IN_TRANSMISSION and kind in ("list", "dict"):
            label = f"{layout.label} ({kind})"
    return all(f is not None for _, f in members), tuple(members), "; ".join(notes), label


def _check_requirement(sources: _Sources, requirement: Requirement) -> RequirementResult:
    first: tuple[tuple[tuple[str, str | None], ...], str] | None = None
    for index, layout in enumerate(requirement.layouts):
        holds, members, note, label = _check_layout(sources, layout)
        if holds:
            return RequirementResult(requirement, "found" if index == 0 else "alternative",
                                     label, members)
        first = first or (members, note)
    assert first is not None
    tried = ", ".join(layout.label for layout in requirement.layouts)
    return RequirementResult(requirement, "missing", None, first[0],
                             f"no known layout ({tried}): {first[1]}")


@dataclasses.dataclass(frozen=True)
class DriftReport:
    root: Path
    version: str | None
    results: tuple[RequirementResult, ...]

    @property
    def ok(self) -> bool:
        """Every required name is defined, in a known layout."""
        return all(r.status != "missing" for r in self.results if r.requirement.required)

    @property
    def missing(self) -> tuple[RequirementResult, ...]:
        return tuple(r for r in self.results if r.status == "missing")

    def summary(self) -> str:
        """One line for logs."""
        where = f"TensorRT-LLM {self.version or '(version unknown)'} at {self.root}"
        layouts = ", ".join(r.layout for r in self.results
                            if r.layout and r.requirement.key in ("waiting_queue",
                                                                  "ctx_in_transfer"))
        if self.ok:
            extra = [r.requirement.key for r in self.missing]
            return (f"{where}: the adapter's names are all there (layout: {layouts})"
                    + (f"; optional missing: {', '.join(extra)}" if extra else ""))
        lost = ", ".join(r.requirement.key for r in self.missing if r.requirement.required)
        return (f"{where}: DRIFT, missing {lost}; the in-process probe will report UNKNOWN "
                "(fail closed) and drains will end at their budget")

    def to_dict(self) -> dict[str, Any]:
        return {"root": str(self.root), "version": self.version, "ok": self.ok,
                "summary": self.summary(), "requirements": [r.to_dict() for r in self.results]}

    def format(self) -> str:
        """A table for people: one line per requirement, then the verdict."""
        lines = [f"TensorRT-LLM {self.version or '(version unknown)'} at {self.root}"]
        for r in self.results:
            optional = "" if r.requirement.required else " (optional)"
            what = r.layout or r.note
            lines.append(f"  {r.status:<12} {r.requirement.key:<20} {what}{optional}")
        lines.append(("ok: " if self.ok else "drift: ") + self.summary())
        return "\n".join(lines)


def check(root: Path, version: str | None = None) -> DriftReport:
    """Check the package directory ``root`` (see :func:`package_dir`). Raises
    :class:`SourceNotFound` when it is no directory, :class:`SourceUnreadable` when a
    file in it cannot be read."""
    if not root.is_dir():
        raise SourceNotFound(f"{root} is not a directory")
    sources = _Sources(root)
    results = tuple(_check_requirement(sources, r) for r in REQUIREMENTS)
    return DriftReport(root, version if version is not None else source_version(root), results)


def source_version(root: Path) -> str | None:
    """``__version__`` from ``root/version.py`` (read with ast), or None."""
    try:
        tree = ast.parse((root / "version.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for node in tree.body:
        for target, value in _targets(node):
            if (isinstance(target, ast.Name) and target.id == "__version__"
                    and isinstance(value, ast.Constant) and isinstance(value.value, str)):
                return value.value
    return None


def package_dir(source: Path) -> Path:
    """The ``tensorrt_llm`` package directory in ``source``: a repository checkout or an
    unpacked wheel (``source/tensorrt_llm``), or the package directory itself."""
    try:
        if not source.exists():
            raise SourceNotFound(f"{source} does not exist")
        if not source.is_dir():
            raise SourceNotFound(f"{source} is not a directory")
        for candidate in (source / PACKAGE, source):
            if (candidate / "_torch").is_dir() or (candidate / "executor").is_dir():
                list(candidate.iterdir())  # readable?
                return candidate
    except PermissionError as exc:
        raise SourceUnreadable(f"cannot read {source}: {exc}") from exc
    raise SourceNotFound(f"no TensorRT-LLM package in {source} (looked for {PACKAGE}/_torch "
                         f"and _torch)")


def locate_installed() -> tuple[Path, str | None]:
    """The installed package directory and version, without importing the package."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    try:
        version: str | None = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if not locations and version is not None:
        located = Path(str(importlib.metadata.distribution(PACKAGE).locate_file(PACKAGE)))
        locations = [str(located)] if located.is_dir() else []
    if not locations:
        raise SourceNotFound(f"{PACKAGE} is not installed in this environment "
                             "(pip install 'quiesce[trtllm]', or pass --source DIR)")
    return Path(locations[0]), version


def check_installed() -> DriftReport:
    """:func:`check` on the installed package. Raises :class:`DoctorError`."""
    root, version = locate_installed()
    return check(root, version)


def startup_check() -> DriftReport | None:
    """At a worker's start-up: check the installed package and log the verdict (warning
    on drift). Never raises; None when nothing could be checked (the reason is logged).
    Blocking (~0.2 s): call it off the event loop."""
    try:
        report = check_installed()
    except Exception as exc:
        log.warning("trtllm drift check did not run: %s", exc)
        return None
    log.log(logging.INFO if report.ok else logging.WARNING, "trtllm drift check: %s",
            report.summary())
    return report
