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
- Zero readings are confirmed across calls (:class:`~.executor_reader.ZeroConfirmation`,
  one per engine in this process): a zero is reported unconfirmed (``unconfirmed`` set)
  until the executor loop went round since an earlier zero, or was parked on its empty
  request queue; where no iteration counter is readable, a second reading after
  :data:`~.executor_reader.CONFIRM_WAIT_S` (a short sleep on the actor's thread)
  confirms it.

Imports nothing from TensorRT-LLM; the class must be importable in the Ray workers'
environment (quiesce installed there).
"""

from __future__ import annotations

from typing import Any, Final

from quiesce.signal_guard import guard_process

from .executor_reader import (
    COUNTS,
    READING_VERSION,
    ZeroConfirmation,
    read_confirmed_blocking,
)

METHOD: Final = "quiesce_pending_work"
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
