"""quiesce's vLLM plugin: the entry point that vLLM calls in every process it starts.

Registered on the ``vllm.general_plugins`` entry point, so vLLM calls :func:`register`
in every process it starts (frontend, EngineCore, workers). :func:`register` guards the
process's SIGTERM/SIGINT handlers, makes the DP coordinator guard itself
(:mod:`.coordinator`), attaches two utility methods to ``EngineCore``
(:mod:`.utilities`: ``quiesce_snapshot`` and ``quiesce_subscribe``, which starts the
board publisher of :mod:`.publisher` with the drain ETA of :mod:`.eta`) and installs the
engine's exit (:mod:`.exit`).

Inert until subscribed (or snapshot once): :func:`register` adds methods and nothing runs
per step. Imports nothing from vLLM at import time, and from quiesce's core only the
standard library signal guard.
"""

from __future__ import annotations

import multiprocessing

from quiesce.signal_guard import guard_process

from .coordinator import guard_coordinator
from .exit import install_engine_exit
from .utilities import SNAPSHOT_METHOD, SUBSCRIBE_METHOD, quiesce_snapshot, quiesce_subscribe


def register() -> None:
    """Entry point of ``vllm.general_plugins``: guard this process's signal handlers and
    attach the utilities to EngineCore.

    vLLM loads general plugins in every process it starts: the frontend (process 0),
    EngineCore's constructor and each model runner's. :func:`quiesce.signal_guard.
    guard_process` guards whatever SIGTERM/SIGINT handler the process has then *and*
    those installed later: on 0.32, ``run_engine_core`` and ``WorkerProc.worker_main``
    install vLLM's handlers before the plugins load; on 0.31, ``run_engine_core``
    installs EngineCore's after (when the constructor returns): either way EngineCore's
    handler runs only with the worker's permit. In the frontend (the worker itself)
    nothing is guarded; :func:`guard_coordinator` makes the DP coordinator guard itself.
    In a process not started by a quiesce worker nothing changes. Idempotent, and
    harmless in processes that never run an EngineCore.
    """
    guard_process(multiprocessing.current_process().name)
    guard_coordinator()
    try:
        from vllm.v1.engine.core import EngineCore  # noqa: PLC0415 (vLLM is optional)
    except ImportError:  # a vLLM without the V1 engine: the probe falls back and says so
        return
    for name, function in ((SNAPSHOT_METHOD, quiesce_snapshot),
                           (SUBSCRIBE_METHOD, quiesce_subscribe)):
        if getattr(EngineCore, name, None) is not function:
            setattr(EngineCore, name, function)
    install_engine_exit()  # only in a quiesce worker's engine processes
