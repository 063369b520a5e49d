"""How costly this worker is to drain right now: the figure a scale-down should minimise.

A ReplicaSet that scales down picks its victim by readiness, phase and age, so it
routinely drains the busiest worker while an idle one stays. A worker that publishes
its drain cost lets the platform (Kubernetes' ``pod-deletion-cost`` annotation, see
:mod:`quiesce.admin.pod_deletion_cost`) or a planner (from ``GET /engine/status`` or the
``quiesce_drain_cost`` metric) remove the cheapest one instead.

:func:`drain_cost` is pure and costs nothing: it reads a probe snapshot the caller
already holds. The unit is **milliseconds of expected drain time**, so that workers
compare whatever their probe can tell:

- the snapshot carries a drain ETA (:mod:`quiesce.eta`) with a point estimate: that
  estimate, plus :data:`REQUEST_COST_MS` for each admitted request the engine has not
  counted yet — ``source`` is ``eta``;
- else the work is counted: the larger of the engine's count (the known counters, when
  some are unknown but the snapshot is busy anyway) and the admitted requests, each at
  :data:`REQUEST_COST_MS` — ``source`` is ``pending_work``;
- else (the snapshot is UNKNOWN, or not read yet): :data:`INT32_MAX`, the highest cost
  there is — ``source`` is ``unknown``. Fail closed: a worker whose work cannot be read
  may be holding KV a decoder still pulls, so it is never the preferred victim.

:data:`REQUEST_COST_MS` is deliberately long (a minute a request): a worker whose work
cannot be timed is never preferred over one whose estimate says it is nearly done, and
an idle worker (no work, cost 0) is always preferred. Between workers on the same
fallback it orders by requests, as counting would.

The cost orders workers; it never decides whether one is drained.
"""

from __future__ import annotations

import dataclasses
import math

from quiesce.probe import PendingWork, Verdict

INT32_MAX = 2**31 - 1
"""Kubernetes reads ``pod-deletion-cost`` as an int32 (24.8 days in milliseconds)."""
REQUEST_COST_MS = 60_000
"""What one request is assumed to cost when the probe gives no ETA: a minute."""


@dataclasses.dataclass(frozen=True)
class DrainCost:
    """A worker's drain cost: ``value`` milliseconds, read from ``source``."""

    value: int
    source: str
    reason: str | None = None
    """Why a weaker source than the ETA was used, else ``None``."""
    unit: str = "ms"

    def to_dict(self) -> dict[str, object]:
        return {"value": self.value, "unit": self.unit, "source": self.source,
                "reason": self.reason}


def _requests(count: int, source: str, reason: str) -> DrainCost:
    return DrainCost(min(count * REQUEST_COST_MS, INT32_MAX), source, reason)


def drain_cost(pending: PendingWork | None, inflight: int) -> DrainCost:
    """The drain cost from the latest snapshot and the admitted requests in flight."""
    if pending is None:
        return DrainCost(INT32_MAX, "unknown", "the engine has not been read yet")
    if pending.verdict is Verdict.UNKNOWN:
        why = "; ".join(pending.reasons) or "the engine's pending work is unknown"
        return DrainCost(INT32_MAX, "unknown", why)
    counted = sum(v for v in pending.counts().values() if isinstance(v, int))
    unseen = max(0, inflight - counted)  # admitted, not yet in the engine's counts
    eta = pending.eta
    if eta is not None and eta.expected_s is not None:
        value = math.ceil(eta.expected_s * 1000) + unseen * REQUEST_COST_MS
        return DrainCost(min(value, INT32_MAX), "eta")
    why = (f"no ETA: {eta.reason}" if eta is not None else
           f"{pending.source} gives no drain ETA")
    if pending.total is None:
        why += "; some counters are unknown, the known ones counted"
    return _requests(max(counted, inflight), "pending_work",
                     f"{why}; {REQUEST_COST_MS // 1000} s counted per request")
