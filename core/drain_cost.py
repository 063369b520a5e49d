"""How costly this worker is to drain right now: the figure a scale-down should minimise.

A ReplicaSet that scales down picks its victim by readiness, phase and age, so it
routinely drains the busiest worker while an idle one stays. A worker that publishes
its drain cost lets the platform (Kubernetes' ``pod-deletion-cost`` annotation, see
:mod:`quiesce.pod_deletion_cost`) or a planner (from ``GET /engine/status`` or the
``quiesce_drain_cost`` metric) remove the cheapest one instead.

:func:`drain_cost` is pure and costs nothing: it reads a probe snapshot the caller
already holds. The unit is **requests outstanding** (the work a drain must wait for):

- the probe's snapshot is known: the larger of its total and the admitted requests
  (a request admitted but not yet seen by the engine counts too) — ``source`` is
  ``pending_work``;
- the snapshot is unknown, missing or not yet read: the admitted requests alone,
  labelled ``source="inflight"`` with the reason, as a lower bound. A platform that
  wants to fail closed can treat that source as "do not prefer this victim".

The cost orders workers; it never decides whether one is drained.
"""

from __future__ import annotations

import dataclasses

from quiesce.probe import PendingWork, Verdict

INT32_MAX = 2**31 - 1
"""Kubernetes reads ``pod-deletion-cost`` as an int32."""


@dataclasses.dataclass(frozen=True)
class DrainCost:
    """A worker's drain cost: ``value`` in ``unit``, read from ``source``."""

    value: int
    source: str
    unit: str = "requests"
    reason: str | None = None
    """Why the weaker source was used (``source == "inflight"``), else ``None``."""

    def to_dict(self) -> dict[str, object]:
        return {"value": self.value, "unit": self.unit, "source": self.source,
                "reason": self.reason}


def drain_cost(pending: PendingWork | None, inflight: int) -> DrainCost:
    """The drain cost from the latest snapshot and the admitted requests in flight."""
    if pending is None:
        return DrainCost(min(inflight, INT32_MAX), "inflight",
                         reason="the engine has not been read yet")
    total = pending.total
    if pending.verdict is Verdict.UNKNOWN or total is None:
        why = "; ".join(pending.reasons) or "the engine's pending work is unknown"
        return DrainCost(min(inflight, INT32_MAX), "inflight", reason=why)
    return DrainCost(min(max(total, inflight), INT32_MAX), "pending_work")
