"""Signal ownership: the worker, not the engine, owns SIGTERM and SIGINT.

A signal reaches a worker in several ways: the kubelet signals the main process only;
a terminal's Ctrl-C and init shims (``dumb-init``, ``tini -g``) signal the whole
process group; systemd (``KillMode=control-group``) and ``pkill`` signal every process.
An engine's own processes (vLLM's EngineCore and model runner, SGLang's scheduler)
install handlers that run a shutdown of their own, which aborts the very requests the
worker is draining. This module keeps them out of it.

Two sides, each a few functions:

- **owner** (the worker's main process), :class:`SignalOwnership`:

  * :meth:`~SignalOwnership.claim`, before the engine starts: makes a private
    directory and names it, with the owner's pid, in :data:`OWNER_ENV`, which every
    engine process inherits;
  * :meth:`~SignalOwnership.permit_shutdown`, right before the worker tells the engine
    to stop (its drain is over): from then on the engine's own handlers run again, so
    the engine's normal shutdown, which signals its processes, works as designed;
  * :meth:`~SignalOwnership.report`: which of the worker's processes are protected,
    read from ``/proc`` (costs one directory scan; call it at start-up and at the
    signal, not per request);
  * :func:`kill_descendants`: the forced exit (a second signal) takes the engine's
    processes with it, since they no longer die of the signals themselves.

- **engine processes**, :func:`guard_process`, called by an adapter's hook inside each
  engine process *after* the engine installed its own handlers (vLLM: quiesce's
  ``vllm.general_plugins`` entry point). It wraps the current SIGTERM and SIGINT
  handlers: while the owner has not permitted the shutdown, a signal is logged and
  ignored; once permitted, or once the owner is gone (its directory or its process
  no longer exists, so nobody would ever permit it), the engine's own handler runs.
  Each signal costs one ``stat`` and one ``kill(pid, 0)``; nothing runs otherwise.
  It writes a marker (``<pid>``, holding the process name) into the directory, which
  is how :meth:`SignalOwnership.report` knows the process is guarded.

Without :data:`OWNER_ENV` (an engine started outside a quiesce worker)
:func:`guard_process` does nothing: the engine behaves as it always did.

A process counts as protected when it is guarded, or when the kernel says it ignores
both signals (``SigIgn`` in ``/proc/<pid>/status``; Python's multiprocessing resource
tracker does). Anything else is reported unprotected by pid and name, never silently.
Linux only: elsewhere the report says it cannot tell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger("quiesce.signal_guard")

OWNER_ENV = "QUIESCE_SIGNAL_OWNER"
"""``<owner pid>:<directory>``, set by the owner for the engine processes it starts."""
PERMIT = "permit"
DIRECTORY_PREFIX = "quiesce-signals-"
"""The owner's directory is ``<prefix><owner pid>-<random>`` in /dev/shm (else the temp dir)."""
GUARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PROC = Path("/proc")

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


# -- engine processes -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Owner:
    pid: int
    directory: Path

    @classmethod
    def from_env(cls) -> _Owner | None:
        value = os.environ.get(OWNER_ENV, "")
        pid, sep, directory = value.partition(":")
        if not sep or not pid.isdigit() or not directory:
            return None
        return cls(int(pid), Path(directory))

    def permits(self) -> bool:
        """True once the owner permitted the shutdown, or is gone (nobody else would)."""
        if (self.directory / PERMIT).exists() or not self.directory.is_dir():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def guard_process(name: str) -> bool:
    """Wrap this process's SIGTERM/SIGINT handlers so that they run only with the owner's
    permit (see the module docstring). Returns whether the process is now guarded.

    Call it in an engine process after the engine installed its handlers, from the main
    thread. Idempotent. Does nothing (returns False) without :data:`OWNER_ENV`, in the
    owner itself, or off the main thread (the process is then reported unprotected).
    """
    owner = _Owner.from_env()
    if owner is None or owner.pid == os.getpid():
        return False
    try:
        for sig in GUARDED_SIGNALS:
            current = signal.getsignal(sig)
            if not isinstance(current, _GuardedHandler):
                signal.signal(sig, _GuardedHandler(sig, current, owner, name))
    except ValueError as exc:  # not the main thread
        log.warning("quiesce: cannot guard %s (pid %d) against signals: %s", name,
                    os.getpid(), exc)
        return False
    wrapped = signal.getsignal(signal.SIGTERM)
    previous = wrapped.previous if isinstance(wrapped, _GuardedHandler) else wrapped
    with contextlib.suppress(OSError):  # the owner is gone: nothing to report to
        (owner.directory / str(os.getpid())).write_text(f"{name}\n{_handler_name(previous)}")
    return True


def _handler_name(handler: Handler) -> str:
    """What a handler is, for the report: the engine's function, or the default action."""
    if isinstance(handler, signal.Handlers):
        return handler.name
    return str(getattr(handler, "__qualname__", None) or handler)


class _GuardedHandler:
    """A signal handler that defers to ``previous`` only with the owner's permit."""

    def __init__(self, sig: signal.Signals, previous: Handler, owner: _Owner,
                 name: str) -> None:
        self.sig = sig
        self.previous = previous
        self.owner = owner
        self.name = name

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.owner.permits():
            # os.write, not logging: a handler may interrupt a write to the same stream
            with contextlib.suppress(OSError):
                os.write(2, f"quiesce: {self.name} (pid {os.getpid()}) ignores "
                            f"{self.sig.name}: worker pid {self.owner.pid} owns the shutdown "
                            f"and drains first\n".encode())
            return
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):  # the default action: die of the signal
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        # SIG_IGN: ignored before, ignored now


# -- the owner ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProcessGuard:
    """One process of the worker, as :meth:`SignalOwnership.report` sees it."""

    pid: int
    name: str
    protected: bool
    how: str
    """``guarded (wraps <the engine's handler>)`` by :func:`guard_process`, ``ignores
    signals`` (by itself), or why it is not protected."""

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class GuardReport:
    """Whether a group or every-process signal would reach an engine process as its own."""

    processes: tuple[ProcessGuard, ...]
    error: str | None = None
    """Why the processes could not be listed (not Linux, /proc unreadable); None if they were."""

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
        if self.error is not None:
            return f"cannot tell whether engine processes are protected: {self.error}"
        if not self.processes:
            return "no engine processes"
        if self.protected:
            return f"all {len(self.processes)} engine process(es) protected"
        names = ", ".join(f"{p.name} (pid {p.pid}: {p.how})" for p in self.unprotected)
        return (f"{len(self.unprotected)} of {len(self.processes)} engine process(es) would "
                f"run a shutdown of their own on SIGTERM/SIGINT: {names}")

    def to_dict(self) -> dict[str, object]:
        return {"protected": self.protected, "summary": self.summary(), "error": self.error,
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
        guarded = self._guarded()
        report = GuardReport(tuple(_classify(pid, guarded) for pid in children))
        self._cached = (now, report)
        return report

    def _guarded(self) -> dict[int, str]:
        """pid → the handler each guarded process wraps (from its marker)."""
        found: dict[int, str] = {}
        if self.directory is None:
            return found
        with contextlib.suppress(OSError):
            for marker in self.directory.iterdir():
                if marker.name.isdigit():
                    _, _, wraps = marker.read_text().partition("\n")
                    found[int(marker.name)] = wraps or "?"
        return found

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


def _classify(pid: int, guarded: dict[int, str]) -> ProcessGuard:
    name = _read(pid, "comm").strip() or "?"
    if pid in guarded:
        return ProcessGuard(pid, name, True, f"guarded (wraps {guarded[pid]})")
    if _ignores_signals(pid):
        return ProcessGuard(pid, name, True, "ignores signals")
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
