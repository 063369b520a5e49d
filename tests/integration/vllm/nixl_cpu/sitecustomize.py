"""NIXL agents without their progress thread, for NIXL engines on a CPU with few cores.

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

Used by ``tests/integration/vllm/test_disagg_workers.py``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

API_MODULES = frozenset({"nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api"})


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
    """Finds NIXL's API module the normal way, then patches it once it has run."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in API_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _without_progress_thread(module)

        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchNixlApi())
