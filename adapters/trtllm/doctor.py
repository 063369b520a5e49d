"""Drift check without a GPU: do TensorRT-LLM's sources still define what the adapter reads,
as what it reads them as, on the object the executor loop uses?

``quiesce doctor trtllm [--source DIR] [--json]`` and, at a worker's start-up,
:func:`startup_check`. Nothing of TensorRT-LLM is imported (it needs CUDA, TensorRT and
NCCL to import at all): the package is located with ``importlib.util.find_spec`` (which
finds a top-level package without running it) or the distribution's file list, or taken
from ``--source`` (a checkout of the TensorRT-LLM repository, an unpacked wheel, or the
``tensorrt_llm`` package directory itself), and the files named in :mod:`.layouts` are
parsed with :mod:`ast` (:mod:`.source_index`).

For each :class:`~.layouts.Requirement` the result is one of

- ``found`` (its newest layout holds) or ``alternative`` (an older known layout holds);
- ``wrong-kind``: the layout the probe would take exists, but a name has another kind
  than the probe uses (a method turned into a property or an attribute: the probe's
  call raises, and it stays UNKNOWN for good);
- ``stale``: the layout the probe would take exists, but a name is not live (assigned
  and never read by its class: a leftover of the same name while the live object
  moved, or a fallback of the other layout that nothing uses any more: the probe would
  read it and see nothing), or its value is not what the probe needs;
- ``missing``: no known layout's names are there;
- ``incomplete``: a file that must be there is not on disk (listed in the
  distribution's file list but absent, or, without a file list, absent for every
  layout): an **incomplete install**, not drift.

Which layout "the probe would take" follows the probe: for most requirements the first
layout whose names exist (so a renamed preferred name silently falls back to the next
layout, which must then be live); for the control lists, every layout present (the probe
adds them up), one of which must hold.

The verdict (:attr:`DriftReport.status`): ``incomplete`` when a required requirement is
incomplete (exit :data:`EXIT_INCOMPLETE`), else ``drift`` when one is not found or
alternative (exit 1: the probe would report UNKNOWN for good, or worse, read a stale
object), else ``ok`` (exit 0). :attr:`DriftReport.exit_code` carries it. Optional
requirements (the weaker paths, a narrower count, the zero confirmation's helpers)
are reported, never fatal.

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
from collections.abc import Collection
from pathlib import Path
from typing import Any, Final, Literal

from .layouts import CTX_IN_TRANSMISSION, REQUIREMENTS, Layout, Member, Requirement
from .source_index import (
    DoctorError,
    SourceNotFound,
    Sources,
    SourceUnreadable,
    targets,
)

__all__ = ["EXIT_DRIFT", "EXIT_INCOMPLETE", "EXIT_OK", "DoctorError", "DriftReport",
           "RequirementResult", "SourceNotFound", "SourceUnreadable", "check",
           "check_installed", "locate_installed", "package_dir", "source_version",
           "startup_check"]

log = logging.getLogger("quiesce.adapters.trtllm.doctor")

PACKAGE: Final = "tensorrt_llm"
EXIT_OK: Final = 0
EXIT_DRIFT: Final = 1
EXIT_INCOMPLETE: Final = 7
"""An incomplete install: a file the adapter reads is not on disk (not drift)."""
Status = Literal["found", "alternative", "wrong-kind", "stale", "missing", "incomplete"]
USABLE: Final = frozenset({"found", "alternative"})


@dataclasses.dataclass(frozen=True)
class _MemberCheck:
    """One member looked up: where, whether defined, what is wrong with it."""

    member: Member
    file: str | None
    defined: bool
    problem: str  # "" when usable; else "wrong-kind: ..." or "stale: ..."
    note: str
    absent_files: tuple[str, ...]  # candidate files not on disk (all of them, or none)
    value: str | None = None


def _judge(member: Member, kinds: set[str], reads: bool, bumps: bool,
           value: str | None) -> str:
    """"" when the definition is usable as the probe uses it, else why not."""
    what = member.describe()
    if member.kind == "method" and kinds != {"method"}:
        return (f"wrong-kind: {what} is {'/'.join(sorted(kinds))}, the probe calls it "
                "as a method")
    if member.kind == "attribute" and not kinds & {"attribute", "property"}:
        return (f"wrong-kind: {what} is a method, the probe reads it as an attribute")
    if member.live == "read" and "attribute" in kinds and not reads:
        return (f"stale: {what} is assigned but its class never reads it: the executor "
                "loop uses another object")
    if member.live == "bumped" and not bumps:
        return f"stale: {what} is never incremented by its class"
    if member.value and value not in member.value:
        return f"stale: {what} is a {value}, not a {' or '.join(member.value)}"
    return ""


def _find(sources: Sources, member: Member) -> _MemberCheck:
    notes, absent = [], []
    for relative in member.files:
        classes = sources.classes(relative)
        if classes is None:
            absent.append(relative)
            notes.append(f"{relative}: no such file")
            continue
        if isinstance(classes, str):
            notes.append(f"{relative}: {classes}")
            continue
        info = classes.get(member.cls)
        if info is None:
            notes.append(f"{relative}: no class {member.cls}")
        elif member.name not in info.kinds:
            notes.append(f"{relative}: {member.cls} has no {member.name}")
        else:
            value = info.values.get(member.name)
            problem = _judge(member, info.kinds[member.name], member.name in info.reads,
                             member.name in info.bumps, value)
            return _MemberCheck(member, relative, True, problem, problem, (), value)
    all_absent = tuple(absent) if len(absent) == len(member.files) else ()
    return _MemberCheck(member, None, False, "", "; ".join(notes), all_absent)


@dataclasses.dataclass(frozen=True)
class _LayoutCheck:
    layout: Layout
    exists: bool
    problem: str
    members: tuple[_MemberCheck, ...]
    label: str

    @property
    def holds(self) -> bool:
        return self.exists and not self.problem

    @property
    def absent_files(self) -> tuple[str, ...]:
        return tuple(f for m in self.members for f in m.absent_files)


def _check_layout(sources: Sources, layout: Layout) -> _LayoutCheck:
    members = tuple(_find(sources, m) for m in layout.members)
    present = [m.describe() for m in layout.absent if _find(sources, m).defined]
    exists = all(m.defined for m in members) and not present
    problem = next((m.problem for m in members if m.problem), "")
    label = layout.label
    for check_ in members:
        if layout.label == CTX_IN_TRANSMISSION and check_.value in ("list", "dict"):
            label = f"{layout.label} ({check_.value})"
    if present:
        problem = f"defines {', '.join(present)}"
    return _LayoutCheck(layout, exists, problem if exists else "", members, label)


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


def _pairs(check_: _LayoutCheck) -> tuple[tuple[str, str | None], ...]:
    return tuple((m.member.describe(), m.file) for m in check_.members)


def _unusable(requirement: Requirement, check_: _LayoutCheck) -> RequirementResult:
    status: Status = "wrong-kind" if check_.problem.startswith("wrong-kind") else "stale"
    return RequirementResult(requirement, status, check_.label, _pairs(check_),
                             f"layout {check_.layout.label!r}: {check_.problem}")


def _check_requirement(sources: Sources, requirement: Requirement,
                       manifest: Collection[str] | None) -> RequirementResult:
    checks = [_check_layout(sources, layout) for layout in requirement.layouts]
    existing = [c for c in checks if c.exists]
    for index, check_ in enumerate(checks):
        if check_.holds and (requirement.resolve == "any" or check_ is existing[0]):
            return RequirementResult(requirement, "found" if index == 0 else "alternative",
                                     check_.label, _pairs(check_))
    if existing:
        return _unusable(requirement, existing[0])
    tried = ", ".join(layout.label for layout in requirement.layouts)
    notes = "; ".join(m.note for m in checks[0].members if m.note)
    lost = sorted({f for c in checks for f in c.absent_files})
    broken = [f for f in lost if manifest is not None and f in manifest]
    if broken or (manifest is None and checks and all(c.absent_files for c in checks)):
        files = ", ".join(broken or lost)
        why = ("listed in the distribution's file list but not on disk" if broken else
               "not on disk for any known layout (or TensorRT-LLM moved it)")
        return RequirementResult(requirement, "incomplete", None, _pairs(checks[0]),
                                 f"incomplete install: {files} {why}")
    return RequirementResult(requirement, "missing", None, _pairs(checks[0]),
                             f"no known layout ({tried}): {notes}")


@dataclasses.dataclass(frozen=True)
class DriftReport:
    root: Path
    version: str | None
    results: tuple[RequirementResult, ...]

    @property
    def status(self) -> Literal["ok", "drift", "incomplete"]:
        """``incomplete`` (a required file is not on disk), ``drift``, or ``ok``."""
        required = [r for r in self.results if r.requirement.required]
        if any(r.status == "incomplete" for r in required):
            return "incomplete"
        return "ok" if all(r.status in USABLE for r in required) else "drift"

    @property
    def ok(self) -> bool:
        """Every required name is defined, as the probe uses it, in a known layout."""
        return self.status == "ok"

    @property
    def exit_code(self) -> int:
        """:data:`EXIT_OK`, :data:`EXIT_DRIFT` or :data:`EXIT_INCOMPLETE`."""
        return {"ok": EXIT_OK, "drift": EXIT_DRIFT}.get(self.status, EXIT_INCOMPLETE)

    @property
    def missing(self) -> tuple[RequirementResult, ...]:
        """Every requirement that is not usable (whatever the reason)."""
        return tuple(r for r in self.results if r.status not in USABLE)

    def summary(self) -> str:
        """One line for logs."""
        where = f"TensorRT-LLM {self.version or '(version unknown)'} at {self.root}"
        layouts = ", ".join(r.layout for r in self.results
                            if r.layout and r.requirement.key in ("waiting_queue",
                                                                  "ctx_in_transfer"))
        required = [r for r in self.missing if r.requirement.required]
        if self.status == "incomplete":
            files = "; ".join(r.note for r in required if r.status == "incomplete")
            return (f"{where}: INCOMPLETE INSTALL, not drift ({files}); reinstall "
                    "TensorRT-LLM, the in-process probe cannot read it as it is")
        if self.ok:
            extra = [f"{r.requirement.key} ({r.status})" for r in self.missing]
            return (f"{where}: the adapter's names are all there (layout: {layouts})"
                    + (f"; optional missing: {', '.join(extra)}" if extra else ""))
        lost = ", ".join(f"{r.requirement.key} ({r.status})" for r in required)
        return (f"{where}: DRIFT, {lost}; the in-process probe will report UNKNOWN "
                "(fail closed) or read a stale object, and drains will end at their budget")

    def to_dict(self) -> dict[str, Any]:
        return {"root": str(self.root), "version": self.version, "ok": self.ok,
                "status": self.status, "exit_code": self.exit_code,
                "summary": self.summary(), "requirements": [r.to_dict() for r in self.results]}

    def format(self) -> str:
        """A table for people: one line per requirement, then the verdict."""
        lines = [f"TensorRT-LLM {self.version or '(version unknown)'} at {self.root}"]
        for r in self.results:
            optional = "" if r.requirement.required else " (optional)"
            what = r.layout if r.status in USABLE else r.note
            lines.append(f"  {r.status:<12} {r.requirement.key:<20} {what}{optional}")
        verdict = {"ok": "ok: ", "drift": "drift: ", "incomplete": "incomplete install: "}
        lines.append(verdict[self.status] + self.summary())
        return "\n".join(lines)


def check(root: Path, version: str | None = None,
          manifest: Collection[str] | None = None) -> DriftReport:
    """Check the package directory ``root`` (see :func:`package_dir`). ``manifest``: the
    files the distribution installed, relative to ``root`` (tells an incomplete install
    from drift; None for a checkout). Raises :class:`SourceNotFound` when ``root`` is no
    directory, :class:`SourceUnreadable` when a file in it cannot be read."""
    if not root.is_dir():
        raise SourceNotFound(f"{root} is not a directory")
    sources = Sources(root)
    results = tuple(_check_requirement(sources, r, manifest) for r in REQUIREMENTS)
    return DriftReport(root, version if version is not None else source_version(root), results)


def source_version(root: Path) -> str | None:
    """``__version__`` from ``root/version.py`` (read with ast), or None."""
    try:
        tree = ast.parse((root / "version.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for node in tree.body:
        for target, value, _ in targets(node):
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


def installed_manifest() -> frozenset[str] | None:
    """The files the installed distribution lists (its ``RECORD``), relative to the
    package directory; None where there is no list."""
    try:
        files = importlib.metadata.files(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    if files is None:
        return None
    return frozenset("/".join(f.parts[1:]) for f in files
                     if len(f.parts) > 1 and f.parts[0] == PACKAGE)


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
    return check(root, version, installed_manifest())


def startup_check() -> DriftReport | None:
    """At a worker's start-up: check the installed package and log the verdict (warning
    on drift). Never raises; None when nothing could be checked (the reason is logged).
    Blocking (~0.2 s): call it off the event loop."""
    try:
        report = check_installed()
    except Exception as exc:
        log.warning("trtllm drift check did not run: %s", exc)
        return None
    log.log(logging.INFO if report.ok else logging.WARNING, "trtllm drift check (%s): %s",
            report.status, report.summary())
    return report
