"""The probe inside every Ray worker: a worker extension for TensorRT-LLM's Ray orchestrator.

Pass ``ray_worker_extension_cls=EXTENSION`` to ``tensorrt_llm.LLM(...,
orchestrator_type="ray")``. TensorRT-LLM's Ray worker wrapper resolves the class by its
qualified name inside each Ray worker process and mixes it into its worker class (it
refuses a name the worker already has, hence the ``quiesce_`` prefix). The owner then
calls ``llm._collective_rpc(METHOD)`` and gets one answer per rank; the probe
(:class:`~.probe.RayProbe`) ANDs them.

- :meth:`QuiesceWorkerExtension.quiesce_pending_work` runs in a Ray worker process, on
  the actor's thread, and reads that rank's ``PyExecutor`` (``self.engine``) with
  :func:`~.executor_reader.read_py_executor`: a few ``len()`` calls. Its cost is the
  Ray round trip (milliseconds). A worker without an engine (not set up yet, or shut
  down) answers with an error, which the probe reports as UNKNOWN.
- Signals: on its first call it also runs :func:`quiesce.signal_guard.guard_process` in
  that worker, which wraps the worker's SIGTERM/SIGINT handlers while the quiesce owner
  drains. Ray starts its workers from the raylet, not from the quiesce worker, so they
  do not share its process group (a group signal does not reach them). Their
  environment is the owner's on TensorRT-LLM builds whose ``RayExecutor.create_workers``
  copies ``os.environ`` into the actors' ``runtime_env`` ``env_vars`` (2026 source; it
  leaves out node-local Ray variables), so ``QUIESCE_SIGNAL_OWNER`` reaches them there;
  on builds that do not copy it, pass it yourself (``runtime_env={"env_vars": ...}``).
  The guard also acts only if Ray runs the call on the worker's main thread. Otherwise
  it does nothing and says so in the answer (``signal_guarded: false``).
- Zero readings are confirmed across calls (:class:`~.zero_confirmation.ZeroConfirmation`,
  one per engine in this process): a zero is reported unconfirmed (``unconfirmed`` set)
  until the executor loop went round since an earlier zero, or was parked on its empty
  request queue; where no iteration counter is readable, a second reading after
  :data:`~.zero_confirmation.CONFIRM_WAIT_S` (a short sleep on the actor's thread)
  confirms it.

- The forced path on builds whose ``RayExecutor.submit`` never fills the owner's
  ``_results`` (ray_executor.py before the RPC executor): :meth:`quiesce_request_ids`
  lists the engine ids this rank's ``PyExecutor`` holds (active, waiting, parked behind
  a control sentinel, and the request queue copied under its own mutex: a hold of
  microseconds), and :meth:`quiesce_cancel_requests` asks the rank whose loop reads the
  request queue (``dist.rank == 0``) to cancel them with ``PyExecutor.cancel_request``
  (TensorRT-LLM enqueues a cancel; the loop finishes each request as cancelled). Used
  by :mod:`.control` only, never by the probe.

Imports nothing from TensorRT-LLM; the class must be importable in the Ray workers'
environment (quiesce installed there).
"""

from __future__ import annotations

from typing import Any, Final

from quiesce.signal_guard import guard_process

from .executor_reader import COUNTS, READING_VERSION
from .zero_confirmation import ZeroConfirmation, read_confirmed_blocking

METHOD: Final = "quiesce_pending_work"
REQUEST_IDS: Final = "quiesce_request_ids"
CANCEL: Final = "quiesce_cancel_requests"
EXTENSION: Final = "quiesce.adapters.trtllm.ray_extension.QuiesceWorkerExtension"

_guard: dict[str, bool] = {}
"""Whether this process's signal guard took (set on the first call)."""
_confirmations: dict[int, ZeroConfirmation] = {}
"""Zero confirmation per engine (``id()``) in this process."""


class QuiesceWorkerExtension:
    """Mixed into TensorRT-LLM's Ray worker class; ``self`` is that worker."""

    def quiesce_pending_work(self) -> dict[str, Any]:
        """This rank's reading (:func:`~.executor_reader.read_py_executor`), plus
        ``signal_guarded``. Never raises."""
        if "guarded" not in _guard:
            _guard["guarded"] = guard_process("tensorrt_llm ray worker")
        engine = getattr(self, "engine", None)
        if engine is None:
            reading: dict[str, Any] = {
                "version": READING_VERSION, "layout": {}, **dict.fromkeys(COUNTS),
                "errors": ["this Ray worker holds no PyExecutor (self.engine is unset: "
                           "not set up yet, or shut down)"], "unconfirmed": "no reading"}
        else:
            confirm = _confirmations.get(id(engine))
            if confirm is None:
                if len(_confirmations) >= 8:  # engines of the past (one per process in Ray)
                    _confirmations.clear()
                confirm = _confirmations[id(engine)] = ZeroConfirmation()
            reading = read_confirmed_blocking(engine, confirm)
        reading["signal_guarded"] = _guard["guarded"]
        return reading

    def quiesce_request_ids(self) -> list[int]:
        """Engine ids of every request this rank's ``PyExecutor`` holds (module
        docstring); [] without an engine. Reads only; never raises for drift."""
        engine = getattr(self, "engine", None)
        return [] if engine is None else sorted(held_request_ids(engine))

    def quiesce_cancel_requests(self, ids: list[int]) -> int:
        """``engine.cancel_request(id)`` for each id, on the rank that reads the request
        queue (``dist.rank == 0``, or any rank where that cannot be read); returns how
        many were asked. 0 on other ranks and without an engine."""
        engine = getattr(self, "engine", None)
        rank = getattr(getattr(engine, "dist", None), "rank", 0)
        if engine is None or rank != 0:
            return 0
        for request_id in ids:
            engine.cancel_request(request_id)
        return len(ids)


def _copy(items: Any) -> list[Any]:
    """``list(items)``, retried while the executor thread changes it; [] where it cannot
    be copied (not iterable: that place is skipped, the others still count)."""
    for _ in range(5):
        try:
            return list(items)
        except RuntimeError:  # changed size during the copy
            continue
        except TypeError:
            return []
    return []


def _item_ids(items: Any) -> set[int]:
    """Ids of the normal requests among ``RequestQueueItem``s (sentinels left out)."""
    ids = set()
    for item in _copy(items):
        normal = getattr(item, "is_normal_request", None)
        request_id = getattr(item, "id", None)
        if isinstance(request_id, int) and (normal is True or (normal is None
                                                               and request_id >= 0)):
            ids.add(request_id)
    return ids


def held_request_ids(engine: Any) -> set[int]:
    """Engine ids of the requests one ``PyExecutor`` holds. Layouts as in
    :mod:`.executor_reader`; a place that cannot be read is skipped (what the other
    places hold is still cancelled)."""
    ids: set[int] = set()
    for request in _copy(getattr(engine, "active_requests", ())):
        if getattr(request, "is_attention_dp_dummy", False) is True:
            continue
        request_id = getattr(request, "py_request_id", None)
        if isinstance(request_id, int):
            ids.add(request_id)
    queue_obj = getattr(engine, "executor_request_queue", None)
    for holder in (engine, queue_obj):
        for name in ("waiting_queue", "request_accumulated"):
            ids |= _item_ids(getattr(holder, name, ()))
    raw = getattr(queue_obj, "request_queue", None)
    mutex = getattr(raw, "mutex", None)
    if mutex is not None:
        with mutex:  # the stdlib Queue's own lock: held for one list() copy
            items = list(raw.queue)  # type: ignore[union-attr]
        ids |= _item_ids(items)
    return ids
