"""The signal guard of vLLM's DP coordinator process (data parallel).

The coordinator loads no plugins, so :func:`.plugin.register` cannot guard it there:
:func:`guard_coordinator`, called in every frontend, replaces
``DPCoordinatorProc.run_coordinator`` with :func:`run_coordinator_guarded`, which
guards the process (:func:`quiesce.signal_guard.guard_process`) before it runs vLLM's own.
"""

from __future__ import annotations

from typing import Any

from quiesce.signal_guard import guard_process

COORDINATOR_NAME = "DPCoordinator"


def run_coordinator_guarded(*args: Any, **kwargs: Any) -> Any:
    """vLLM's ``DPCoordinatorProc.run_coordinator``, guarded first (see :func:`guard_coordinator`).

    Module-level so that a spawned coordinator unpickles it by name (and finds vLLM's
    own function on the class, since nothing replaced it there); a forked one finds the
    original where :func:`guard_coordinator` kept it."""
    from vllm.v1.engine.coordinator import DPCoordinatorProc  # noqa: PLC0415

    guard_process(COORDINATOR_NAME)
    original = getattr(DPCoordinatorProc, _ORIGINAL_COORDINATOR, None)
    run = original if original is not None else DPCoordinatorProc.run_coordinator
    if run is run_coordinator_guarded:  # never: the original is kept where it is replaced
        raise RuntimeError("DPCoordinatorProc.run_coordinator is quiesce's own wrapper")
    return run(*args, **kwargs)


_ORIGINAL_COORDINATOR = "_quiesce_original_run_coordinator"


def guard_coordinator() -> bool:
    """Make vLLM's DP coordinator process (data parallel) guard itself first thing: it
    loads no plugins, so nothing else would. Returns whether it is (or already was) set
    up; False without DP support. Set up in every frontend, whether a quiesce worker owns
    the signals yet or not: the coordinator decides when it starts (``guard_process``
    does nothing without the owner's variable), so a frontend that loaded the plugins
    before its worker claimed the signals still gets a guarded coordinator.

    Unguarded, SIGTERM kills the coordinator and SIGINT ends it (``KeyboardInterrupt``);
    it then neither publishes the engines' load to the frontend nor starts their request
    waves (a MoE model's DP ranks step in lock step and wait for it). That this cannot
    lose a request was not established, so it is guarded rather than trusted; once the
    worker permits the shutdown, vLLM's own SIGTERM ends it as before.
    """
    try:
        from vllm.v1.engine.coordinator import DPCoordinatorProc  # noqa: PLC0415
    except ImportError:
        return False
    current = DPCoordinatorProc.__dict__.get("run_coordinator")
    function = getattr(current, "__func__", None)
    if function is run_coordinator_guarded:
        return True
    if function is None:  # not the staticmethod this was checked on (0.31, 0.32)
        return False
    setattr(DPCoordinatorProc, _ORIGINAL_COORDINATOR, function)
    DPCoordinatorProc.run_coordinator = staticmethod(run_coordinator_guarded)
    return True
