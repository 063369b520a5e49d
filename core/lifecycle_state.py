"""The lifecycle's vocabulary: its states, the events listeners get, a drain run's
handle and the status snapshot ``GET /engine/status`` shows.

Data only; :mod:`quiesce.lifecycle` owns the transitions between them.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable
from enum import Enum

from quiesce.admission import OutcomeCounts
from quiesce.drain import DrainReport, StageReport
from quiesce.drain_cost import DrainCost
from quiesce.probe import PendingWork

TREND_POINTS = 32
"""How many (elapsed, total pending) points the drain progress keeps."""


class State(str, Enum):
    SERVING = "serving"
    DRAINING = "draining"
    DRAINED = "drained"
    STOPPING = "stopping"


class EventKind(str, Enum):
    TRANSITION = "transition"
    DRAIN_FINISHED = "drain_finished"
    PROBE_READ = "probe_read"


@dataclasses.dataclass(frozen=True)
class LifecycleEvent:
    """What a listener is told: a state change, the end of a drain run, or a probe reading."""

    kind: EventKind
    state: State
    generation: int
    report: DrainReport | None = None
    pending_work: PendingWork | None = None


Listener = Callable[[LifecycleEvent], None]


@dataclasses.dataclass
class DrainRun:
    """Handle of one drain run. Waiting on it never cancels it."""

    generation: int
    budget_s: float | None
    started_at: float
    outcomes_at_start: OutcomeCounts = dataclasses.field(default_factory=OutcomeCounts)
    """The gate's outcome totals when the worker left serving for this run (for a retried
    run: for the first run since serving): what ended since counts against this run."""
    ended_at: float | None = None
    task: asyncio.Task[DrainReport] = dataclasses.field(init=False)
    stage: str = "unregister"
    stages: list[StageReport] = dataclasses.field(default_factory=list)
    last_pending_work: PendingWork | None = None
    trend: collections.deque[tuple[float, int | None]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=TREND_POINTS))
    report: DrainReport | None = None
    """The final report once the run ended (also when it was cancelled), else ``None``."""

    async def wait(self, timeout: float | None = None) -> DrainReport | None:
        """Wait up to ``timeout`` seconds for the run to end; ``None`` if it has not."""
        await asyncio.wait({self.task}, timeout=timeout)
        return self.report


@dataclasses.dataclass(frozen=True)
class Status:
    """What ``GET /engine/status`` shows.

    ``state == "drained"`` is the only deletion-safety signal; there is no second one.
    """

    state: State
    generation: int
    inflight_requests: int
    accepting: bool
    discovery_registered: bool | None
    """``None``: the backend does not know (a call that ran out of retries may or may
    not have reached the store; ``discovery_error`` says why)."""
    since: float
    seconds_in_state: float
    last_error: str | None
    pending_work: PendingWork | None
    drain: dict[str, object] | None
    last_drain: DrainReport | None
    requests: dict[str, object] = dataclasses.field(default_factory=dict)
    """``admitted_total``, ``refused_total`` (never admitted), ``ended_total`` (outcome
    counts since start) and ``ended_since_drain`` (since the current or last drain run
    began; ``None`` before the first)."""
    discovery_error: str | None = None
    drain_cost: DrainCost | None = None
    """What removing this worker now would cost (:mod:`quiesce.drain_cost`)."""

    def to_dict(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "generation": self.generation,
            "inflight_requests": self.inflight_requests,
            "accepting": self.accepting,
            "discovery_registered": self.discovery_registered,
            "discovery_error": self.discovery_error,
            "since": self.since,
            "seconds_in_state": round(self.seconds_in_state, 6),
            "last_error": self.last_error,
            "pending_work": self.pending_work.to_dict() if self.pending_work else None,
            "drain": self.drain,
            "last_drain": self.last_drain.to_dict() if self.last_drain else None,
            "requests": self.requests,
            "drain_cost": self.drain_cost.to_dict() if self.drain_cost else None,
        }
