"""What the shutdown may ask of an SGLang ``Engine`` besides reading it (checked on 0.5.23).

Runs in: the worker's main process, on the event loop.

- ``abort_all``: the forced path, when the drain budget ran out. Counts the requests the
  TokenizerManager tracks (``rid_to_state``) and sends one ``AbortReq(abort_all=True)``
  (``TokenizerManager.abort_request(abort_all=True)``) to every scheduler. Each scheduler
  ends its waiting and running requests with finish reason ``abort`` (the streams end
  ``lost``); for a prefill request whose KV is in flight it only calls the KV sender's
  ``abort()``, and the request leaves the inflight queue at the next poll (``Failed``), so
  the probe stays busy for that poll. Returns the count; 0 sends nothing.
- ``shutdown``: cancels the TokenizerManager's own tasks (the output ``handle_loop`` and
  ``sigterm_watchdog``, which would otherwise be destroyed pending when the loop closes),
  then runs ``Engine.shutdown()`` in a thread: it does no drain, it SIGKILLs every child
  of this process (schedulers, detokenizer, DP controller, and any other child of the
  worker) and waits up to 60 s for them to be reaped. The worker calls it only once the
  drain proved the engine idle or after ``abort_all``, and after the signal guard
  permits shutdown. The ``atexit`` registration ``Engine.__init__`` made is removed, so
  the interpreter's exit does not run a second ``Engine.shutdown()``.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
from typing import Any

log = logging.getLogger("quiesce.adapters.sglang.control")


def _already_shut_down() -> None:
    """``Engine.shutdown`` once the engine is shut down: nothing is left to release."""


class SglangEngineControl:
    """:class:`~quiesce.engine.EngineControl` for an SGLang ``Engine``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def tokenizer_manager(self) -> Any:
        return self.engine.tokenizer_manager

    async def abort_all(self, reason: str) -> int:
        manager = self.tokenizer_manager
        count = len(manager.rid_to_state)
        if count:
            log.warning("aborting %d SGLang request(s): %s", count, reason)
            manager.abort_request(abort_all=True)
        return count

    async def shutdown(self) -> None:
        manager = self.tokenizer_manager
        current = asyncio.current_task()
        tasks = [t for t in getattr(manager, "asyncio_tasks", ()) if t is not current]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)  # never raises the tasks' CancelledError
        shutdown = self.engine.shutdown
        await asyncio.to_thread(shutdown)
        atexit.unregister(shutdown)  # bound methods compare equal: Engine's own registration
        self.engine.shutdown = _already_shut_down
