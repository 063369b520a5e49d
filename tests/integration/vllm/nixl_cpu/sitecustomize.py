"""NIXL agents without their progress thread, and vLLM's NIXL connector without its core
pin, for NIXL engines on a CPU with few cores.

Put this directory first on ``PYTHONPATH`` of a process (its children inherit it) and
Python imports this module at start-up (``site``); it then makes every
``nixl_agent_config`` (NIXL's Python API) say ``enable_pthread = False``, the moment
NIXL's API module is imported. Nothing is imported early; without NIXL nothing happens.

Why: NIXL's Python API creates each agent's progress thread with a zero delay
(``pthrDelay = 0`` in ``nixl_agent.__init__``), and that thread busy-polls: one core per
engine, forever (measured on nixl 1.5.1: ~100 % of a core per idle model worker, mostly
in ``poll``). Two engines on a two-core machine leave nothing for anything else: a
third engine took minutes to start, and a decoder's first KV pull stalled until the
prefill side's lease ran out. A non-zero delay is no cure either (the first handshake's
``add_remote_agent`` took 15-30 s with 10 µs-1 ms). Without the thread NIXL progresses
inside the calls vLLM's connector makes on every engine step (``getNotifs`` runs the
progress loop itself when there is no thread), which is all a transfer needs here: the
handshake then takes ~40 ms. What vLLM does with the KV (hold it for the decoder until
its read is notified or the lease expires) is unchanged.

It also keeps vLLM's NIXL connector (``nixl/base_worker.py``) from pinning the model
worker's main thread: on a CPU device it calls ``os.sched_setaffinity(0, ...)`` with the
last core of each NUMA node ("reserve different cores for start_load_kv()"), whatever else
runs there, and ``VLLM_CPU_OMP_THREADS_BIND=nobind`` does not stop it. Here that is CPU 1
for *both* engines: each worker's main thread, which steps the engine and makes every NIXL
call, and the threads it starts later (the handshake thread) shared one core
(``taskset -pc`` per thread), while each spins in vLLM's ``shm_broadcast`` wait
(``sched_yield``). The connector module then sees an ``os`` whose ``sched_setaffinity``
does nothing (everything else is the real ``os``); where the threads run is left to the
kernel. Why: the decoder's worker went without that core for seconds while the prefill
worker spun (py-spy: the decoder's main thread in ``sched_yield``, its handshake thread
holding the GIL, the process' CPU time not moving): its handshake reply sat unread for
8 s after the prefill side had sent it (``get metadata took: 8.0``), its reads were posted
that late, and a pull over UCX's TCP (a READ emulated with active messages that the
prefill side answers on its own engine steps) took seconds. Measured (the sigterm to
the process group delivery, repeated against one decode worker, DEBUG logs): with the pin,
from the first decode request to the last KV received took 2-14 s in 9 of 33 deliveries
(UCX on shared memory instead of TCP did not change that: 4 of 18); one CI run posted two
of its reads only after the prefill worker's drain had run out (``postXferReq ... was
disconnected after transfer request creation``). With only this pin gone the OpenMP
binding put both main threads on CPU 0 instead, and 2 of 2 deliveries failed, the drain
timed out; hence also ``VLLM_CPU_OMP_THREADS_BIND=nobind`` in the test module. With
neither pin, 12 of 12 deliveries passed, each within 1 s from the first decode request to
the last KV received (handshake at most 0.3 s), on the same busy machine.

Used by ``tests/integration/vllm/test_disagg_workers.py``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

API_MODULES = frozenset({"nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api"})
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"


class _OsWithoutAffinity(ModuleType):
    """The ``os`` module, but ``sched_setaffinity`` leaves the affinity as it is."""

    def __init__(self) -> None:
        super().__init__("os")

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def sched_setaffinity(pid: int, mask: Any) -> None:
        return None


def _without_core_pin(module: ModuleType) -> None:
    if getattr(module, "os", None) is os:
        module.os = _OsWithoutAffinity()  # type: ignore[attr-defined]
    else:  # vLLM moved the call: say so loudly, the pin (and the flake) would be back
        sys.stderr.write(f"nixl_cpu/sitecustomize.py: {CONNECTOR_MODULE} has no module-level"
                         f" `os`; its core pin was NOT undone\n")


def _without_progress_thread(module: ModuleType) -> None:
    config = getattr(module, "nixl_agent_config", None)
    if config is None or getattr(config, "_quiesce_no_progress_thread", False):
        return
    original = config.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.enable_pthread = False

    config.__init__ = __init__
    config._quiesce_no_progress_thread = True


class _PatchNixlApi(importlib.abc.MetaPathFinder):
    """Finds NIXL's API module and vLLM's NIXL connector module the normal way, then
    patches each once it has run."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in API_MODULES and fullname != CONNECTOR_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            if fullname == CONNECTOR_MODULE:
                _without_core_pin(module)
            else:
                _without_progress_thread(module)

        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchNixlApi())
