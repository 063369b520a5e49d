"""What the shutdown may ask of a vLLM ``AsyncLLM`` besides reading it.

``abort_all`` aborts every request the frontend still tracks (the forced path when the
drain budget ran out) and counts them. KV blocks held for a remote decoder after a
request finished are not requests any more: vLLM frees them when the decoder reads
them, when their NIXL lease expires, or when the engine shuts down; the count does not
include them.

``shutdown`` first stops the frontend's side (marks the client's engine dead, cancels
the output handler), then runs vLLM's own clean shutdown, ``AsyncLLM.shutdown(timeout)``,
in its own order (checked on 0.32): the client detaches its finalizer and SIGTERMs
EngineCore; EngineCore leaves its busy loop, closes its model runners' death pipes and waits for
them (``MultiprocExecutor._ensure_worker_termination``, polling every 0.1 s), tears down
its scheduler and distributed state, and exits; the client joins it (``timeout``, then
SIGKILL of the whole tree, which would leave its shared-memory segments to the
resource tracker's "leaked" warning), closes its sockets and cancels the output
handler. That last step comes too late: closing the client cancels its output-socket
task, which hands ``EngineDeadError`` to the output handler, and whenever the loop runs
the handler before the cancellation arrives, it logs "AsyncLLM output_handler failed"
with a traceback at ERROR level (seen in about one shutdown in two here). With the
handler cancelled (and awaited) first, nothing reads the outputs queue any more.
Marking the client's engine dead (``resources.engine_dead``, which vLLM sets itself once
the client is closed) makes every later call into EngineCore fail at once with
``EngineDeadError`` instead of waiting for an answer that a stopping EngineCore never
sends: a status read during the shutdown (the probe asks EngineCore by utility call
once ``AsyncLLM.errored`` is set or EngineCore closed its board) otherwise held the admin
server's graceful close, and so the exit, for the probe's whole 1 s timeout (measured:
the exit line came ~0.33 s after EngineCore's exit whenever a status read fell in the
engine stage, ~0.02 s otherwise). It also tells vLLM's engine monitor thread that
EngineCore's exit is expected.

The worker calls ``shutdown`` only once the drain proved the engine idle (or, on the
forced path, after ``abort_all``, whose requests the frontend finishes itself), with the
engine's signal handlers permitted, so nothing is lost by it. The time it takes is
dominated by each engine process's own exit (see :mod:`.exit`).

Afterwards the ``AsyncLLM`` is inert but may live on in reference cycles until the
interpreter's teardown, where ``AsyncLLM.__del__`` calls ``shutdown()`` again after
``vllm.v1.engine.async_llm``'s globals were cleared (``TypeError: 'NoneType' object is
not callable``, printed at exit). With everything released, the instance's second
shutdown is made a no-op.
"""

from __future__ import annotations

import asyncio
from typing import Any


def _already_shut_down(timeout: float | None = None) -> None:
    """``AsyncLLM.shutdown`` once the engine is shut down: nothing is left to release."""


class VllmEngineControl:
    """:class:`~quiesce.engine.EngineControl` for a vLLM V1 ``AsyncLLM``."""

    def __init__(self, engine: Any, shutdown_timeout_s: float | None = None) -> None:
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s

    async def abort_all(self, reason: str) -> int:
        ids = list(self.engine.output_processor.request_states)
        if ids:
            await self.engine.abort(ids, internal=True)
        return len(ids)

    async def shutdown(self) -> None:
        engine = self.engine
        resources = getattr(getattr(engine, "engine_core", None), "resources", None)
        if resources is not None and hasattr(resources, "engine_dead"):
            resources.engine_dead = True  # no call into EngineCore waits any more
        handler = getattr(engine, "output_handler", None)
        if isinstance(handler, asyncio.Task) and not handler.done():
            handler.cancel()
            await asyncio.wait({handler})  # never raises the handler's CancelledError
        # AsyncLLM.shutdown joins EngineCore synchronously: keep the loop free.
        await asyncio.to_thread(engine.shutdown, self.shutdown_timeout_s)
        # Only after it returned: a shutdown cut short (its stage timed out, the thread
        # still runs) keeps vLLM's own finalizers.
        engine.shutdown = _already_shut_down
