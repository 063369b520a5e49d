"""quiesce's SGLang plugin: export the scheduler's pending work, guard engine processes.

Registered on the entry-point group ``sglang.srt.plugins`` (name ``quiesce``; checked on
0.5.23: ``sglang.srt.plugins.GENERAL_PLUGINS_GROUP``). SGLang calls ``load_plugins()``
once per process, first thing, in the main process (``Engine.__init__``), in every
scheduler process (``run_scheduler_process``), in the detokenizer
(``run_detokenizer_process``) and in the data-parallel controller; each calls
:func:`register`, then ``HookRegistry.apply_hooks()``. ``SGLANG_PLUGINS``, when set, is a
whitelist: it must name ``quiesce`` or the plugin is skipped (the probe then says the
scheduler's state is missing: UNKNOWN).

What :func:`register` does, per process:

- **every process**: :func:`quiesce.signal_guard.guard_process` wraps SIGTERM/SIGINT
  (only in a process started under a quiesce worker, :data:`~quiesce.signal_guard.
  OWNER_ENV`; elsewhere, and in the main process, it does nothing). On 0.5.23 no SGLang
  scheduler, detokenizer or DP-controller process installs a SIGTERM/SIGINT handler of
  its own, so what it wraps are Python's defaults: SIGTERM kills the process at once,
  SIGINT raises ``KeyboardInterrupt`` in the event loop (the process exits through its
  ``finally``). Either would end every request that process holds while the worker
  drains; guarded, the signal is logged and ignored until the worker permits the
  shutdown. Handlers SGLang installs later through ``signal.signal`` are guarded as they
  are installed (the hf3fs HiCache backend's, :mod:`.signals`); those installed only
  over a default handler (the unified memory pool's stats dump) leave the guard in
  place; the remote-weight connector chains to it. The signal-guard report says, at
  read time, whether each process's handler is still the guard.
- **every process**: :func:`.signals.warn_killpg` warns (once, in the worker) when
  ``SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION`` is on.
- **every process**: registers an AFTER hook on
  ``sglang.srt.managers.scheduler.Scheduler.get_internal_state`` that adds
  ``internal_state["quiesce"]`` (:mod:`.scheduler_state`). Only scheduler processes ever
  call that method; elsewhere the hook is inert. Cost: nothing per step; ~2 µs per
  ``get_internal_state`` call. SGLang only logs a hook it fails to apply, so the probe
  never assumes it is there: a missing key is UNKNOWN.

Imports nothing from SGLang at import time.
"""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

from quiesce.signal_guard import guard_process

from .scheduler_state import add_state_to_internal_state
from .signals import warn_killpg

ENTRY_POINT_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "quiesce"
HOOK_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"

log = logging.getLogger("quiesce.adapters.sglang.plugin")
_registered: list[bool] = []
"""Non-empty once this process registered the hook."""


def register_hook(registry: Any = None, hook_type: Any = None) -> bool:
    """Register the state hook with SGLang's ``HookRegistry``; True if it was registered.

    ``registry``/``hook_type`` default to SGLang's own (tests pass them). Idempotent per
    process. Returns False (and logs) where SGLang has no hook registry (before 0.5.21).
    """
    if _registered:
        return False
    if registry is None or hook_type is None:
        try:
            from sglang.srt.plugins.hook_registry import (  # noqa: PLC0415 (optional engine)
                HookRegistry,
                HookType,
            )
        except ImportError as exc:
            log.warning("quiesce: this SGLang has no plugin hooks (%s); the probe will say "
                        "the scheduler's state is unknown", exc)
            return False
        registry, hook_type = HookRegistry, HookType
    registry.register(HOOK_TARGET, add_state_to_internal_state, hook_type.AFTER)
    _registered.append(True)
    return True


def register() -> None:
    """Entry point of ``sglang.srt.plugins``: guard this process, warn about a setting
    that ends the worker, register the hook."""
    guard_process(f"sglang {multiprocessing.current_process().name}")
    warn_killpg()
    register_hook()
