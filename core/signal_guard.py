"""Signal ownership: the worker, not the engine, owns SIGTERM and SIGINT.

A signal reaches a worker in several ways: the kubelet signals the main process only;
a terminal's Ctrl-C and init shims (``dumb-init``, ``tini -g``) signal the whole
process group; systemd (``KillMode=control-group``) and ``pkill`` signal every process.
An engine's own processes (vLLM's EngineCore and model runner, SGLang's scheduler)
install handlers that run a shutdown of their own, which aborts the very requests the
worker is draining. This module keeps them out of it.

- **owner** (the worker's main process), :class:`SignalOwnership`: :meth:`~SignalOwnership.
  claim` before the engine starts (a private directory, named with the owner's pid in
  :data:`OWNER_ENV`, which every engine process inherits); :meth:`~SignalOwnership.
  permit_shutdown` right before the worker tells the engine to stop (the engine's own
  handlers run again, so its normal shutdown works); :meth:`~SignalOwnership.hold` takes
  a permit back (a worker that lets the engine act on signals while it starts, because
  nothing is admitted yet, and holds them once it serves); :meth:`~SignalOwnership.report`
  (below); :func:`kill_descendants` for the forced exit (a second signal).
- **engine processes**: :func:`guard_process`, called by an adapter's plugin in each
  engine process, wraps the SIGTERM and SIGINT handlers: until the owner permits the
  shutdown, a signal is logged and ignored; once permitted, or once the owner is gone
  (nobody would ever permit it), the engine's own handler runs. A signal costs one
  ``stat`` and one ``kill(pid, 0)``; nothing runs per request. Handlers the engine
  installs *later* (vLLM 0.31's EngineCore; SGLang's hf3fs HiCache backend) are wrapped
  as they are installed: in a guarded process ``signal.signal`` wraps what it installs
  for a guarded signal, and returns the unwrapped previous handler (save-and-restore code
  works unchanged). Not wrapped, so reported unprotected: an asyncio loop's handler
  (the loop acts through its wakeup fd, which no wrapper holds back), and whatever
  bypasses ``signal.signal`` (``_signal.signal``, a native ``signal()``/``sigaction()``).
  Without :data:`OWNER_ENV` (an engine outside a quiesce worker) nothing changes.

**The report is checked when it is read.** Each guarded process keeps a JSON marker
(``<pid>``: name, guarded now or not, what it wraps or what replaced the guard) in the
owner's directory, rewritten when ``signal.signal`` changes a guarded signal and by a
watcher thread that compares, every :data:`WATCH_INTERVAL_S` (about 10 µs each time),
``signal.getsignal`` and the kernel's handler (``sigaction``, against Python's C handler
it saw when guarding) with what it guarded. At read time :meth:`SignalOwnership.report`
also reads ``SigCgt``/``SigIgn`` in ``/proc/<pid>/status``: a guarded process whose
disposition went back to the default action is unprotected at once. A process is
protected when its marker says guarded and the kernel agrees, or when it ignores both
signals (Python's resource tracker); anything else (guard replaced, and by what; marker
unreadable; no marker) is reported unprotected by pid and name. :func:`warn_owner` adds
a warning that leaves ``protected`` alone. Linux only: elsewhere the report cannot tell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from quiesce.signal_engine import (
    DIRECTORY_PREFIX,
    GUARDED_SIGNALS,
    OWNER_ENV,
    PERMIT,
    WARNING_PREFIX,
    WATCH_INTERVAL_S,
    Handler,
    guard_process,
    warn_owner,
)

__all__ = ["DIRECTORY_PREFIX", "GUARDED_SIGNALS", "OWNER_ENV", "PERMIT", "WARNING_PREFIX",
           "WATCH_INTERVAL_S", "GuardReport", "Handler", "ProcessGuard", "SignalOwnership",
           "descendants", "guard_process", "kill_descendants", "warn_owner"]

log = logging.getLogger("quiesce.signal_guard")
_PROC = Path("/proc")


# -- the owner ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcessGuard:
    """One process of the worker, as :meth:`SignalOwnership.report` sees it."""

    pid: int
    name: str
    protected: bool
    how: str
    """``guarded (wraps <the engine's handler>)`` by :func:`guard_process`, ``ignores
    signals`` (by itself), or why it is not protected (``guard lost: <what replaced
    it>``, ``runs its own handler``, ``dies of the signal``, ...)."""

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class GuardReport:
    """Whether a group or every-process signal would reach an engine process as its own."""

    processes: tuple[ProcessGuard, ...]
    error: str | None = None
    """Why the processes could not be listed (not Linux, /proc unreadable); None if they were."""
    warnings: tuple[str, ...] = ()
    """From :func:`warn_owner`: what else may end the worker; ``protected`` ignores them."""

    @property
    def protected(self) -> bool | None:
        """True when every process is protected; None when that could not be told."""
        if self.error is not None:
            return None
        return all(p.protected for p in self.processes)

    @property
    def unprotected(self) -> tuple[ProcessGuard, ...]:
        return tuple(p for p in self.processes if not p.protected)

    def summary(self) -> str:
        warned = "".join(f"; WARNING: {text}" for text in self.warnings)
        if self.error is not None:
            return f"cannot tell whether engine processes are protected: {self.error}{warned}"
        if not self.processes:
            return f"no engine processes{warned}"
        if self.protected:
            return f"all {len(self.processes)} engine process(es) protected{warned}"
        names = ", ".join(f"{p.name} (pid {p.pid}: {p.how})" for p in self.unprotected)
        return (f"{len(self.unprotected)} of {len(self.processes)} engine process(es) would "
                f"run a shutdown of their own on SIGTERM/SIGINT: {names}{warned}")

    def to_dict(self) -> dict[str, object]:
        return {"protected": self.protected, "summary": self.summary(), "error": self.error,
                "warnings": list(self.warnings),
                "processes": [p.to_dict() for p in self.processes]}


class SignalOwnership:
    """The owner's side (see the module docstring). One per worker process."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory: Path | None = None
        self.permitted = False
        self._clock = clock
        self._cached: tuple[float, GuardReport] | None = None

    def claim(self) -> None:
        """Make the directory and export :data:`OWNER_ENV`; before the engine starts."""
        if self.directory is not None:
            return
        base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
        _remove_stale_directories(base)
        self.directory = Path(tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}{os.getpid()}-",
                                               dir=base))
        os.environ[OWNER_ENV] = f"{os.getpid()}:{self.directory}"

    def permit_shutdown(self) -> None:
        """Let the engine's own handlers run from now on (the drain is over)."""
        if self.directory is None or self.permitted:
            return
        with contextlib.suppress(OSError):
            (self.directory / PERMIT).touch()
        self.permitted = True

    def hold(self) -> None:
        """Take the permit back: from now on the engine's processes hold signals again
        until :meth:`permit_shutdown`. Raises OSError if the permit cannot be removed (the
        engine would still act on signals on its own)."""
        if self.directory is None:
            raise RuntimeError("claim() the signals before holding them")
        (self.directory / PERMIT).unlink(missing_ok=True)
        self.permitted = False

    def report(self, max_age_s: float = 0.0) -> GuardReport:
        """Every descendant process of this one, and whether each is protected; a report
        at most ``max_age_s`` old is reused (status pages ask often; this scans /proc)."""
        now = self._clock()
        if self._cached is not None and now - self._cached[0] <= max_age_s:
            return self._cached[1]
        try:
            children = descendants(os.getpid())
        except OSError as exc:
            return GuardReport((), f"{type(exc).__name__}: {exc}")
        markers, warnings = self._markers()
        report = GuardReport(tuple(_classify(pid, markers) for pid in children),
                             warnings=warnings)
        self._cached = (now, report)
        return report

    def _markers(self) -> tuple[dict[int, tuple[bool, str]], tuple[str, ...]]:
        """pid → ``(guarded, how)`` from each marker (one that cannot be read: not
        guarded, and why), and the warnings."""
        found: dict[int, tuple[bool, str]] = {}
        warnings: list[str] = []
        if self.directory is None:
            return found, ()
        with contextlib.suppress(OSError):
            for path in sorted(self.directory.iterdir()):
                if path.name.startswith(WARNING_PREFIX):
                    with contextlib.suppress(OSError):
                        warnings.append(path.read_text().strip())
                elif path.name.isdigit():
                    found[int(path.name)] = _read_marker(path)
        return found, tuple(warnings)

    def release(self) -> None:
        """Remove the directory (at exit). Engine processes still alive then are free
        to act on signals, as if permitted."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
            os.environ.pop(OWNER_ENV, None)


def _remove_stale_directories(base: Path) -> None:
    """Remove the directories of owners that are gone without :meth:`release` (a worker
    killed with SIGKILL cannot clean up): ``<prefix><pid>-*`` whose pid no longer exists."""
    with contextlib.suppress(OSError):
        for path in base.glob(f"{DIRECTORY_PREFIX}*-*"):
            pid = path.name[len(DIRECTORY_PREFIX):].partition("-")[0]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                log.info("removing %s: its owner (pid %s) is gone", path, pid)
                shutil.rmtree(path, ignore_errors=True)
            except PermissionError:
                continue


def _read_marker(path: Path) -> tuple[bool, str]:
    try:
        marker = json.loads(path.read_text())
        guarded, how = marker["guarded"], marker["how"]
        if isinstance(guarded, bool) and isinstance(how, str):
            return guarded, how
        problem = f"malformed guard marker {marker!r}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        problem = f"unreadable guard marker ({type(exc).__name__}: {exc})"
    return False, problem


def _classify(pid: int, markers: dict[int, tuple[bool, str]]) -> ProcessGuard:
    """What a signal would do to ``pid`` now: its marker, checked against the kernel's
    dispositions (``/proc/<pid>/status``)."""
    name = _read(pid, "comm").strip() or "?"
    if _ignores_signals(pid):
        return ProcessGuard(pid, name, True, "ignores signals")
    marker = markers.get(pid)
    if marker is not None:
        guarded, how = marker
        if not guarded:
            return ProcessGuard(pid, name, False, how)
        caught, ignored = _signal_mask(pid, "SigCgt"), _signal_mask(pid, "SigIgn")
        if caught is None or ignored is None:
            return ProcessGuard(pid, name, False, f"{how}, but its signal dispositions "
                                "cannot be read (/proc/<pid>/status)")
        lost = [sig.name for sig in GUARDED_SIGNALS
                if not (caught | ignored) >> (sig - 1) & 1]
        if lost:
            return ProcessGuard(pid, name, False, f"guard lost: {', '.join(lost)} back to "
                                "the default action below Python (the kernel no longer "
                                "calls a handler)")
        return ProcessGuard(pid, name, True, how)
    caught = _signal_mask(pid, "SigCgt")
    how = ("runs its own handler" if caught is not None and caught >> (signal.SIGTERM - 1) & 1
           else "dies of the signal")
    return ProcessGuard(pid, name, False, how)


def _ignores_signals(pid: int) -> bool:
    ignored = _signal_mask(pid, "SigIgn")
    return ignored is not None and all(ignored >> (sig - 1) & 1 for sig in GUARDED_SIGNALS)


def _read(pid: int, name: str) -> str:
    try:
        return (_PROC / str(pid) / name).read_text()
    except OSError:
        return ""


def _signal_mask(pid: int, field: str) -> int | None:
    for line in _read(pid, "status").splitlines():
        if line.startswith(field + ":"):
            return int(line.split(":", 1)[1].strip(), 16)
    return None


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from ``/proc``. Raises OSError
    where ``/proc`` cannot be read."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir(_PROC):
        if not entry.name.isdigit():
            continue
        stat = _read(int(entry.name), "stat")
        if not stat:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1:
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    frontier = [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found.extend(children)
        frontier.extend(children)
    return found


def kill_descendants() -> int:
    """SIGKILL every descendant of this process (the forced exit) but those that ignore
    SIGTERM and SIGINT by themselves: Python's resource tracker must outlive the engine to
    unlink the shared memory it leaves. Returns how many were killed."""
    try:
        victims = [pid for pid in descendants(os.getpid()) if not _ignores_signals(pid)]
    except OSError:
        return 0
    for pid in victims:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return len(victims)
