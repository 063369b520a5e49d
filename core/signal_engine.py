"""The engine-process side of signal ownership (:mod:`quiesce.signal_guard` is the face).

:func:`guard_process` runs inside each engine process (called by an adapter's plugin)
and wraps its SIGTERM and SIGINT handlers, now and as they are installed later, so that
a signal is held back until the owner permits the shutdown; it keeps this process's
marker in the owner's directory true (a watcher thread re-checks it), which is what
:meth:`quiesce.signal_guard.SignalOwnership.report` reads. :func:`warn_owner` leaves a
warning for the owner's report. The constants are shared with the owner side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import threading
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

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None



# -- engine processes -----------------------------------------------------------------

WATCH_INTERVAL_S = 1.0
"""How often a guarded process re-checks that its handlers are still quiesce's."""
WARNING_PREFIX = "warning-"
_LOOP_HANDLER = "_sighandler_noop"
"""asyncio's ``loop.add_signal_handler`` installs this function; the loop acts on the
signal through its wakeup fd, whatever the Python-level handler does."""


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


class _Guard:
    """This process's guard: what it wraps, and its marker (see the module docstring)."""

    def __init__(self, owner: _Owner, name: str) -> None:
        self.owner = owner
        self.name = name
        self.pid = os.getpid()
        self.native: int | None = None
        """The kernel's handler address once guarded (Python's C handler), if readable."""
        self.written: tuple[bool, str] | None = None
        self.lock = threading.RLock()

    def state(self) -> tuple[bool, str]:
        """``(guarded, how)`` as of now: every guarded signal's Python handler is a
        :class:`_GuardedHandler` and the kernel still calls Python's C handler."""
        problems: list[str] = []
        for sig in GUARDED_SIGNALS:
            current = signal.getsignal(sig)
            if not isinstance(current, _GuardedHandler):
                why = (" (an asyncio loop handler: the loop acts on the signal through its "
                       "wakeup fd, which no wrapper holds back)"
                       if getattr(current, "__name__", "") == _LOOP_HANDLER
                       else " (installed past the guard)")
                problems.append(f"{sig.name} handler replaced by {_handler_name(current)}{why}")
                continue
            if getattr(current.previous, "__name__", "") == _LOOP_HANDLER:
                problems.append(f"{sig.name} handler wraps an asyncio loop handler (the "
                                "loop acts on the signal through its wakeup fd)")
                continue
            native = _native_handler(sig)
            if (native is not None and self.native is not None and native != self.native
                    and native != int(signal.SIG_IGN)):
                what = ("the default action" if native == int(signal.SIG_DFL)
                        else f"native code at {native:#x}")
                problems.append(f"{sig.name} handler replaced below Python by {what} "
                                "(sigaction)")
        if problems:
            return False, "guard lost: " + "; ".join(problems)
        wrapped = signal.getsignal(signal.SIGTERM)
        previous = wrapped.previous if isinstance(wrapped, _GuardedHandler) else wrapped
        return True, f"guarded (wraps {_handler_name(previous)})"

    def refresh(self) -> None:
        """Rewrite the marker if the state changed since it was last written (and say so
        on stderr when the guard is lost). Never raises."""
        with self.lock:
            try:
                state = self.state()
            except Exception as exc:  # fail closed: unknown is not guarded
                state = (False, f"guard state unreadable: {type(exc).__name__}: {exc}")
            if state == self.written:
                return
            if self.written is not None and not state[0]:
                with contextlib.suppress(OSError):
                    os.write(2, f"quiesce: {self.name} (pid {self.pid}) is no longer "
                                f"protected against SIGTERM/SIGINT: {state[1]}\n".encode())
            marker = json.dumps({"name": self.name, "guarded": state[0], "how": state[1]})
            path = self.owner.directory / str(self.pid)
            temporary = path.with_name(f".{self.pid}.tmp")
            with contextlib.suppress(OSError):  # the owner is gone: nothing to report to
                temporary.write_text(marker)
                os.replace(temporary, path)  # a reader never sees half a marker
                self.written = state

    def watch(self) -> None:
        """Start the watcher thread of this process (one per process)."""
        threading.Thread(target=self._watch, args=(self.pid,), name="quiesce-signal-watch",
                         daemon=True).start()

    def _watch(self, pid: int) -> None:
        while self.pid == pid:
            time.sleep(WATCH_INTERVAL_S)
            self.refresh()


_guard: list[_Guard] = []
"""This process's guard, once :func:`guard_process` ran (a list: no ``global``)."""


def guard_process(name: str) -> bool:
    """Wrap this process's SIGTERM/SIGINT handlers, and those installed later through
    ``signal.signal``, so that they run only with the owner's permit (module
    docstring); write the marker and start the watcher. Returns whether the process is
    now guarded.

    Call it in an engine process, from the main thread, before or after the engine
    installs its handlers. Idempotent (a later call renames the process). Does nothing
    (returns False) without :data:`OWNER_ENV`, in the owner itself, or off the main
    thread (the process is then reported unprotected).
    """
    owner = _Owner.from_env()
    if owner is None or owner.pid == os.getpid():
        return False
    guard = _guard[0] if _guard and _guard[0].pid == os.getpid() else None
    try:
        for sig in GUARDED_SIGNALS:
            current = signal.getsignal(sig)
            if not isinstance(current, _GuardedHandler):
                _install(sig, _GuardedHandler(sig, current, owner, name))
    except ValueError as exc:  # not the main thread
        log.warning("quiesce: cannot guard %s (pid %d) against signals: %s", name,
                    os.getpid(), exc)
        return False
    if guard is None:
        guard = _Guard(owner, name)
        guard.native = _native_handler(signal.SIGTERM)
        _guard[:] = [guard]
        _intercept_installs()
        guard.watch()
    guard.name = name
    guard.written = None
    guard.refresh()
    return guard.state()[0]


_original_signal: list[Callable[..., Handler]] = []


def _install(sig: signal.Signals, handler: Handler) -> Handler:
    """``signal.signal`` as it was before :func:`_intercept_installs`."""
    return (_original_signal or [signal.signal])[0](sig, handler)


def _intercept_installs() -> None:
    """From now on, in this process, ``signal.signal`` wraps what it installs for a
    guarded signal in a :class:`_GuardedHandler` (an asyncio loop handler excepted), and
    refreshes the marker; it returns the unwrapped previous handler."""
    if _original_signal:
        return
    original = signal.signal
    _original_signal.append(original)

    @functools.wraps(original)
    def intercepting(signalnum: int, handler: Handler) -> Handler:
        guard = _guard[0] if _guard and _guard[0].pid == os.getpid() else None
        guarded = guard is not None and signalnum in GUARDED_SIGNALS
        if (guard is not None and guarded and not isinstance(handler, _GuardedHandler)
                and getattr(handler, "__name__", "") != _LOOP_HANDLER):
            handler = _GuardedHandler(signal.Signals(signalnum), handler, guard.owner,
                                      guard.name)
        previous = original(signalnum, handler)
        if guard is not None and guarded:
            guard.refresh()
        return previous.previous if isinstance(previous, _GuardedHandler) else previous

    signal.signal = intercepting
    os.register_at_fork(after_in_child=_after_fork)


def _after_fork() -> None:
    """A forked child inherits the wrapped handlers: it is guarded too, with a marker
    and a watcher of its own."""
    if _guard:
        guard = _guard[0]
        guard.pid, guard.written, guard.lock = os.getpid(), None, threading.RLock()
        guard.refresh()
        guard.watch()


def _native_handler(sig: signal.Signals) -> int | None:
    """The handler address the kernel calls for ``sig`` (``sigaction``; 0 is the default
    action, 1 ignore), or None where it cannot be read."""
    try:
        import ctypes  # noqa: PLC0415 (only in engine processes)

        libc = ctypes.CDLL(None, use_errno=True)
        action = ctypes.create_string_buffer(512)  # larger than any struct sigaction
        if libc.sigaction(int(sig), None, action) != 0:
            return None
        return int(ctypes.c_void_p.from_buffer(action).value or 0)
    except Exception:
        return None


def warn_owner(key: str, text: str) -> bool:
    """Add ``text`` to the owner's report as a warning (it does not change whether the
    engine's processes are protected); from any process under a quiesce worker, the
    owner included. Returns False (and does nothing) without an owner."""
    owner = _Owner.from_env()
    if owner is None:
        return False
    with contextlib.suppress(OSError):
        (owner.directory / f"{WARNING_PREFIX}{key}").write_text(text)
        return True
    return False


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
            _install(signal.Signals(signum), signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        # SIG_IGN: ignored before, ignored now
