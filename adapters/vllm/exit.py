"""Ending a vLLM worker's processes promptly once the engine is shut down.

Why (measured on vLLM 0.32, CPU build, ``quiesce serve --engine vllm``; ``bench/shutdown/``):
the worker has three Python processes, the frontend (``AsyncLLM``), EngineCore and its
model runner (``VllmWorker-0``), and each has imported ~5,500 modules (torch, vLLM,
transformers). After a process's own cleanup, a normal interpreter exit clears every
module and runs the cyclic garbage collector over ~650k objects: 1.3-1.6 s per process
on this machine, with nothing left to release by then. The three exits run one after
another (EngineCore waits for its model runner in ``MultiprocExecutor.shutdown``, the
frontend joins EngineCore in ``AsyncLLM.shutdown``), so teardown alone was ~4.3 s of
the 5.5 s from "drained" to "process gone". A late module teardown is also where
``AsyncLLM.__del__`` runs after ``vllm.v1.engine.async_llm``'s globals were cleared
(``TypeError: 'NoneType' object is not callable``), and where a collected
``ShmRingBuffer.__del__`` unlinks its segment too late to tell the resource tracker.
Freezing the heap instead (what vLLM's EngineCore does on ROCm) is not enough here:
triton's nanobind extension then reports its objects as leaked at exit.

So, once nothing is left to do, a process ends the way ``multiprocessing`` ends a child
on error paths, but only after everything a normal exit does that others can observe:
:func:`end_process` runs the ``atexit`` handlers (``multiprocessing``'s finalizers, which
unregister its semaphores; ``weakref.finalize`` callbacks; ``logging.shutdown``), flushes
stdout and stderr and calls ``os._exit``. It refuses (returns ``False``, and the normal
exit follows) while another non-daemon thread runs (a normal exit would wait for it) or
while this process still owns a shared-memory segment it created (its finalizer has not
run yet: only the normal exit would unlink it).

- The frontend: the worker's entry point calls :func:`end_process` with its exit code
  after the event loop is closed (``quiesce serve``; the engine was shut down by
  :meth:`.control.VllmEngineControl.shutdown`).
- EngineCore and the model runner: quiesce's vLLM plugin calls
  :func:`install_engine_exit` in every process vLLM starts. In a process started by a
  quiesce worker (:data:`quiesce.signal_guard.OWNER_ENV`), it wraps
  ``EngineCore.shutdown`` (and the overrides of its subclasses) and
  ``WorkerProc.shutdown``: when vLLM's own teardown of that process has returned on its
  clean path (no exception other than a ``SystemExit`` with code 0 on its way), and the
  worker has permitted the shutdown (its drain is over,
  :meth:`quiesce.signal_guard.SignalOwnership.permit_shutdown`), the process ends with
  :func:`end_process` ``(0)``: the exit code vLLM's own clean path gives it. Without the
  permit (an engine failure, a shutdown quiesce did not start), nothing changes.
- With the same permit, EngineCore's wait for its model runners
  (``MultiprocExecutor._ensure_worker_termination``, which polls them every 0.1 s for up
  to ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``) first waits on their process sentinels for
  that long, so it returns when the last one exits rather than at the next poll; vLLM's
  own wait (and its SIGTERM, then SIGKILL, of a model runner still alive) follows
  unchanged.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Callable, Sized
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from quiesce.signal_guard import OWNER_ENV, PERMIT

log = logging.getLogger("quiesce.adapters.vllm.exit")

_WRAPPED = "_quiesce_ends_process"
"""Marks a ``shutdown`` this module wrapped (so that installing twice wraps once)."""


class _Segments:
    owned: set[str] | None = None
    """Names of the shared-memory segments this process created and has not unlinked,
    once :func:`track_shared_memory` ran; ``None`` before."""


def track_shared_memory() -> None:
    """Keep count of the shared-memory segments this process creates and unlinks, so that
    :func:`end_process` can tell whether one is still waiting for its finalizer.

    It watches what ``multiprocessing.shared_memory`` tells the resource tracker (a
    segment is registered when created, unregistered when unlinked). Call it before the
    segments are made (vLLM loads its plugins before it builds its message queues).
    Idempotent.
    """
    if _Segments.owned is not None:
        return
    owned: set[str] = set()
    register, unregister = resource_tracker.register, resource_tracker.unregister

    def tracked_register(name: Sized, rtype: str) -> None:
        if rtype == "shared_memory":
            owned.add(str(name))
        register(name, rtype)

    def tracked_unregister(name: Sized, rtype: str) -> None:
        if rtype == "shared_memory":
            owned.discard(str(name))
        unregister(name, rtype)

    resource_tracker.register = tracked_register
    resource_tracker.unregister = tracked_unregister
    _Segments.owned = owned


def _why_not_now() -> str | None:
    """Why this process may not skip its interpreter teardown now; None if it may."""
    if threading.current_thread() is not threading.main_thread():
        return "not on the main thread"
    others = [t.name for t in threading.enumerate()
              if not t.daemon and t is not threading.main_thread() and t.is_alive()]
    if others:
        return f"non-daemon thread(s) still running: {', '.join(others)}"
    if _Segments.owned:
        return f"shared memory not unlinked yet: {', '.join(sorted(_Segments.owned))}"
    return None


def end_process(code: int) -> bool:
    """End this process now with ``code``: ``atexit`` handlers, flush, ``os._exit``.

    Skips only the interpreter's own teardown (module clearing, final garbage
    collections). Returns ``False``, having done nothing, when that would skip more than
    that (see the module docstring); the caller then exits normally. Never returns
    otherwise.
    """
    why = _why_not_now()
    if why is not None:
        log.debug("normal interpreter exit: %s", why)
        return False
    atexit._run_exitfuncs()  # what a normal exit runs first; each handler runs once
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.flush()
    os._exit(code)


# -- inside vLLM's engine processes -------------------------------------------------------


def _owner_permitted() -> bool | None:
    """None outside a process started by a quiesce worker (or in the worker itself);
    else whether the worker permitted the engine's shutdown."""
    pid, sep, directory = os.environ.get(OWNER_ENV, "").partition(":")
    if not sep or not pid.isdigit() or int(pid) == os.getpid() or not directory:
        return None
    return (Path(directory) / PERMIT).exists()


def _clean_path() -> bool:
    """Whether the code calling ``shutdown`` is on vLLM's clean path: no exception on its
    way, or ``SystemExit`` with code 0 (how EngineCore's busy loop and a signalled model
    runner leave)."""
    exc = sys.exc_info()[1]
    return exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0))


def _ending_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        # Only the outermost shutdown of the instance ends the process (a subclass's
        # override runs its own teardown after the base class's).
        if getattr(type(self), "shutdown", None) is shutdown and _clean_path() \
                and _owner_permitted():
            end_process(0)
        return result

    setattr(shutdown, _WRAPPED, True)
    return shutdown


def _wrap_shutdown(cls: type) -> None:
    original = cls.__dict__.get("shutdown")
    if callable(original) and not getattr(original, _WRAPPED, False):
        type.__setattr__(cls, "shutdown", _ending_shutdown(original))


def _with_subclasses(cls: type) -> list[type]:
    found: list[type] = [cls]
    frontier: list[type] = [cls]
    while frontier:
        sub: type
        for sub in frontier.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                frontier.append(sub)
    return found


def _prompt_wait(original: Callable[[list[Any]], None]) -> Callable[[list[Any]], None]:
    def ensure_worker_termination(worker_procs: list[Any]) -> None:
        if _owner_permitted():
            from vllm import envs  # noqa: PLC0415 (vLLM is optional)

            deadline = time.monotonic() + float(envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS)
            while (alive := [p.sentinel for p in worker_procs if p.is_alive()]) \
                    and (left := deadline - time.monotonic()) > 0:
                multiprocessing.connection.wait(alive, timeout=left)
        original(worker_procs)

    setattr(ensure_worker_termination, _WRAPPED, True)
    return ensure_worker_termination


def install_engine_exit() -> bool:
    """In a vLLM engine process started by a quiesce worker, end the process as soon as
    vLLM's own teardown of it returned (see the module docstring). Returns whether it
    was installed: not outside a quiesce worker's engine processes, and not with a vLLM
    without the V1 engine. Idempotent; call it from quiesce's vLLM plugin."""
    if _owner_permitted() is None:
        return False
    try:
        from vllm.v1.engine.core import EngineCore  # noqa: PLC0415 (vLLM is optional)
        from vllm.v1.executor.multiproc_executor import (  # noqa: PLC0415
            MultiprocExecutor,
            WorkerProc,
        )
    except ImportError:
        return False
    track_shared_memory()
    for cls in (*_with_subclasses(EngineCore), WorkerProc):
        _wrap_shutdown(cls)
    wait = MultiprocExecutor.__dict__.get("_ensure_worker_termination")
    if isinstance(wait, staticmethod) and not getattr(wait.__func__, _WRAPPED, False):
        MultiprocExecutor._ensure_worker_termination = staticmethod(_prompt_wait(wait.__func__))
    return True
