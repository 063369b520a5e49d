"""The signal guard, with real processes and real signals (Linux).

Each "engine process" here is a small Python child that installs a handler of its own,
as vLLM's EngineCore and model runner do, then calls :func:`guard_process`, as quiesce's
vLLM plugin does. The real vLLM processes are covered by
tests/integration/vllm/test_vllm_signals.py (and the GPU suite).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from quiesce.signal_guard import (
    OWNER_ENV,
    SignalOwnership,
    descendants,
    guard_process,
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(),
                                reason="the signal guard reads /proc (Linux only)")

ENGINE = """
import signal, sys, time
from quiesce.signal_guard import guard_process
MODE = sys.argv[1]
if MODE == "own":
    def handler(signum, frame):
        print("engine handler ran", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
elif MODE == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
if sys.argv[2] == "guard":
    print("guarded" if guard_process("test-engine") else "unguarded", flush=True)
else:
    print("ready", flush=True)
if MODE == "grandchild":
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
while True:
    time.sleep(0.02)
"""


def start_engine(mode: str, guard: bool = True) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen([sys.executable, "-c", ENGINE, mode, "guard" if guard else "no"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    first = process.stdout.readline().strip()
    return process, first


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


def test_guarded_process_ignores_signals_until_the_owner_permits(
        owner: SignalOwnership) -> None:
    engine, first = start_engine("own")
    try:
        assert first == "guarded"
        report = owner.report()
        (mine,) = [p for p in report.processes if p.pid == engine.pid]
        assert mine.protected and mine.how == "guarded (wraps handler)"
        assert report.protected is True
        for sig in (signal.SIGTERM, signal.SIGINT):
            engine.send_signal(sig)
        with pytest.raises(subprocess.TimeoutExpired):
            engine.wait(timeout=0.5)  # still alive: both signals were ignored
        owner.permit_shutdown()
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(timeout=10) == 7  # the engine's own handler ran
        out, err = engine.communicate(timeout=10)
        assert "engine handler ran" in out
        assert "ignores SIGTERM" in err and "ignores SIGINT" in err
    finally:
        stop(engine)


def test_permitted_default_action_still_kills(owner: SignalOwnership) -> None:
    engine, first = start_engine("default")
    try:
        assert first == "guarded"
        engine.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            engine.wait(timeout=0.5)
        owner.permit_shutdown()
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(timeout=10) == -signal.SIGTERM
    finally:
        stop(engine)


def test_a_permit_taken_back_holds_the_signals_again(owner: SignalOwnership) -> None:
    """vllm serve: the engine acts on signals while it starts (nothing is admitted yet),
    then holds them once the worker serves."""
    owner.permit_shutdown()
    engine, first = start_engine("own")
    try:
        assert first == "guarded"
        owner.hold()
        assert not owner.permitted
        engine.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            engine.wait(timeout=0.5)  # held back again
        owner.permit_shutdown()
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(timeout=10) == 7
    finally:
        stop(engine)


def test_holding_needs_a_claim() -> None:
    with pytest.raises(RuntimeError, match="claim"):
        SignalOwnership().hold()


def test_an_owner_that_is_gone_no_longer_holds_the_signals_back(
        owner: SignalOwnership) -> None:
    engine, first = start_engine("own")
    try:
        assert first == "guarded"
        owner.release()  # the owner's directory is gone: nobody would ever permit
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(timeout=10) == 7
    finally:
        stop(engine)


def test_without_an_owner_the_guard_changes_nothing() -> None:
    assert OWNER_ENV not in os.environ
    before = signal.getsignal(signal.SIGTERM)
    assert guard_process("no-owner") is False
    assert signal.getsignal(signal.SIGTERM) is before
    engine, first = start_engine("own")
    try:
        assert first == "unguarded"
        engine.send_signal(signal.SIGTERM)
        assert engine.wait(timeout=10) == 7
    finally:
        stop(engine)


def test_the_owner_itself_is_never_guarded(owner: SignalOwnership) -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert guard_process("owner") is False
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize(("mode", "protected", "how"), [
    ("ignore", True, "ignores signals"),
    ("own", False, "runs its own handler"),
    ("default", False, "dies of the signal"),
])
def test_report_tells_unguarded_processes_apart(owner: SignalOwnership, mode: str,
                                                protected: bool, how: str) -> None:
    engine, first = start_engine(mode, guard=False)
    try:
        assert first == "ready"
        report = owner.report()
        (mine,) = [p for p in report.processes if p.pid == engine.pid]
        assert (mine.protected, mine.how) == (protected, how)
        assert report.protected is protected
        if not protected:
            assert f"pid {engine.pid}" in report.summary()
            assert report.to_dict()["protected"] is False
    finally:
        stop(engine)


def test_descendants_include_grandchildren() -> None:
    engine, first = start_engine("grandchild", guard=False)
    grandchild = 0
    try:
        assert first == "ready"
        assert engine.stdout is not None
        grandchild = int(engine.stdout.readline())
        found = descendants(os.getpid())
        assert engine.pid in found and grandchild in found
        assert found.index(engine.pid) < found.index(grandchild)
    finally:
        if grandchild:
            os.kill(grandchild, signal.SIGKILL)
        stop(engine)


def test_a_claim_removes_directories_of_owners_killed_without_cleanup() -> None:
    """SIGKILL leaves the owner no chance to release its directory; the next worker to
    claim on the machine removes it, and never a live owner's."""
    owner_script = ("import time; from quiesce.signal_guard import SignalOwnership; "
                    "o = SignalOwnership(); o.claim(); print(o.directory, flush=True); "
                    "time.sleep(60)")
    killed = subprocess.Popen([sys.executable, "-c", owner_script], stdout=subprocess.PIPE,
                              text=True)
    alive = subprocess.Popen([sys.executable, "-c", owner_script], stdout=subprocess.PIPE,
                             text=True)
    ownership = SignalOwnership()
    alive_dir = None
    try:
        assert killed.stdout is not None and alive.stdout is not None
        killed_dir = Path(killed.stdout.readline().strip())
        alive_dir = Path(alive.stdout.readline().strip())
        killed.kill()
        killed.wait(timeout=10)
        assert killed_dir.is_dir() and str(killed.pid) in killed_dir.name
        ownership.claim()
        assert not killed_dir.exists()
        assert alive_dir.is_dir()
    finally:
        ownership.release()
        for process in (killed, alive):
            stop(process)
        if alive_dir is not None:
            shutil.rmtree(alive_dir, ignore_errors=True)
