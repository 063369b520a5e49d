"""quiesce's vLLM plugin: a detailed pending-work snapshot read inside EngineCore.

Registered on the ``vllm.general_plugins`` entry point, so vLLM calls :func:`register`
in every process it starts (frontend, EngineCore, workers). It only attaches one
method, ``EngineCore.quiesce_snapshot``, which the frontend calls as a utility:
``await engine.engine_core.call_utility_async("quiesce_snapshot")``.

Contract:

- inert unless called: nothing runs per engine step, no state is kept;
- read-only: it counts the scheduler's queues and held requests and never calls a
  connector method that reaps transfers;
- runs on EngineCore's busy-loop thread between two steps, so the snapshot is
  consistent; its cost is one pass over ``scheduler.requests``;
- a missing attribute (a vLLM version it does not know) is reported in the answer's
  ``error`` field instead of raising, and the probe turns it into UNKNOWN.

Imports nothing from quiesce beyond this module and nothing from vLLM at import time.
"""

from __future__ import annotations

from typing import Any

SNAPSHOT_METHOD = "quiesce_snapshot"
SNAPSHOT_VERSION = 1


def quiesce_snapshot(engine_core: Any) -> dict[str, Any]:
    """Counts from the scheduler: waiting, running, held for KV send, awaiting KV, push work.

    ``kv_sends_held`` counts finished requests still in ``scheduler.requests``: the
    scheduler deletes an entry only when its blocks are freed, so a finished entry is
    one whose KV is held for a remote reader (vLLM's delay-free path).
    """
    try:
        from vllm.v1.request import RequestStatus  # noqa: PLC0415 (only inside EngineCore)

        scheduler = engine_core.scheduler
        requests = scheduler.requests.values()
        held = sum(1 for r in requests if r.is_finished())
        receiving = sum(1 for r in requests if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        waiting = len(scheduler.waiting) + len(scheduler.kv_holding_waiting) - receiving
        connector = getattr(scheduler, "connector", None)
        push_work = bool(connector is not None and connector.has_pending_push_work())
        return {
            "version": SNAPSHOT_VERSION,
            "waiting": max(0, waiting),
            "running": len(scheduler.running),
            "kv_sends_held": held,
            "kv_recvs_awaited": receiving,
            "connector_push_work": int(push_work),
            "unflushed_finished": len(scheduler.finished_req_ids),
            "has_work": bool(engine_core.has_work())
            if hasattr(engine_core, "has_work") else bool(scheduler.has_requests()),
        }
    except Exception as exc:  # drift: answer with the reason, never raise into EngineCore
        return {"version": SNAPSHOT_VERSION, "error": f"{type(exc).__name__}: {exc}"}


def register() -> None:
    """Entry point of ``vllm.general_plugins``: attach :func:`quiesce_snapshot` to EngineCore.

    Idempotent, and harmless in processes that never run an EngineCore.
    """
    try:
        from vllm.v1.engine.core import EngineCore  # noqa: PLC0415 (vLLM is optional)
    except ImportError:  # a vLLM without the V1 engine: the probe falls back and says so
        return
    if getattr(EngineCore, SNAPSHOT_METHOD, None) is not quiesce_snapshot:
        setattr(EngineCore, SNAPSHOT_METHOD, quiesce_snapshot)
