"""What the shutdown may ask of a TensorRT-LLM ``LLM`` besides reading it.

- ``abort_all`` (the forced path, when the drain budget ran out) runs its work on a
  thread (``asyncio.to_thread``), never on the event loop: under Ray each
  ``GenerationResult.abort()`` or ``abort_request`` is a blocking Ray call. The caller's
  deadline bounds it (the shutdown awaits it under ``asyncio.wait_for``); when the
  caller stops waiting, the thread stops after the abort in progress. It copies the
  executor's map of unfinished results (``llm._executor._results``: the single-process
  worker's, the MPI proxy's or the Ray executor's own) and aborts each with its
  ``abort()`` (TensorRT-LLM sends a cancel request to the executor loop; this call does
  not wait for it), or with ``llm._executor.abort_request(id)`` where a result has no
  ``abort``. A missing map raises (the shutdown reports the abort stage FAILED with the
  reason); the copy is retried when the response thread changes the map meanwhile.
  **Old Ray builds**: ``RayExecutor.submit`` before the RPC executor (ray_executor.py
  50a6f3cc) enqueues on the leader worker and never fills ``_results``. Where a
  ``RayExecutor``'s map is missing or empty, the requests are found in the Ray workers
  instead (:mod:`.ray_extension`: every rank lists the ids its ``PyExecutor`` holds, then
  the leader cancels their union with ``PyExecutor.cancel_request``), two Ray calls.
- **Abandoned KV.** Context requests whose KV a decode worker may still be pulling have
  finished their result already, so nothing above aborts them, and TensorRT-LLM's
  ``shutdown`` frees their KV **without waiting for the pull**: the decoder may read
  freed (reused) blocks and its request fails or produces garbage. This is unsafe, not
  a clean release. ``abort_all`` therefore counts them (the in-transfer count of
  :mod:`.executor_reader`: read in this process for the single-process worker, from
  every rank for Ray; unknowable for the MPI proxy, which is logged), logs them at
  WARNING as abandoned KV, and adds them to what it returns, so that the shutdown
  report's ``aborted`` count includes them.
- ``wake_idle_loop`` (opt-in, never called by the probe): the reaping trigger for the
  idle-loop gap (docs/trtllm.md). When the in-process executor's loop is parked on its
  empty request queue while context transfers are counted (``idle_transfer_gap``), it
  enqueues one cancel for :data:`WAKE_REQUEST_ID`, an id no request can have, through
  ``PyExecutor.cancel_request``: the loop wakes, runs one pass (in the Jan-2026 source
  a pass with nothing to fit calls ``_check_disagg_ctx_cache_transfer_status(1)``,
  which reaps finished transfers) and parks again. The cancel matches nothing. Refused,
  with the reason, in every other state, and under Ray or the MPI proxy.
- ``shutdown`` runs ``llm.shutdown()`` off the event loop (it joins the executor's
  threads or processes). The worker calls it only after the drain proved the engine
  idle, or after ``abort_all``: ``PyExecutor.shutdown`` finishes active and waiting
  requests but does not wait for context KV transfers, which is why the drain must.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Final

from .executor_reader import read_py_executor
from .ray_extension import CANCEL, METHOD, REQUEST_IDS

log = logging.getLogger("quiesce.adapters.trtllm.control")

COPY_ATTEMPTS: Final = 5
WAKE_REQUEST_ID: Final = 2**63 - 1
"""No request has this id: local ids are below ``MIN_GLOBAL_ID`` and global ones are
rotated into ``[MIN_GLOBAL_ID, 2**63 - 1)`` (``llmapi/disagg_utils.py``); it fits the
int64/uint64 of every id set."""


def wake_idle_loop(executor: Any) -> str | None:
    """Wake ``executor``'s parked loop so that a pass reaps finished context transfers
    (module docstring). None when the wake-up was sent, else why it was not. Reads first
    (microseconds), then at most one ``cancel_request``."""
    reading = read_py_executor(executor)
    if reading["errors"]:
        return f"not sent: the reading has errors ({'; '.join(reading['errors'])})"
    if not reading["idle_transfer_gap"]:
        return "not sent: no context transfer is held by an idle executor"
    if not reading["parked"]:
        return "not sent: the executor loop is not parked on its request queue"
    cancel = getattr(executor, "cancel_request", None)
    if not callable(cancel):
        return "not sent: PyExecutor.cancel_request is missing (layout drift)"
    cancel(WAKE_REQUEST_ID)
    return None


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


def in_transfer(llm: Any) -> tuple[int | None, str]:
    """How many context requests hold KV for a decoder now, and where that was read
    (or why it could not be). Blocking (one Ray round trip under Ray)."""
    executor = getattr(llm, "_executor", None)
    kind = type(executor).__name__
    readings: list[Any]
    engine = getattr(executor, "engine", None)
    if engine is not None:
        readings = [read_py_executor(engine)]
    elif kind == "RayExecutor":
        try:
            readings = list(llm._collective_rpc(METHOD))
        except Exception as exc:
            return None, f"the Ray workers did not answer: {type(exc).__name__}: {exc}"
    else:
        return None, f"{kind} does not expose context transfers to this process"
    counts = [r.get("ctx_in_transfer") if isinstance(r, dict) else None for r in readings]
    if not counts or any(not isinstance(c, int) for c in counts):
        return None, "the in-transfer count was unreadable"
    return sum(counts), f"{len(counts)} executor(s)"  # type: ignore[arg-type]


class TrtllmEngineControl:
    """:class:`~quiesce.engine.EngineControl` for a ``tensorrt_llm.LLM``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _abort_in_ray_workers(self) -> int:
        """Cancel, in the Ray workers, every request their executors hold (module
        docstring); returns how many were asked. Raises what the Ray calls raise."""
        ids: set[int] = set()
        for answer in self.llm._collective_rpc(REQUEST_IDS):
            ids.update(i for i in answer if isinstance(i, int))
        if not ids:
            return 0
        asked = self.llm._collective_rpc(CANCEL, args=(sorted(ids),))
        return max((n for n in asked if isinstance(n, int)), default=0)

    def _abort_blocking(self, stop: threading.Event) -> tuple[int, int]:
        executor = self.llm._executor
        aborted = 0
        unfinished: list[tuple[Any, Any]] = []
        if type(executor).__name__ == "RayExecutor":
            try:
                unfinished = _unfinished(executor)
            except LookupError:
                unfinished = []
            if not unfinished:  # an old RayExecutor never fills _results
                aborted = self._abort_in_ray_workers()
        else:
            unfinished = _unfinished(executor)
        for request_id, result in unfinished:
            if stop.is_set():  # the caller's deadline passed: leave the rest
                break
            abort = getattr(result, "abort", None)
            if callable(abort):
                abort()
            else:
                executor.abort_request(request_id)
            aborted += 1
        held, where = in_transfer(self.llm)
        if held is None:
            log.warning("cannot count context requests still in KV transfer (%s): any such "
                        "KV is freed at shutdown while a decoder may still pull it", where)
            held = 0
        elif held:
            log.warning("abandoning KV of %d context request(s) still in transfer (%s): "
                        "TensorRT-LLM's shutdown frees it without waiting for the "
                        "decoder's pull; counted as aborted", held, where)
        return aborted, held

    async def abort_all(self, reason: str) -> int:
        """Abort every unfinished request off the event loop; returns how many, plus the
        context requests whose KV is abandoned in transfer (module docstring)."""
        stop = threading.Event()
        try:
            aborted, held = await asyncio.to_thread(self._abort_blocking, stop)
        except asyncio.CancelledError:
            stop.set()
            raise
        return aborted + held

    async def wake_idle_loop(self) -> str | None:
        """:func:`wake_idle_loop` on the single-process worker's executor; elsewhere (Ray,
        the MPI proxy, no engine) not sent, with the reason."""
        engine = getattr(getattr(self.llm, "_executor", None), "engine", None)
        if engine is None:
            return ("not sent: no PyExecutor in this process (Ray or the MPI proxy, or "
                    "shut down)")
        return wake_idle_loop(engine)  # microseconds: a reading and one enqueue

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)
