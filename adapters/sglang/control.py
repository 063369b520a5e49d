"""What the shutdown may ask of an SGLang ``Engine`` besides reading it (checked on 0.5.23).

Runs in: the worker's main process, on the event loop.

- ``abort_all``: the forced path, when the drain budget ran out. Counts the requests the
  TokenizerManager tracks (``rid_to_state``) and sends one ``AbortReq(abort_all=True)``
  (``TokenizerManager.abort_request(abort_all=True)``) to every scheduler. Each scheduler
  ends its waiting and running requests with finish reason ``abort`` (the streams end
  ``lost``); for a prefill request whose KV is in flight it only calls the KV sender's
  ``abort()``, and the request leaves the inflight queue at its next poll (``Failed``)
  while the KV manager's transfer thread may still be writing its chunks into decode's
  memory and owe decode an ABORT_ACK (``_staging_outstanding``,
  ``_deferred_ack_targets``; the request itself is gone from every queue and from
  ``rid_to_state``). So on a prefill worker it then waits, at most ``abort_settle_s``,
  until every DP rank's scheduler state (:mod:`.scheduler_state`, read as the probe
  reads it) shows no aborted request still inflight, no room still written, no
  ABORT_ACK owed and no poisoned room; what is left then is counted as abandoned (one
  per room or ACK: an over-count where an aborted request still tracked is counted
  again, never an under-count) and logged. Where the state cannot be read (plugin not
  loaded, no answer) it logs that the writes are unaccounted and counts nothing more.
  Returns the requests aborted plus the KV obligations abandoned; 0 sends nothing.
  Keep ``abort_settle_s`` below the shutdown's cleanup reserve, less the time
  ``shutdown`` needs: the shutdown bounds the whole call by that reserve, and a call it
  cuts short reports no count.
- ``shutdown``: cancels the TokenizerManager's own tasks (the output ``handle_loop`` and
  ``sigterm_watchdog``, which would otherwise be destroyed pending when the loop closes),
  then runs ``Engine.shutdown()`` in a thread: it does no drain, it SIGKILLs every child
  of this process (schedulers, detokenizer, DP controller, and any other child of the
  worker) and waits up to 60 s for them to be reaped. The worker calls it only once the
  drain proved the engine idle or after ``abort_all``, and after the signal guard
  permits shutdown. The ``atexit`` registration ``Engine.__init__`` made is removed, so
  the interpreter's exit does not run a second ``Engine.shutdown()``.

SGLang's own HTTP server has no ``Engine``: :class:`.server.ServerEngine` stands for it.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import time
from typing import Any

from quiesce.errors import ConfigError
from quiesce.probe import Role

from .scheduler_rpc import SchedulerStateReader, states_by_rank
from .topology import dp_ranks_of

log = logging.getLogger("quiesce.adapters.sglang.control")
DEFAULT_ABORT_SETTLE_S = 2.0
KV_OBLIGATIONS = ("kv_writes_outstanding", "kv_abort_acks_owed", "kv_rooms_poisoned")
"""Scheduler-state ``uncovered`` counts that an aborted prefill request can leave behind."""


def _already_shut_down() -> None:
    """``Engine.shutdown`` once the engine is shut down: nothing is left to release."""


class SglangEngineControl:
    """:class:`~quiesce.engine.EngineControl` for an SGLang ``Engine`` (module docstring).

    ``role``: the worker's role; only a prefill worker waits after the abort.
    ``abort_settle_s``: the most ``abort_all`` waits for aborted KV writes to end.
    """

    def __init__(self, engine: Any, role: Role | str = Role.AGGREGATED, *,
                 abort_settle_s: float = DEFAULT_ABORT_SETTLE_S,
                 clock: Any = time.monotonic) -> None:
        if not isinstance(abort_settle_s, (int, float)) or isinstance(abort_settle_s, bool) \
                or abort_settle_s <= 0:
            raise ConfigError("abort_settle_s", f"must be a positive number of seconds, "
                              f"got {abort_settle_s!r}")
        self.engine = engine
        self.role = Role.parse(role)
        self.abort_settle_s = float(abort_settle_s)
        self._clock = clock
        self.abandoned = 0
        """KV obligations the last ``abort_all`` left behind (0 if none, or unreadable)."""

    @property
    def tokenizer_manager(self) -> Any:
        return self.engine.tokenizer_manager

    async def abort_all(self, reason: str) -> int:
        manager = self.tokenizer_manager
        count = len(manager.rid_to_state)
        if count:
            log.warning("aborting %d SGLang request(s): %s", count, reason)
            manager.abort_request(abort_all=True)
        self.abandoned = 0
        if self.role is Role.PREFILL:
            self.abandoned = await self._settle_kv_writes()
        return count + self.abandoned

    async def _settle_kv_writes(self) -> int:
        """Wait (``abort_settle_s`` at most) until no aborted KV write is left; return
        how many are left then (0 if the state could not be read: logged)."""
        manager = self.tokenizer_manager
        deadline = self._clock() + self.abort_settle_s
        reader = SchedulerStateReader(manager, max(self.abort_settle_s, 0.001))
        ranks = dp_ranks_of(manager)
        left: int | None = None
        why = "cannot read the number of DP ranks" if ranks is None else ""
        pause = 0.005
        while ranks is not None:
            reader.timeout_s = max(deadline - self._clock(), 0.001)
            fetched = await reader.fetch()
            states = fetched if isinstance(fetched, str) else states_by_rank(
                fetched[0], self.role, expected_ranks=ranks, not_before=fetched[1])
            if isinstance(states, str):
                why = states
            else:
                left = sum(int(state["uncovered"].get(name, 0)) for state in states.values()
                           for name in KV_OBLIGATIONS) \
                    + sum(int(state["counts"].get("prefill_inflight", 0))
                          for state in states.values())
                if left == 0:
                    return 0
            if self._clock() + pause > deadline:
                break
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)
        if left is None:
            log.warning("after the abort, the prefill KV manager's rooms cannot be read "
                        "(%s): KV writes still in flight to decode are unaccounted", why)
            return 0
        log.warning("after the abort, %d KV write(s), ABORT_ACK(s) or aborted transfer(s) "
                    "to decode were still open after %.1fs: counted as abandoned", left,
                    self.abort_settle_s)
        return left

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
