"""The signal guard's report is checked when it is read (Linux, real processes and signals).

Each "engine process" is a small Python child that calls :func:`guard_process` first,
then changes its handlers the ways real engines do: vLLM 0.31's EngineCore installs its
SIGTERM/SIGINT handlers *after* quiesce's plugin ran; SGLang's hf3fs HiCache backend
installs its own in the scheduler later still; other code goes around ``signal.signal``
(``_signal``, native ``signal()``), or installs an asyncio loop handler. The report must
follow each at read time: protected only while quiesce's wrapper is what would run.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from quiesce.signal_guard import (
    OWNER_ENV,
    GuardReport,
    ProcessGuard,
    SignalOwnership,
    warn_owner,
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(),
                                reason="the signal guard reads /proc (Linux only)")

ENGINE = r"""
import asyncio, ctypes, os, signal, sys, time
import _signal
from quiesce.signal_guard import guard_process

def handler(signum, frame):
    print("engine handler ran", flush=True)
    sys.exit(7)

print("guarded" if guard_process("late-engine") else "unguarded", flush=True)
action = sys.argv[1]
libc = ctypes.CDLL(None)
libc.signal.restype = ctypes.c_void_p
libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
NATIVE = ctypes.CFUNCTYPE(None, ctypes.c_int)(lambda signum: None)
if action == "late":  # vLLM 0.31's EngineCore, SGLang's hf3fs backend
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.signal(sig, handler)
    print(f"previous={previous!r}", flush=True)
elif action == "restore":  # save, install, restore: what the caller gets back
    previous = signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGTERM, previous)
    print(f"previous={previous!r}", flush=True)
elif action == "bypass":
    _signal.signal(signal.SIGTERM, handler)
    print("changed", flush=True)
elif action == "native-default":
    libc.signal(signal.SIGTERM, 0)
    print("changed", flush=True)
elif action == "native-handler":
    libc.signal(signal.SIGINT, ctypes.cast(NATIVE, ctypes.c_void_p).value)
    print("changed", flush=True)
elif action == "asyncio":
    loop = asyncio.new_event_loop()
    loop.add_signal_handler(signal.SIGTERM, print, "loop handler ran")
    print("changed", flush=True)
elif action == "fork":
    child = os.fork()
    if child == 0:
        while True:
            time.sleep(0.02)
    print(child, flush=True)
while True:
    time.sleep(0.02)
"""


@pytest.fixture
def engine() -> Iterator[Callable[[str], tuple[subprocess.Popen[str], list[str]]]]:
    started: list[subprocess.Popen[str]] = []

    def start(action: str) -> tuple[subprocess.Popen[str], list[str]]:
        process = subprocess.Popen([sys.executable, "-c", ENGINE, action],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout is not None
        lines = [process.stdout.readline().strip() for _ in range(2)]
        assert lines[0] == "guarded", lines
        return process, lines

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def entry(report: GuardReport, pid: int) -> ProcessGuard:
    (mine,) = [p for p in report.processes if p.pid == pid]
    return mine


def until(owner: SignalOwnership, pid: int,
          done: Callable[[ProcessGuard], bool]) -> ProcessGuard:
    """The process's entry once ``done`` holds (the watcher checks every second or so);
    the last entry seen if it never does within a minute."""
    deadline = time.monotonic() + 60
    while True:
        mine = entry(owner.report(), pid)
        if done(mine) or time.monotonic() > deadline:
            return mine
        time.sleep(0.05)


def test_handlers_installed_after_the_guard_are_guarded_too(
        owner: SignalOwnership, engine: Callable[..., tuple[subprocess.Popen[str], list[str]]]
) -> None:
    """vLLM 0.31: EngineCore installs its handlers after the plugin guarded the process."""
    process, lines = engine("late")
    assert lines[1] == "previous=<Handlers.SIG_DFL: 0>" or "default_int_handler" in lines[1]
    mine = entry(owner.report(), process.pid)
    assert (mine.protected, mine.how) == (True, "guarded (wraps handler)")
    for sig in (signal.SIGTERM, signal.SIGINT):
        process.send_signal(sig)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.5)  # alive: the late handlers were held back too
    owner.permit_shutdown()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 7  # the late handler runs once permitted
    out, err = process.communicate(timeout=10)
    assert "engine handler ran" in out
    assert "late-engine" in err and "ignores SIGTERM" in err and "ignores SIGINT" in err


def test_signal_signal_returns_the_unwrapped_previous_handler(
        owner: SignalOwnership, engine: Callable[..., tuple[subprocess.Popen[str], list[str]]]
) -> None:
    """Save-and-restore code gets the handler it replaced, not quiesce's wrapper, and
    restoring it keeps the guard."""
    process, lines = engine("restore")
    assert lines[1] == "previous=<Handlers.SIG_DFL: 0>", lines
    mine = entry(owner.report(), process.pid)
    assert (mine.protected, mine.how) == (True, "guarded (wraps SIG_DFL)")


@pytest.mark.parametrize(("action", "replaced"), [
    ("bypass", "SIGTERM handler replaced by handler (installed past the guard)"),
    ("asyncio", "SIGTERM handler replaced by _sighandler_noop (an asyncio loop handler"),
    ("native-handler", "SIGINT handler replaced below Python by native code"),
], ids=["_signal.signal", "loop.add_signal_handler", "native signal()"])
def test_a_guard_replaced_afterwards_is_reported_by_what_replaced_it(
        owner: SignalOwnership, engine: Callable[..., tuple[subprocess.Popen[str], list[str]]],
        action: str, replaced: str) -> None:
    process, lines = engine(action)
    assert lines[1] == "changed", lines
    mine = until(owner, process.pid, lambda p: not p.protected)
    assert mine.protected is False, mine
    assert mine.how.startswith("guard lost: ") and replaced in mine.how, mine
    report = owner.report()
    assert report.protected is False
    assert f"pid {process.pid}" in report.summary() and "guard lost" in report.summary()


def test_a_native_reset_to_the_default_action_is_seen_at_read_time(
        owner: SignalOwnership, engine: Callable[..., tuple[subprocess.Popen[str], list[str]]]
) -> None:
    """No watcher needed: the kernel's dispositions are read with the marker."""
    process, lines = engine("native-default")
    assert lines[1] == "changed", lines
    mine = entry(owner.report(), process.pid)
    assert mine.protected is False, mine
    assert "SIGTERM back to the default action" in mine.how, mine


def test_a_forked_child_of_a_guarded_process_is_guarded_and_reported(
        owner: SignalOwnership, engine: Callable[..., tuple[subprocess.Popen[str], list[str]]]
) -> None:
    process, lines = engine("fork")
    child = int(lines[1])
    try:
        mine = until(owner, child, lambda p: p.protected)
        assert (mine.protected, mine.how) == (True, "guarded (wraps SIG_DFL)"), mine
        os.kill(child, signal.SIGTERM)
        assert process.stderr is not None
        # the forked child's guard says it held the signal back (read with a deadline:
        # a failed guard must fail the test, not hang it)
        ready, _, _ = select.select([process.stderr], [], [], 60)
        assert ready, "the forked child said nothing"
        assert f"late-engine (pid {child}) ignores SIGTERM" in process.stderr.readline()
        os.kill(child, 0)  # and it is alive
    finally:
        os.kill(child, signal.SIGKILL)


def test_owner_warnings_are_reported_without_changing_protection(
        owner: SignalOwnership) -> None:
    assert warn_owner("test", "an engine setting SIGKILLs the process group") is True
    report = owner.report()
    assert report.warnings == ("an engine setting SIGKILLs the process group",)
    assert report.protected is True  # no engine process: nothing unprotected
    assert "WARNING: an engine setting SIGKILLs" in report.summary()
    assert report.to_dict()["warnings"] == list(report.warnings)


def test_without_an_owner_warnings_go_nowhere() -> None:
    assert OWNER_ENV not in os.environ
    assert warn_owner("test", "nobody reads this") is False


@pytest.mark.parametrize(("value", "warned"), [("1", True), ("True", True), ("yes", True),
                                               ("0", False), ("false", False), ("", False)])
def test_sglang_killpg_on_scheduler_exception_is_warned_about(
        owner: SignalOwnership, value: str, warned: bool) -> None:
    from quiesce.adapters.sglang.signals import KILLPG_ENV, warn_killpg

    text = warn_killpg({**os.environ, KILLPG_ENV: value})
    assert (text is not None) is warned
    assert owner.report().warnings == ((text,) if text else ())
    if text:
        assert f"worker (pid {os.getpid()}) included" in text


def test_sglang_killpg_outside_a_quiesce_worker_is_not_ours_to_warn_about() -> None:
    from quiesce.adapters.sglang.signals import KILLPG_ENV, warn_killpg

    assert OWNER_ENV not in os.environ
    assert warn_killpg({KILLPG_ENV: "1"}) is None
