"""Ending a vLLM worker's processes promptly (``quiesce.adapters.vllm.exit``), without vLLM.

:func:`end_process` calls ``os._exit``, so every case that may reach it runs in a child
Python (``sys.executable -c``) and the test reads its exit code and output. Each child
prints ``returned`` (or similar) after the call under test and then exits with a code of
its own, so "the process was ended" and "the normal exit followed" are told apart; a
module-level object whose ``__del__`` prints ``teardown`` tells whether the interpreter's
own teardown ran (it runs on a normal exit, not after ``os._exit``).

:func:`install_engine_exit` finds vLLM's classes by importing
``vllm.v1.engine.core.EngineCore`` and ``vllm.v1.executor.multiproc_executor``
(``WorkerProc``, ``MultiprocExecutor``) and takes no classes as arguments, so the child
puts small stand-in modules under those names in ``sys.modules`` before calling it. What
that cannot cover (vLLM's real classes, its real shutdown order and shared-memory queues)
is covered where vLLM is installed: tests/integration/vllm/ and the GPU suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from quiesce.adapters.vllm import exit as vllm_exit
from quiesce.signal_guard import OWNER_ENV, PERMIT

TEARDOWN = """
import os

class _Teardown:
    def __del__(self, write=os.write):
        write(1, b"teardown\\n")

_teardown = _Teardown()
"""
"""Prints ``teardown`` when the interpreter clears ``__main__``, i.e. on a normal exit."""


def run_child(body: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``body`` (after :data:`TEARDOWN`) in a child Python; stdout is a pipe, so the
    child's stdout is block-buffered, as a worker's is when its output is collected
    (``PYTHONUNBUFFERED``, if set here, is left out so that it is)."""
    child_env = {k: v for k, v in os.environ.items()
                 if k not in (OWNER_ENV, "PYTHONUNBUFFERED")}
    child_env.update(env or {})
    return subprocess.run([sys.executable, "-c", TEARDOWN + textwrap.dedent(body)],
                          capture_output=True, text=True, env=child_env, timeout=120,
                          check=False)


# -- end_process --------------------------------------------------------------------------


def test_end_process_runs_atexit_flushes_and_exits_with_the_code() -> None:
    result = run_child("""
        import atexit, io, sys, weakref
        from quiesce.adapters.vllm.exit import end_process

        # Python's own stderr writes through; a block-buffered one, as a logging setup
        # might install, must arrive too (logging's own atexit handler flushes it also).
        sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)))

        class Resource:
            pass

        resource = Resource()
        weakref.finalize(resource, print, "finalizer ran")
        atexit.register(print, "atexit ran")
        print("buffered before the end")          # no flush: still in the buffer
        sys.stderr.write("stderr, still buffered")
        end_process(23)
        print("returned")
        sys.exit(9)
    """)
    assert result.returncode == 23, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "buffered before the end"
    assert "atexit ran" in lines
    assert "finalizer ran" in lines
    assert "returned" not in lines
    assert "teardown" not in lines  # the interpreter's own teardown was skipped
    assert result.stderr == "stderr, still buffered"


def test_end_process_refuses_while_a_non_daemon_thread_runs() -> None:
    result = run_child("""
        import sys, threading
        from quiesce.adapters.vllm.exit import end_process

        release = threading.Event()
        worker = threading.Thread(target=release.wait, name="busy-worker")
        worker.start()
        print("while running:", end_process(5), flush=True)
        release.set()
        worker.join()
        end_process(6)
        print("returned")
        sys.exit(9)
    """)
    assert result.returncode == 6, result.stderr
    lines = result.stdout.splitlines()
    assert "while running: False" in lines
    assert "returned" not in lines


def test_end_process_ignores_daemon_threads() -> None:
    result = run_child("""
        import sys, threading
        from quiesce.adapters.vllm.exit import end_process

        threading.Thread(target=threading.Event().wait, daemon=True).start()
        end_process(4)
        print("returned")
        sys.exit(9)
    """)
    assert result.returncode == 4, result.stderr
    assert "returned" not in result.stdout.splitlines()


def test_refused_end_process_leaves_the_normal_exit() -> None:
    result = run_child("""
        import atexit, threading
        from quiesce.adapters.vllm.exit import end_process

        atexit.register(print, "atexit ran")
        release = threading.Event()
        threading.Thread(target=release.wait).start()
        print("result:", end_process(5))
        release.set()
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "result: False" in lines
    # Nothing was run early: atexit ran once, at the normal exit, followed by teardown.
    assert lines.count("atexit ran") == 1
    assert "teardown" in lines


def test_end_process_refuses_until_its_shared_memory_is_unlinked() -> None:
    result = run_child("""
        import sys
        from multiprocessing import shared_memory
        from quiesce.adapters.vllm.exit import end_process, track_shared_memory

        track_shared_memory()
        track_shared_memory()  # idempotent
        segment = shared_memory.SharedMemory(create=True, size=64)
        print("while owned:", end_process(5), flush=True)
        segment.close()
        print("while closed, not unlinked:", end_process(5), flush=True)
        segment.unlink()
        end_process(7)
        print("returned")
        sys.exit(9)
    """)
    assert result.returncode == 7, result.stderr
    lines = result.stdout.splitlines()
    assert "while owned: False" in lines
    assert "while closed, not unlinked: False" in lines
    assert "returned" not in lines


# -- install_engine_exit ------------------------------------------------------------------


def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> tuple[type, type]:
    """Stand-in modules for the vLLM names install_engine_exit imports, in this process."""

    class EngineCore:
        def shutdown(self) -> None:
            pass

    class WorkerProc:
        def shutdown(self) -> None:
            pass

    class MultiprocExecutor:
        @staticmethod
        def _ensure_worker_termination(worker_procs: list[object]) -> None:
            pass

    core = types.ModuleType("vllm.v1.engine.core")
    core.EngineCore = EngineCore  # type: ignore[attr-defined]
    executor = types.ModuleType("vllm.v1.executor.multiproc_executor")
    executor.WorkerProc = WorkerProc  # type: ignore[attr-defined]
    executor.MultiprocExecutor = MultiprocExecutor  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.v1", "vllm.v1.engine", "vllm.v1.executor"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, core.__name__, core)
    monkeypatch.setitem(sys.modules, executor.__name__, executor)
    return EngineCore, WorkerProc


@pytest.mark.parametrize("owner", [None, "own pid", "malformed"])
def test_install_engine_exit_does_nothing_outside_a_quiesce_workers_engine(
        owner: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    engine_core, worker_proc = fake_vllm(monkeypatch)
    engine_shutdown = vars(engine_core)["shutdown"]
    worker_shutdown = vars(worker_proc)["shutdown"]
    register = resource_tracker.register
    if owner is None:
        monkeypatch.delenv(OWNER_ENV, raising=False)
    elif owner == "own pid":  # the worker's own process (the frontend)
        monkeypatch.setenv(OWNER_ENV, f"{os.getpid()}:{tmp_path}")
    else:
        monkeypatch.setenv(OWNER_ENV, str(tmp_path))
    (tmp_path / PERMIT).touch()

    assert vllm_exit.install_engine_exit() is False
    assert vars(engine_core)["shutdown"] is engine_shutdown
    assert vars(worker_proc)["shutdown"] is worker_shutdown
    assert resource_tracker.register is register


def test_install_engine_exit_without_vllm_v1(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.setenv(OWNER_ENV, f"{os.getppid()}:{tmp_path}")
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", None)  # import raises ImportError
    register = resource_tracker.register

    assert vllm_exit.install_engine_exit() is False
    assert resource_tracker.register is register


ENGINE = """
import os, sys, types
from quiesce.adapters.vllm.exit import install_engine_exit

def module(name):
    created = types.ModuleType(name)
    sys.modules[name] = created
    return created

for name in ("vllm", "vllm.v1", "vllm.v1.engine", "vllm.v1.executor"):
    module(name)
core = module("vllm.v1.engine.core")
executor = module("vllm.v1.executor.multiproc_executor")
envs = module("vllm.envs")
envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS = 60
sys.modules["vllm"].envs = envs

class EngineCore:
    def shutdown(self):
        print("EngineCore.shutdown", flush=True)

class EngineCoreProc(EngineCore):
    def shutdown(self):
        super().shutdown()
        print("EngineCoreProc.shutdown", flush=True)

class FailingEngineCore(EngineCore):
    def shutdown(self):
        super().shutdown()
        raise RuntimeError("teardown failed")

class WorkerProc:
    def shutdown(self):
        print("WorkerProc.shutdown", flush=True)

class MultiprocExecutor:
    @staticmethod
    def _ensure_worker_termination(worker_procs):
        print("alive when vLLM's wait began:", [p.is_alive() for p in worker_procs],
              flush=True)

core.EngineCore = EngineCore
executor.WorkerProc = WorkerProc
executor.MultiprocExecutor = MultiprocExecutor
original = EngineCore.__dict__["shutdown"]
print("installed:", install_engine_exit(), install_engine_exit(), flush=True)
print("wrapped once:", EngineCore.__dict__["shutdown"].__wrapped__ is original, flush=True)
"""
"""A child engine process with stand-ins for vLLM's classes, then install_engine_exit."""


def run_engine(body: str, owner_dir: Path, permitted: bool) -> subprocess.CompletedProcess[str]:
    if permitted:
        (owner_dir / PERMIT).touch()
    return run_child(ENGINE + textwrap.dedent(body),
                     env={OWNER_ENV: f"{os.getpid()}:{owner_dir}"})


def test_installed_once_in_a_quiesce_workers_engine(tmp_path: Path) -> None:
    result = run_engine("", tmp_path, permitted=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "installed: True True" in lines
    assert "wrapped once: True" in lines


@pytest.mark.parametrize("call", ["EngineCore().shutdown()", "EngineCoreProc().shutdown()",
                                  "WorkerProc().shutdown()"])
def test_permitted_clean_shutdown_ends_the_process(call: str, tmp_path: Path) -> None:
    result = run_engine(f"""
        {call}
        print("returned")
        sys.exit(9)
    """, tmp_path, permitted=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "returned" not in lines
    assert "teardown" not in lines


def test_only_the_outermost_shutdown_ends_the_process(tmp_path: Path) -> None:
    result = run_engine("""
        EngineCoreProc().shutdown()
        sys.exit(9)
    """, tmp_path, permitted=True)
    assert result.returncode == 0, result.stderr
    # The subclass's own teardown, after the base class's, still ran.
    assert result.stdout.splitlines()[2:] == ["EngineCore.shutdown", "EngineCoreProc.shutdown"]


@pytest.mark.parametrize("call", ["EngineCoreProc().shutdown()", "WorkerProc().shutdown()"])
def test_without_the_permit_nothing_changes(call: str, tmp_path: Path) -> None:
    result = run_engine(f"""
        {call}
        print("returned")
        sys.exit(9)
    """, tmp_path, permitted=False)
    assert result.returncode == 9, result.stderr
    lines = result.stdout.splitlines()
    assert "returned" in lines
    assert "teardown" in lines


def test_shutdown_during_an_exception_lets_it_propagate(tmp_path: Path) -> None:
    result = run_engine("""
        try:
            raise RuntimeError("engine failed")
        finally:
            EngineCoreProc().shutdown()
            print("returned", flush=True)
    """, tmp_path, permitted=True)
    assert result.returncode == 1
    assert "returned" in result.stdout.splitlines()
    assert "RuntimeError: engine failed" in result.stderr


def test_a_failing_shutdown_raises_as_before(tmp_path: Path) -> None:
    result = run_engine("""
        try:
            FailingEngineCore().shutdown()
        except RuntimeError as exc:
            print("caught:", exc)
        sys.exit(9)
    """, tmp_path, permitted=True)
    assert result.returncode == 9, result.stderr
    assert "caught: teardown failed" in result.stdout.splitlines()


@pytest.mark.parametrize(("code", "ends"), [(0, True), (None, True), (3, False)])
def test_shutdown_while_system_exit_is_on_its_way(code: int | None, ends: bool,
                                                  tmp_path: Path) -> None:
    result = run_engine(f"""
        try:
            raise SystemExit({code})
        finally:
            WorkerProc().shutdown()
            print("returned", flush=True)
    """, tmp_path, permitted=True)
    assert result.returncode == (code or 0), result.stderr
    assert ("returned" not in result.stdout.splitlines()) is ends


def test_permitted_shutdown_refused_while_a_non_daemon_thread_runs(tmp_path: Path) -> None:
    result = run_engine("""
        import threading
        release = threading.Event()
        threading.Thread(target=release.wait).start()
        EngineCore().shutdown()
        print("returned", flush=True)
        release.set()
        sys.exit(9)
    """, tmp_path, permitted=True)
    assert result.returncode == 9, result.stderr
    assert "returned" in result.stdout.splitlines()


def test_engine_process_tracks_its_shared_memory(tmp_path: Path) -> None:
    result = run_engine("""
        from multiprocessing import shared_memory
        segment = shared_memory.SharedMemory(create=True, size=64)
        EngineCore().shutdown()
        print("returned with the segment", flush=True)
        segment.close()
        segment.unlink()
        EngineCore().shutdown()
        print("returned")
        sys.exit(9)
    """, tmp_path, permitted=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "returned with the segment" in lines
    assert "returned" not in lines


def test_permitted_wait_for_model_runners_returns_once_they_exit(tmp_path: Path) -> None:
    result = run_engine("""
        import multiprocessing, time
        runner = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.2,))
        runner.start()
        MultiprocExecutor._ensure_worker_termination([runner])
        sys.exit(9)
    """, tmp_path, permitted=True)
    assert result.returncode == 9, result.stderr
    assert "alive when vLLM's wait began: [False]" in result.stdout.splitlines()


def test_unpermitted_wait_for_model_runners_is_vllms_own(tmp_path: Path) -> None:
    result = run_engine("""
        import multiprocessing
        context = multiprocessing.get_context("fork")
        release = context.Event()
        runner = context.Process(target=release.wait)
        runner.start()
        MultiprocExecutor._ensure_worker_termination([runner])
        release.set()
        runner.join()
        sys.exit(9)
    """, tmp_path, permitted=False)
    assert result.returncode == 9, result.stderr
    assert "alive when vLLM's wait began: [True]" in result.stdout.splitlines()
