"""Keeping SGLang's own SIGTERM/SIGINT machinery out of a quiesce drain (checked on 0.5.23).

What each SGLang process does on a signal by itself, and what the adapter changes:

- **main process** (the worker; holds ``Engine`` and ``TokenizerManager``):
  ``TokenizerManager.auto_create_handle_loop()`` (first request, or any control call)
  registers, from the main thread, ``loop.add_signal_handler(SIGTERM,
  SignalHandler.sigterm_handler)``, which sets ``gracefully_exit``; its
  ``sigterm_watchdog`` task then waits (polling every 5 s, unbounded) until
  ``rid_to_state`` is empty, sends ``ShutdownReq`` to the schedulers, waits up to 15 s
  and ``kill_process_tree``\\ s every child: a shutdown of its own, on SGLang's clock, with
  no admission control. SIGINT: SGLang registers nothing (Python's
  ``KeyboardInterrupt``, or the worker's handler). SIGQUIT (a child failed): kill the
  whole tree, main process included. ``Engine.__init__`` registers ``atexit`` →
  ``Engine.shutdown()``, which kills the process tree at once, no drain.
  The adapter: :func:`own_main_process_signals` swaps the TokenizerManager's
  ``signal_handler_class`` for one whose SIGTERM handler only logs (it never sets
  ``gracefully_exit``, so ``sigterm_watchdog`` never starts SGLang's shutdown) and creates
  the handle loop *now*, so that SGLang registers its handlers before the worker
  registers its own, which then replace them on the loop. SIGQUIT keeps SGLang's
  handler (a dead child means the engine is gone: every request is lost anyway).
- **scheduler processes** (one per TP/PP rank), **detokenizer**, **DP controller**:
  SGLang installs no SIGTERM/SIGINT handler there, so SIGTERM kills the process at once
  and SIGINT raises ``KeyboardInterrupt`` in its event loop; each has
  ``PR_SET_PDEATHSIG=SIGKILL`` (dies with the main process). A signal to the process
  group (Ctrl-C, ``tini -g``) or to every process (systemd, ``pkill``) would so end
  every request mid-drain. The adapter: quiesce's plugin (:mod:`.plugin`), loaded by
  SGLang first thing in each of them, calls :func:`quiesce.signal_guard.guard_process`,
  which ignores both signals until the worker permits the shutdown.
- handlers SGLang installs *later* in a guarded process go through ``signal.signal``
  and are guarded as they are installed (:func:`quiesce.signal_guard.guard_process`):
  the hf3fs HiCache backend (``HiCacheHF3FS.__init__``, checked on 0.5.23) installs, in
  the scheduler, SIGINT/SIGTERM/SIGQUIT handlers that close its storage clients and
  return — the scheduler would go on serving with its KV storage closed. Its SIGTERM and
  SIGINT handlers now run only with the worker's permit; its SIGQUIT handler is SGLang's
  failure path (not guarded, as above). Whatever replaces the guard past
  ``signal.signal`` is reported unprotected by the guard's watcher, with what replaced it.
- ``SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION`` (off by default): on a scheduler exception,
  that scheduler SIGKILLs its whole process group — the worker and anything else in its
  group (a launcher, a sidecar, PID 1 of a container run without an init) — besides the
  SIGQUIT that already ends the engine. quiesce *warns* (:func:`warn_killpg`: an ERROR
  log in the worker when SGLang loads its plugins, before any scheduler starts, and a
  warning in the signal-guard report of the ``ready`` event and ``GET /engine/status``)
  rather than refusing: it acts only once a scheduler has failed, when every request
  the engine held is lost whatever the worker does, and operators set it on purpose
  (multi-rank jobs flood their logs without it). The warning says what it costs: the
  worker dies without its exit report and without unregistering from discovery.
- ``Engine.shutdown()`` runs only from :meth:`.control.SglangEngineControl.shutdown`,
  after the drain (or the forced path's ``abort_all``); its SIGKILLs cannot be guarded
  and need not be.

Without a quiesce worker (no :data:`~quiesce.signal_guard.OWNER_ENV`) the plugin's guard
does nothing; :func:`own_main_process_signals` is called only by quiesce's own serving
code (or a backend that owns SIGTERM itself).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from quiesce.signal_guard import OWNER_ENV, warn_owner

log = logging.getLogger("quiesce.adapters.sglang.signals")

KILLPG_ENV = "SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION"
_TRUE = ("true", "1", "yes", "y")
"""What SGLang's ``EnvBool`` reads as true (0.5.23)."""


def warn_killpg(environ: Mapping[str, str] = os.environ) -> str | None:
    """Warn (module docstring) if :data:`KILLPG_ENV` is on in a quiesce worker's engine:
    an ERROR log in the worker's own process, and a warning in its signal-guard report.
    Returns the warning, or None when the variable is off or no worker owns the signals.
    """
    value = environ.get(KILLPG_ENV, "")
    owner = environ.get(OWNER_ENV, "")
    if value.strip().lower() not in _TRUE or not owner:
        return None
    text = (f"{KILLPG_ENV}={value}: a scheduler exception makes SGLang SIGKILL its whole "
            f"process group, the quiesce worker (pid {owner.partition(':')[0]}) included: "
            "the worker then exits without its exit report and without unregistering from "
            "discovery; unset it to keep them")
    warn_owner("sglang-killpg", text)
    if owner.partition(":")[0] == str(os.getpid()):  # once, in the worker itself
        log.error("quiesce: %s", text)
    return text


def _deferring_handler_class(base: type) -> type:
    class DeferToQuiesce(base):  # type: ignore[misc]
        """SGLang's ``SignalHandler`` minus its SIGTERM drain: the worker owns SIGTERM."""

        def sigterm_handler(self, signum: int | None = None, frame: Any = None) -> None:
            log.warning("SIGTERM reached SGLang's TokenizerManager handler; ignored: the "
                        "quiesce worker owns SIGTERM and drains first")

    DeferToQuiesce.__qualname__ = f"DeferToQuiesce({base.__qualname__})"
    return DeferToQuiesce


def own_main_process_signals(tokenizer_manager: Any) -> bool:
    """Keep SGLang's main-process SIGTERM drain out (module docstring); True if done.

    Call from the main thread, on the running event loop, *before* the worker registers
    its own SIGTERM/SIGINT handlers. Idempotent. Returns False (and logs why) where the
    TokenizerManager lacks ``signal_handler_class`` or its handle loop already exists
    (SGLang's handler may then be registered: the worker must register its own after).
    """
    base = getattr(tokenizer_manager, "signal_handler_class", None)
    if not isinstance(base, type):
        log.warning("TokenizerManager has no signal_handler_class: SGLang's SIGTERM drain "
                    "cannot be turned off on this version")
        return False
    if not base.__qualname__.startswith("DeferToQuiesce("):
        if getattr(tokenizer_manager, "event_loop", None) is not None:
            log.warning("SGLang's handle loop already runs: its SIGTERM handler is "
                        "registered; register the worker's handlers after this call")
            return False
        tokenizer_manager.signal_handler_class = _deferring_handler_class(base)
    if threading.current_thread() is not threading.main_thread():
        log.warning("not on the main thread: SGLang registers no signal handler here")
    tokenizer_manager.auto_create_handle_loop()
    return True
