"""The drain wait: admitted requests to zero, then the engine to quiescence.

Two stage functions, each bounded by one absolute :class:`~quiesce.budget.Deadline`
and each returning a :class:`StageReport`:

- :func:`wait_admitted_zero` wakes on the gate's zero event (no polling);
- :func:`wait_quiescent` reads the probe, then waits for the probe's change event
  where it offers one, otherwise polls with a short doubling backoff (1 ms up to
  8 ms, reset whenever the pending work changes). Never a fixed sleep.

The lifecycle strings these together with unregister, router grace and closing
admission (see :mod:`quiesce.lifecycle`). Nothing here changes worker state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from enum import Enum

from quiesce.admission import AdmissionGate, OutcomeCounts
from quiesce.budget import Clock, Deadline, check_seconds
from quiesce.errors import ConfigError
from quiesce.probe import (
    DEFAULT_PROBE_TIMEOUT_S,
    ChangeNotifier,
    PendingWork,
    QuiescenceProbe,
    Verdict,
    observe,
)

log = logging.getLogger("quiesce.drain")


class StageOutcome(str, Enum):
    """How a stage ended.

    ``unsupported``: the signal the stage needs could not be read (the probe was
    still unknown when time ran out); ``failed``: the stage's action raised;
    ``lost``: admitted requests ended lost (engine abort, engine death, forced path)
    during the run, so it can never be ``drained``.
    """

    COMPLETED = "completed"
    TIMED_OUT = "timed_out"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"
    UNSUPPORTED = "unsupported"
    FAILED = "failed"
    LOST = "lost"


@dataclasses.dataclass(frozen=True)
class StageReport:
    stage: str
    outcome: StageOutcome
    elapsed_s: float
    detail: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"stage": self.stage, "outcome": self.outcome.value,
                "elapsed_s": round(self.elapsed_s, 6), "detail": self.detail}


@dataclasses.dataclass(frozen=True)
class DrainReport:
    """What one drain run did: every stage in order, the last pending work it saw, and how
    the admitted requests that ended during the run ended (``requests``)."""

    generation: int
    stages: tuple[StageReport, ...]
    elapsed_s: float
    drained: bool
    last_pending_work: PendingWork | None = None
    requests: OutcomeCounts = dataclasses.field(default_factory=OutcomeCounts)

    @property
    def outcome(self) -> StageOutcome:
        """COMPLETED when drained; otherwise the outcome of the stage that stopped the run."""
        if self.drained:
            return StageOutcome.COMPLETED
        for stage in reversed(self.stages):
            if stage.outcome not in (StageOutcome.COMPLETED, StageOutcome.SKIPPED):
                return stage.outcome
        return StageOutcome.CANCELLED

    def to_dict(self) -> dict[str, object]:
        return {
            "generation": self.generation,
            "drained": self.drained,
            "outcome": self.outcome.value,
            "elapsed_s": round(self.elapsed_s, 6),
            "stages": [s.to_dict() for s in self.stages],
            "last_pending_work": (self.last_pending_work.to_dict()
                                  if self.last_pending_work else None),
            "requests": self.requests.to_dict(),
        }


@dataclasses.dataclass(frozen=True)
class DrainConfig:
    """Knobs of a drain run. Invalid values raise :class:`ConfigError` naming the field.

    ``router_grace_s``: after unregistering, keep admitting this long, because routers
    that already picked this worker are still sending. ``router_quiet_s``: then keep
    admitting until no request has been admitted for this long (0: off), because a
    router that has not seen the unregister yet is still sending: the grace ends on
    evidence (silence) rather than on a guess (:func:`wait_router_quiet`).
    ``budget_s``: default bound of an admin drain (``None``: until resumed).
    ``registration_timeout_s``: how long a resume waits for discovery (an unregister
    still running, then the registration) before it rolls back. ``heartbeat_s``: how
    often a long wait
    logs the pending work. ``poll_base_s``/``poll_cap_s``: the backoff between reads of
    probes that cannot notify (a notifying probe is also read again at least this
    often); the 8 ms cap keeps a polled vLLM probe within an engine step plus a few ms
    of the truth (``make bench``: ``bench/results/vllm.json``, ``detection_lag_snapshot``).
    """

    router_grace_s: float = 2.0
    router_quiet_s: float = 0.0
    budget_s: float | None = None
    registration_timeout_s: float = 10.0
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    poll_base_s: float = 0.001
    poll_cap_s: float = 0.008
    heartbeat_s: float = 5.0

    def __post_init__(self) -> None:
        check_seconds("router_grace_s", self.router_grace_s)
        check_seconds("router_quiet_s", self.router_quiet_s)
        check_seconds("budget_s", self.budget_s, allow_none=True)
        check_seconds("registration_timeout_s", self.registration_timeout_s,
                      allow_zero=False)
        check_seconds("probe_timeout_s", self.probe_timeout_s, allow_zero=False)
        check_seconds("poll_base_s", self.poll_base_s, allow_zero=False)
        check_seconds("poll_cap_s", self.poll_cap_s, allow_zero=False)
        check_seconds("heartbeat_s", self.heartbeat_s, allow_zero=False)
        if self.poll_cap_s < self.poll_base_s:
            raise ConfigError("poll_cap_s", f"{self.poll_cap_s}s is below poll_base_s")


class Backoff:
    """Intervals that start at ``base`` and double up to ``cap``; :meth:`reset` starts over."""

    __slots__ = ("_base", "_cap", "_next")

    def __init__(self, base: float, cap: float) -> None:
        self._base, self._cap, self._next = base, cap, base

    def next(self) -> float:
        current = self._next
        self._next = min(self._cap, current * 2)
        return current

    def reset(self) -> None:
        self._next = self._base


QUIET_POLL_S = 0.05
"""How often :func:`wait_router_quiet` looks at the gate's admission count."""


async def wait_router_quiet(gate: AdmissionGate, quiet_s: float, deadline: Deadline,
                            clock: Clock = time.monotonic) -> float:
    """Keep admitting until nothing has been admitted for ``quiet_s`` seconds (counted
    from the call at the earliest), bounded by ``deadline``; returns the time waited.

    Reads ``gate.admitted_total`` every :data:`QUIET_POLL_S`; changes nothing. A router
    that still sends after the unregister keeps the gate open; one with a gap longer
    than ``quiet_s`` between two requests meets a closed gate (the typed, retryable
    refusal) — the residual risk, which a longer ``quiet_s`` narrows.
    """
    start = last = clock()
    if quiet_s <= 0:
        return 0.0
    seen = gate.admitted_total
    while True:
        left = min(quiet_s - (clock() - last), deadline.remaining())
        if left <= 0:
            return clock() - start
        await asyncio.sleep(min(left, QUIET_POLL_S))
        if gate.admitted_total != seen:
            seen, last = gate.admitted_total, clock()


async def wait_admitted_zero(gate: AdmissionGate, deadline: Deadline,
                             clock: Clock = time.monotonic) -> StageReport:
    """Wait until nothing is admitted. Event-driven; bounded by ``deadline``."""
    start = clock()
    if gate.inflight == 0:
        return StageReport("inflight", StageOutcome.COMPLETED, 0.0)
    log.info("waiting for %d admitted request(s) to finish", gate.inflight)
    try:
        await asyncio.wait_for(gate.wait_idle(),
                               None if not deadline.bounded else deadline.remaining())
    except asyncio.TimeoutError:
        return StageReport("inflight", StageOutcome.TIMED_OUT, clock() - start,
                           f"{gate.inflight} admitted request(s) still running")
    return StageReport("inflight", StageOutcome.COMPLETED, clock() - start)


ProgressCallback = Callable[[PendingWork], None]


MIN_READ_S = 0.01
"""The shortest probe read worth starting: closer to the deadline the wait ends on what it
last saw, rather than on a read cut short (which would only say "unknown")."""


async def wait_quiescent(probe: QuiescenceProbe, deadline: Deadline, config: DrainConfig,
                         on_progress: ProgressCallback | None = None,
                         clock: Clock = time.monotonic) -> tuple[StageReport, PendingWork]:
    """Wait until the probe reports known-zero pending work, bounded by ``deadline``.

    Returns the stage report and the last snapshot read. At the deadline the outcome
    is ``timed_out`` if the engine was last known busy (the detail shows that work)
    and ``unsupported`` if the probe never gave a known answer (the detail gives the
    reasons).
    """
    start = clock()
    backoff = Backoff(config.poll_base_s, config.poll_cap_s)
    notifier: ChangeNotifier | None = probe if isinstance(probe, ChangeNotifier) else None
    last: PendingWork | None = None
    last_busy: PendingWork | None = None
    next_heartbeat = start + config.heartbeat_s
    while True:
        remaining = deadline.remaining()
        if last is not None and remaining < MIN_READ_S:
            return _at_deadline(last, last_busy, clock() - start), last
        snapshot = await observe(probe, min(config.probe_timeout_s, max(remaining, MIN_READ_S)))
        if on_progress is not None:
            on_progress(snapshot)
        if snapshot.verdict is Verdict.QUIESCENT:
            return StageReport("engine", StageOutcome.COMPLETED, clock() - start), snapshot
        if snapshot.verdict is Verdict.BUSY:
            last_busy = snapshot
        if not snapshot.same_work(last):
            backoff.reset()
            if last is None or snapshot.verdict is Verdict.UNKNOWN:
                log.info("engine not quiescent yet: %s", snapshot.summary())
        last = snapshot
        now = clock()
        if now >= next_heartbeat:
            log.info("still draining after %.1fs: %s", now - start, snapshot.summary())
            next_heartbeat = now + config.heartbeat_s
        remaining = deadline.remaining()
        if remaining <= 0:
            return _at_deadline(snapshot, last_busy, now - start), snapshot
        notifier = await _pause(notifier, snapshot, min(backoff.next(), remaining))


async def _pause(notifier: ChangeNotifier | None, snapshot: PendingWork,
                 seconds: float) -> ChangeNotifier | None:
    """Wait for a change (or ``seconds``); returns the notifier to use next time."""
    if notifier is None:
        await asyncio.sleep(seconds)
        return None
    try:
        await notifier.wait_for_change(snapshot, seconds)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a broken notifier degrades to polling
        log.warning("probe change notification failed (%s); polling instead", exc)
        return None
    return notifier


def _at_deadline(last: PendingWork, last_busy: PendingWork | None,
                 elapsed: float) -> StageReport:
    if last.verdict is Verdict.BUSY:
        return StageReport("engine", StageOutcome.TIMED_OUT, elapsed,
                           f"still pending: {last.summary()}")
    if last_busy is not None:  # the last read failed; the last answer said busy
        return StageReport("engine", StageOutcome.TIMED_OUT, elapsed,
                           f"still pending when last known: {last_busy.summary()}; "
                           f"last read: {'; '.join(last.reasons)}")
    return StageReport("engine", StageOutcome.UNSUPPORTED, elapsed, "; ".join(last.reasons))
