"""Prometheus metrics of one worker's lifecycle (a face: nothing below it imports it).

:class:`WorkerMetrics` attaches to a :class:`~quiesce.lifecycle.Lifecycle` and keeps its
metrics in its own :class:`~prometheus_client.CollectorRegistry` (a fresh private one
unless one is passed), so several workers or tests in one process never collide.
:meth:`WorkerMetrics.render` returns the exposition for ``GET /metrics``.

Two kinds of source:

- **scrape**: read from :meth:`Lifecycle.status` and the admission gate by a custom
  collector at the moment of the scrape; no background task, never stale;
- **event**: fed by a lifecycle listener (:meth:`Lifecycle.add_listener`) as events
  happen; these only count what happened after the metrics were attached.

================================= ========= ======= ====== =========================================
Metric                            Type      Labels  Source Value
================================= ========= ======= ====== =========================================
quiesce_state                     gauge     state   scrape 1 for the current state, 0 for the other
                                                           three (serving, draining, drained,
                                                           stopping: all always present)
quiesce_generation                gauge             scrape lifecycle generation (every transition
                                                           bumps it)
quiesce_inflight_requests         gauge             scrape admitted requests whose response has not
                                                           finished
quiesce_accepting                 gauge             scrape 1 while the admission gate admits, else 0
quiesce_discovery_registered      gauge             scrape 1 while registered with discovery, 0 when
                                                           not, NaN when the backend does not know
quiesce_admitted_requests_total   counter           scrape the gate's admitted_total
quiesce_rejected_admissions_total counter           scrape the gate's refused_total (WorkerDraining
                                                           raised; never admitted)
quiesce_requests_ended_total      counter   outcome scrape admitted requests that ended, by outcome:
                                                           completed, lost, client_gone, rejected
                                                           (all always present)
quiesce_pending_work              gauge     kind    scrape each counter of the latest PendingWork:
                                                           waiting, running, kv_sends_held,
                                                           kv_recvs_awaited, then the engine's
                                                           queues by name; NaN where unknown
quiesce_pending_work_known        gauge             scrape 1 if that snapshot's verdict is not
                                                           unknown, else 0
quiesce_pending_work_age_seconds  gauge             scrape now − its observed_at (monotonic clock);
                                                           +Inf before the first reading
quiesce_drain_eta_seconds         gauge     bound   scrape that snapshot's drain ETA
                                                           (:mod:`quiesce.eta`): ``expected`` and
                                                           ``upper``; NaN when unknown, unbounded
                                                           or not estimated by the probe
quiesce_drain_cost                gauge             scrape the drain cost of that snapshot
                                                           (:mod:`quiesce.drain_cost`), ms: its
                                                           ETA, else a minute per request;
                                                           2^31-1 while the work is unknown
quiesce_drain_duration_seconds    histogram outcome event  a drain run's elapsed_s, observed on
                                                           drain_finished
quiesce_drain_outcomes_total      counter   outcome event  drain runs ended (drain_finished), by
                                                           outcome
quiesce_probe_reads_total         counter   verdict event  probe readings (probe_read), by verdict:
                                                           quiescent, busy or unknown
quiesce_probe_errors_total        counter           event  readings with a non-empty errors tuple
                                                           (the probe raised, hung or reported a
                                                           read failure)
quiesce_transitions_total         counter   to      event  state transitions (transition), by the
                                                           state entered
================================= ========= ======= ====== =========================================

``outcome`` is ``completed`` for a drain that reached ``drained``, otherwise the
:attr:`DrainReport.outcome` value (``timed_out``, ``unsupported``, ``cancelled``,
``failed``). ``quiesce_probe_reads_total{verdict="unknown"}`` also counts readings that
raised nothing but lack a counter the role needs; ``quiesce_probe_errors_total`` counts
only failed reads, so the two are not redundant. The event-fed families also carry
prometheus_client's ``*_created`` samples (when each series was created).

The latest pending work is the newer (by ``observed_at``) of the last ``probe_read``
event and the current drain run's last snapshot (which covers a drain started before
the metrics were attached).

Unknown counters are exported as NaN, not left out: many dashboards draw a missing
series as 0 (or ``sum()`` just skips it), and a worker whose engine cannot be read
must never look idle (the same fail-closed rule as :attr:`PendingWork.verdict`). Before
the first reading the four standard kinds are NaN and the age is +Inf, so an alert on
a stale reading (``age > N``) fires.

Use :meth:`render` from the worker's event loop (e.g. an ``async def`` route): the
collector reads plain attributes of the lifecycle, which is not thread-safe.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import prometheus_client
from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from quiesce.budget import Clock
from quiesce.drain import StageOutcome
from quiesce.drain_cost import drain_cost
from quiesce.lifecycle import EventKind, Lifecycle, LifecycleEvent, State
from quiesce.probe import COUNTERS, PendingWork, Verdict

__all__ = ["DRAIN_BUCKETS_S", "WorkerMetrics"]

DRAIN_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    900.0,
)
"""Drain duration buckets: an idle worker drains in milliseconds, a long generation or a
held KV transfer in minutes, and a Kubernetes grace period rarely exceeds 15 minutes."""

_DRAIN_OUTCOMES = tuple(o.value for o in StageOutcome if o is not StageOutcome.SKIPPED)
"""Outcomes a :class:`DrainReport` can have (a skipped stage never ends a run)."""


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


class _ScrapeCollector:
    """Reads the lifecycle at scrape time. Registered once per :class:`WorkerMetrics`."""

    def __init__(self, owner: WorkerMetrics) -> None:
        self._owner = owner

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so the registry can detect name clashes."""
        return self._families(with_samples=False)

    def collect(self) -> Iterator[Metric]:
        return self._families(with_samples=True)

    def _families(self, *, with_samples: bool) -> Iterator[Metric]:
        owner = self._owner
        state = GaugeMetricFamily("quiesce_state", "1 for the lifecycle's current state, "
                                  "0 for the others", labels=["state"])
        admitted = CounterMetricFamily("quiesce_admitted_requests_total",
                                       "Requests the admission gate accepted")
        rejected = CounterMetricFamily("quiesce_rejected_admissions_total",
                                       "Requests the closed admission gate refused "
                                       "(WorkerDraining)")
        ended = CounterMetricFamily("quiesce_requests_ended",
                                    "Admitted requests that ended, by outcome (lost: ended by "
                                    "the engine or the worker stopping)", labels=["outcome"])
        pending = GaugeMetricFamily("quiesce_pending_work", "Work the engine still holds, by "
                                    "kind, from the latest probe reading (NaN: unknown)",
                                    labels=["kind"])
        eta = GaugeMetricFamily("quiesce_drain_eta_seconds", "Seconds until the pending "
                                "work is done if nothing new arrives: the estimate and its "
                                "upper bound (NaN: unknown, unbounded or not estimated)",
                                labels=["bound"])
        docs = {
            "quiesce_generation": "Lifecycle generation, bumped by every transition",
            "quiesce_inflight_requests": "Admitted requests whose response has not finished",
            "quiesce_accepting": "1 while the admission gate accepts requests",
            "quiesce_discovery_registered": "1 while the worker is registered with discovery",
            "quiesce_pending_work_known": "1 if the latest probe reading's verdict is known",
            "quiesce_pending_work_age_seconds": "Seconds since the latest probe reading "
                                                "(+Inf before the first)",
            "quiesce_drain_cost": "What removing this worker now would cost, in milliseconds: "
                                  "the drain ETA, else a minute per request outstanding; "
                                  "2^31-1 while its work is unknown",
        }
        if not with_samples:
            yield state
            yield from (GaugeMetricFamily(name, doc) for name, doc in docs.items())
            yield from (admitted, rejected, ended, pending, eta)
            return

        status = owner.lifecycle.status()
        gate = owner.lifecycle.gate
        for candidate in State:
            state.add_metric([candidate.value], 1.0 if candidate is status.state else 0.0)
        yield state
        snapshot = owner.latest_pending_work(status.pending_work)
        if snapshot is None:
            known, age = 0.0, math.inf
            for kind in COUNTERS:
                pending.add_metric([kind], math.nan)
        else:
            known = 0.0 if snapshot.verdict is Verdict.UNKNOWN else 1.0
            age = max(0.0, owner.clock() - snapshot.observed_at)
            for kind, count in snapshot.counts().items():
                pending.add_metric([kind], float(count) if isinstance(count, int) else math.nan)
        values = {
            "quiesce_generation": float(status.generation),
            "quiesce_inflight_requests": float(status.inflight_requests),
            "quiesce_accepting": float(status.accepting),
            "quiesce_discovery_registered": (math.nan if status.discovery_registered is None
                                             else float(status.discovery_registered)),
            "quiesce_pending_work_known": known,
            "quiesce_pending_work_age_seconds": age,
            "quiesce_drain_cost": float(drain_cost(snapshot, status.inflight_requests).value),
        }
        yield from (_gauge(name, doc, values[name]) for name, doc in docs.items())
        admitted.add_metric([], float(gate.admitted_total))
        rejected.add_metric([], float(gate.refused_total))
        for outcome, count in gate.outcomes().to_dict().items():
            ended.add_metric([outcome], float(count))
        estimate = snapshot.eta if snapshot is not None else None
        bounds = ((None, None) if estimate is None
                  else (estimate.expected_s, estimate.upper_s))
        for bound, seconds in zip(("expected", "upper"), bounds, strict=True):
            eta.add_metric([bound], math.nan if seconds is None else float(seconds))
        yield from (admitted, rejected, ended, pending, eta)


class WorkerMetrics:
    """Prometheus metrics of one :class:`Lifecycle` (see the module docstring for the list).

    Attaching registers a lifecycle listener and a scrape-time collector in
    ``registry``; two instances on one registry would clash (``ValueError``), so pass
    none to get a private registry.
    """

    def __init__(self, lifecycle: Lifecycle,
                 registry: prometheus_client.CollectorRegistry | None = None, *,
                 clock: Clock = time.monotonic) -> None:
        """``clock`` must be the clock of :attr:`PendingWork.observed_at` (monotonic)."""
        self.lifecycle = lifecycle
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self.clock = clock
        self._last_pending_work: PendingWork | None = None
        self.drain_duration = Histogram(
            "quiesce_drain_duration_seconds", "Duration of drain runs, by outcome",
            ["outcome"], registry=self.registry, buckets=DRAIN_BUCKETS_S)
        self.drain_outcomes = Counter(
            "quiesce_drain_outcomes_total", "Drain runs ended, by outcome", ["outcome"],
            registry=self.registry)
        self.probe_reads = Counter(
            "quiesce_probe_reads_total", "Probe readings, by verdict", ["verdict"],
            registry=self.registry)
        self.probe_errors = Counter(
            "quiesce_probe_errors_total",
            "Probe readings that failed (the probe raised, hung or reported a read error)",
            registry=self.registry)
        self.transitions = Counter(
            "quiesce_transitions_total", "Lifecycle state transitions, by the state entered",
            ["to"], registry=self.registry)
        # Create every labelled child up front, so rate() sees a 0 before the first event.
        for outcome in _DRAIN_OUTCOMES:
            self.drain_duration.labels(outcome)
            self.drain_outcomes.labels(outcome)
        for verdict in Verdict:
            self.probe_reads.labels(verdict.value)
        for state in State:
            self.transitions.labels(state.value)
        self.registry.register(_ScrapeCollector(self))
        lifecycle.add_listener(self._on_event)

    def latest_pending_work(self, from_status: PendingWork | None) -> PendingWork | None:
        """The newer of the last ``probe_read`` snapshot and ``from_status`` (the drain's)."""
        seen = self._last_pending_work
        if seen is None:
            return from_status
        if from_status is None or seen.observed_at >= from_status.observed_at:
            return seen
        return from_status

    def render(self) -> tuple[bytes, str]:
        """The exposition of the registry and its content type, for ``GET /metrics``."""
        body = prometheus_client.generate_latest(self.registry)
        return body, prometheus_client.CONTENT_TYPE_LATEST

    def _on_event(self, event: LifecycleEvent) -> None:
        if event.kind is EventKind.TRANSITION:
            self.transitions.labels(event.state.value).inc()
        elif event.kind is EventKind.DRAIN_FINISHED and event.report is not None:
            outcome = event.report.outcome.value
            self.drain_duration.labels(outcome).observe(event.report.elapsed_s)
            self.drain_outcomes.labels(outcome).inc()
        elif event.kind is EventKind.PROBE_READ and event.pending_work is not None:
            snapshot = event.pending_work
            self._last_pending_work = snapshot
            self.probe_reads.labels(snapshot.verdict.value).inc()
            if snapshot.errors:
                self.probe_errors.inc()
