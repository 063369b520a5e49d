"""What the shutdown may ask of a TensorRT-LLM ``LLM`` besides reading it.

- ``abort_all`` (the forced path, when the drain budget ran out) runs in the worker's
  process on its event loop. It copies the executor's map of unfinished results
  (``llm._executor._results``: the single-process worker's, the MPI proxy's or the Ray
  executor's own) and aborts each with its ``abort()`` (TensorRT-LLM sends a cancel
  request to the executor loop; this call does not wait for it), or with
  ``llm._executor.abort_request(id)`` where a result has no ``abort``. Returns how many
  were aborted. Context requests whose KV is still held for a generation worker have
  finished their result already and are not counted: TensorRT-LLM frees their KV at its
  own shutdown. A missing map raises (the shutdown reports the abort stage FAILED with
  the reason); the copy is retried when the response thread changes the map meanwhile.
- ``shutdown`` runs ``llm.shutdown()`` off the event loop (it joins the executor's
  threads or processes). The worker calls it only after the drain proved the engine
  idle, or after ``abort_all``: ``PyExecutor.shutdown`` finishes active and waiting
  requests but does not wait for context KV transfers, which is why the drain must.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

COPY_ATTEMPTS: Final = 5


def _unfinished(executor: Any) -> list[tuple[Any, Any]]:
    """A copy of ``executor._results`` (id → result). Raises LookupError on drift."""
    results = getattr(executor, "_results", None)
    if results is None or not hasattr(results, "items"):
        raise LookupError(f"{type(executor).__name__} has no _results map: cannot find the "
                          "requests to abort (TensorRT-LLM layout drift)")
    for _ in range(COPY_ATTEMPTS):
        try:
            return list(results.items())
        except RuntimeError:  # changed size during the copy: the response thread ran
            continue
    raise RuntimeError(f"the results map kept changing; gave up after {COPY_ATTEMPTS} copies")


class TrtllmEngineControl:
    """:class:`~quiesce.engine.EngineControl` for a ``tensorrt_llm.LLM``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    async def abort_all(self, reason: str) -> int:
        executor = self.llm._executor
        aborted = 0
        for request_id, result in _unfinished(executor):
            abort = getattr(result, "abort", None)
            if callable(abort):
                abort()
            else:
                executor.abort_request(request_id)
            aborted += 1
        return aborted

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)
