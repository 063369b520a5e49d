"""Unit tests of :class:`quiesce.admin.metrics.WorkerMetrics`: the exposition a scrape sees.

Each test builds a real :class:`Lifecycle` with an :class:`AdmissionGate` and an
:class:`InMemoryDiscovery`. The engine is the simulated one (:class:`SimEngine` and its
:class:`SimProbe`) where a real engine's answers are needed; :class:`FakeProbe` is a fake
for the answers the simulator cannot give (unknown counters, a probe that raises). The
exposition is parsed with prometheus_client's own parser. Nothing asserts how long
something took: every wait is on an event or bounded by ``WAIT_S``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Mapping

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from quiesce import (
    UNKNOWN,
    AdmissionGate,
    DrainConfig,
    DrainReport,
    InMemoryDiscovery,
    PendingWork,
    QuiescenceProbe,
    Role,
    StageOutcome,
    WorkerDraining,
)
from quiesce.adapters.sim import SimConfig, SimEngine, SimProbe, SimRequest
from quiesce.admin.metrics import DRAIN_BUCKETS_S, WorkerMetrics
from quiesce.admission import Outcome
from quiesce.drain_cost import INT32_MAX, REQUEST_COST_MS
from quiesce.eta import DrainEta
from quiesce.lifecycle import DrainRun, EventKind, Lifecycle, LifecycleEvent, State

WAIT_S = 5.0
"""Upper bound of every wait in this file; a healthy run needs milliseconds."""

FAST = DrainConfig(router_grace_s=0.01, probe_timeout_s=0.05, poll_base_s=0.001,
                   poll_cap_s=0.004)
SIM = SimConfig(decode_step_s=0.001, kv_pull_latency_s=(0.005, 0.01), kv_recv_latency_s=0.005)

FAMILIES = {
    "quiesce_state", "quiesce_generation", "quiesce_inflight_requests", "quiesce_accepting",
    "quiesce_discovery_registered", "quiesce_admitted_requests", "quiesce_rejected_admissions",
    "quiesce_pending_work", "quiesce_pending_work_known", "quiesce_pending_work_age_seconds",
    "quiesce_drain_duration_seconds", "quiesce_drain_outcomes", "quiesce_probe_reads",
    "quiesce_probe_errors", "quiesce_transitions", "quiesce_requests_ended",
    "quiesce_drain_cost", "quiesce_drain_eta_seconds",
}
"""Every family the module docstring lists (the parser drops counters' ``_total``)."""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class FakeProbe:
    """A fake standing in for an engine probe, for answers the simulator cannot give.

    Answers ``snapshot`` (built for the probe's role and source), or raises
    ``RuntimeError`` when ``snapshot`` is ``None``.
    """

    def __init__(self, snapshot: PendingWork | None = None) -> None:
        self.snapshot = snapshot

    @property
    def role(self) -> Role:
        return Role.AGGREGATED

    @property
    def source(self) -> str:
        return "fake"

    async def pending_work(self) -> PendingWork:
        if self.snapshot is None:
            raise RuntimeError("engine unreachable")
        return self.snapshot

    async def is_quiescent(self) -> bool:
        return (await self.pending_work()).is_quiescent


def busy(**queues: int) -> PendingWork:
    return PendingWork(Role.AGGREGATED, "fake", waiting=1, running=2, kv_sends_held=0,
                       kv_recvs_awaited=0, queues=queues)


def build(probe: QuiescenceProbe, instance: str = "w0") -> tuple[Lifecycle, WorkerMetrics]:
    lifecycle = Lifecycle(gate=AdmissionGate(), probe=probe,
                          discovery=InMemoryDiscovery(instance), config=FAST)
    return lifecycle, WorkerMetrics(lifecycle)


def scrape(metrics: WorkerMetrics) -> Samples:
    body, content_type = metrics.render()
    assert content_type == prometheus_client.CONTENT_TYPE_LATEST
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def states(samples: Samples) -> dict[str, float]:
    return {state.value: value(samples, "quiesce_state", state=state.value) for state in State}


def pending(samples: Samples) -> dict[str, float]:
    return {dict(key)["kind"]: v for (name, key), v in samples.items()
            if name == "quiesce_pending_work"}


def drain_samples(samples: Samples, outcome: str) -> Mapping[str, float]:
    return {
        "count": value(samples, "quiesce_drain_duration_seconds_count", outcome=outcome),
        "sum": value(samples, "quiesce_drain_duration_seconds_sum", outcome=outcome),
        "inf": value(samples, "quiesce_drain_duration_seconds_bucket", outcome=outcome,
                     le="+Inf"),
        "total": value(samples, "quiesce_drain_outcomes_total", outcome=outcome),
    }


async def finished(run: DrainRun) -> DrainReport:
    report = await run.wait(WAIT_S)
    assert report is not None, "the drain run did not end"
    return report


async def started(lifecycle: Lifecycle) -> None:
    """Wait until the drain run has started: its first step unregisters from discovery."""
    discovery = lifecycle.discovery
    assert isinstance(discovery, InMemoryDiscovery)
    unregistered = asyncio.Event()
    discovery.directory.watch(lambda _, registered: None if registered else unregistered.set())
    if discovery.registered:
        await asyncio.wait_for(unregistered.wait(), WAIT_S)


def on_probe_read(lifecycle: Lifecycle) -> asyncio.Event:
    """An event set at the lifecycle's next probe reading."""
    read = asyncio.Event()

    def listener(event: LifecycleEvent) -> None:
        if event.kind is EventKind.PROBE_READ:
            read.set()

    lifecycle.add_listener(listener)
    return read


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    sim = SimEngine(SIM)
    await sim.start()
    try:
        yield sim
    finally:
        await sim.shutdown()


async def test_render_lists_every_family_with_its_type(engine: SimEngine) -> None:
    _, metrics = build(SimProbe(engine))
    body, _ = metrics.render()
    families = {f.name: f.type for f in text_string_to_metric_families(body.decode())
                if not f.name.endswith("_created")}  # prometheus_client's creation times
    assert set(families) == FAMILIES
    assert families["quiesce_drain_duration_seconds"] == "histogram"
    assert families["quiesce_admitted_requests"] == "counter"
    assert families["quiesce_state"] == "gauge"
    samples = scrape(metrics)
    assert states(samples) == {"serving": 1, "draining": 0, "drained": 0, "stopping": 0}
    buckets = {dict(key)["le"] for (name, key) in samples
               if name == "quiesce_drain_duration_seconds_bucket"}
    assert {"0.01", "900.0", "+Inf"} <= buckets
    assert len(buckets) == len(DRAIN_BUCKETS_S) + 1
    # labelled event counters exist at zero before their first event
    assert value(samples, "quiesce_drain_outcomes_total", outcome="timed_out") == 0
    assert value(samples, "quiesce_probe_reads_total", verdict="busy") == 0
    assert value(samples, "quiesce_transitions_total", to="drained") == 0


async def test_state_flips_serving_draining_drained(engine: SimEngine) -> None:
    lifecycle, metrics = build(SimProbe(engine))
    await lifecycle.start()
    samples = scrape(metrics)
    assert value(samples, "quiesce_accepting") == 1
    assert value(samples, "quiesce_discovery_registered") == 1
    generation = value(samples, "quiesce_generation")

    held = lifecycle.gate.admit("r1")  # keeps the run in draining until released
    run = await lifecycle.drain()
    samples = scrape(metrics)
    assert states(samples) == {"serving": 0, "draining": 1, "drained": 0, "stopping": 0}
    assert value(samples, "quiesce_generation") == generation + 1
    assert value(samples, "quiesce_transitions_total", to="draining") == 1

    held.finish(Outcome.COMPLETED)
    report = await finished(run)
    assert report.drained
    samples = scrape(metrics)
    assert states(samples) == {"serving": 0, "draining": 0, "drained": 1, "stopping": 0}
    assert value(samples, "quiesce_generation") == generation + 2
    assert value(samples, "quiesce_transitions_total", to="drained") == 1
    assert value(samples, "quiesce_accepting") == 0
    assert value(samples, "quiesce_discovery_registered") == 0


async def test_inflight_follows_admissions(engine: SimEngine) -> None:
    lifecycle, metrics = build(SimProbe(engine))
    await lifecycle.start()
    first, second = lifecycle.gate.admit("a"), lifecycle.gate.admit("b")
    samples = scrape(metrics)
    assert value(samples, "quiesce_inflight_requests") == 2
    assert value(samples, "quiesce_admitted_requests_total") == 2
    first.finish(Outcome.COMPLETED)
    assert value(scrape(metrics), "quiesce_inflight_requests") == 1
    second.finish(Outcome.COMPLETED)
    samples = scrape(metrics)
    assert value(samples, "quiesce_inflight_requests") == 0
    assert value(samples, "quiesce_admitted_requests_total") == 2


async def test_rejected_counter_increases_after_admission_closes(engine: SimEngine) -> None:
    lifecycle, metrics = build(SimProbe(engine))
    await lifecycle.start()
    assert value(scrape(metrics), "quiesce_rejected_admissions_total") == 0
    await finished(await lifecycle.drain())
    for request_id in ("late-1", "late-2"):
        with pytest.raises(WorkerDraining):
            lifecycle.gate.admit(request_id)
    samples = scrape(metrics)
    assert value(samples, "quiesce_rejected_admissions_total") == 2
    assert value(samples, "quiesce_accepting") == 0


async def test_requests_ended_by_outcome_and_a_lost_drain(engine: SimEngine) -> None:
    lifecycle, metrics = build(SimProbe(engine))
    await lifecycle.start()
    samples = scrape(metrics)
    for outcome in Outcome:  # every series exists from the start
        assert value(samples, "quiesce_requests_ended_total", outcome=outcome.value) == 0
    lifecycle.gate.admit("a").finish(Outcome.COMPLETED)
    lifecycle.gate.admit("b").finish(Outcome.CLIENT_GONE)
    lost = lifecycle.gate.admit("c")
    run = await lifecycle.drain()
    lost.finish(Outcome.LOST)
    report = await finished(run)
    assert report.outcome is StageOutcome.LOST
    samples = scrape(metrics)
    assert value(samples, "quiesce_requests_ended_total", outcome="completed") == 1
    assert value(samples, "quiesce_requests_ended_total", outcome="client_gone") == 1
    assert value(samples, "quiesce_requests_ended_total", outcome="lost") == 1
    assert value(samples, "quiesce_requests_ended_total", outcome="rejected") == 0
    assert drain_samples(samples, "lost")["count"] == 1
    assert drain_samples(samples, "completed")["count"] == 0


async def test_completed_drain_feeds_histogram_and_outcomes(engine: SimEngine) -> None:
    lifecycle, metrics = build(SimProbe(engine))
    await lifecycle.start()
    tokens = [t async for t in engine.generate(SimRequest("r1", max_tokens=3))]
    assert tokens == [1, 2, 3]
    report = await finished(await lifecycle.drain())
    assert report.drained
    samples = scrape(metrics)
    completed = drain_samples(samples, "completed")
    assert completed["count"] == 1
    assert completed["inf"] == 1
    assert completed["total"] == 1
    assert completed["sum"] == pytest.approx(report.elapsed_s)
    assert drain_samples(samples, "timed_out")["count"] == 0
    # the drain's own probe readings count too, and its last one is the pending work
    assert value(samples, "quiesce_probe_reads_total", verdict="quiescent") >= 1
    assert pending(samples) == {"waiting": 0, "running": 0, "kv_sends_held": 0,
                                "kv_recvs_awaited": 0}
    assert value(samples, "quiesce_pending_work_known") == 1


async def test_timed_out_drain_feeds_histogram_and_outcomes(engine: SimEngine) -> None:
    """A prefill request whose decoder never pulls its KV keeps the engine busy."""
    lifecycle, metrics = build(SimProbe(engine, Role.PREFILL))
    await lifecycle.start()
    request = SimRequest("p1", max_tokens=1, remote_decode=True, never_pulled=True)
    assert [t async for t in engine.generate(request)] == [1]
    report = await finished(await lifecycle.drain(budget_s=0.1))
    assert not report.drained
    assert report.outcome.value == "timed_out"
    samples = scrape(metrics)
    timed_out = drain_samples(samples, "timed_out")
    assert timed_out == {"count": 1, "sum": pytest.approx(report.elapsed_s), "inf": 1,
                         "total": 1}
    assert drain_samples(samples, "completed")["count"] == 0
    assert states(samples)["draining"] == 1
    assert pending(samples)["kv_sends_held"] == 1
    assert value(samples, "quiesce_pending_work_known") == 1
    assert value(samples, "quiesce_probe_reads_total", verdict="busy") >= 1
    assert value(samples, "quiesce_probe_errors_total") == 0


async def test_resume_counts_a_cancelled_drain(engine: SimEngine) -> None:
    lifecycle, metrics = build(SimProbe(engine))
    await lifecycle.start()
    held = lifecycle.gate.admit("r1")
    run = await lifecycle.drain()
    await started(lifecycle)  # the held admission then keeps it draining
    await lifecycle.resume()
    held.finish(Outcome.COMPLETED)
    assert run.task.cancelled()  # a cancelled run's report is the lifecycle's last drain
    last = lifecycle.status().last_drain
    assert last is not None and last.outcome.value == "cancelled"
    samples = scrape(metrics)
    assert drain_samples(samples, "cancelled")["count"] == 1
    assert value(samples, "quiesce_transitions_total", to="serving") == 1
    assert states(samples)["serving"] == 1


async def test_resume_right_after_drain_counts_a_cancelled_drain(engine: SimEngine) -> None:
    lifecycle, metrics = build(SimProbe(engine))
    await lifecycle.start()
    run = await lifecycle.drain()
    await lifecycle.resume()
    assert run.task.done()
    assert run.report is not None and run.report.outcome.value == "cancelled"
    assert run.ended_at is not None
    assert drain_samples(scrape(metrics), "cancelled")["total"] == 1


async def test_probe_reads_by_verdict_after_read_status(engine: SimEngine) -> None:
    probe = FakeProbe(busy())
    lifecycle, metrics = build(probe)
    await lifecycle.read_status()
    await lifecycle.read_status()
    probe.snapshot = PendingWork(Role.AGGREGATED, "fake", waiting=0)  # running is unknown
    await lifecycle.read_status()
    probe.snapshot = PendingWork.idle(Role.AGGREGATED, "fake")
    await lifecycle.read_status()
    samples = scrape(metrics)
    assert value(samples, "quiesce_probe_reads_total", verdict="busy") == 2
    assert value(samples, "quiesce_probe_reads_total", verdict="unknown") == 1
    assert value(samples, "quiesce_probe_reads_total", verdict="quiescent") == 1
    # an unknown counter is not a failed read
    assert value(samples, "quiesce_probe_errors_total") == 0

    # the simulator's probe, read through a second lifecycle
    sim_lifecycle, sim_metrics = build(SimProbe(engine), "w1")
    status = await sim_lifecycle.read_status()
    assert status.pending_work is not None and status.pending_work.is_quiescent
    samples = scrape(sim_metrics)
    assert value(samples, "quiesce_probe_reads_total", verdict="quiescent") == 1
    assert value(samples, "quiesce_pending_work_known") == 1


async def test_probe_errors_count_a_raising_probe() -> None:
    probe = FakeProbe(None)
    lifecycle, metrics = build(probe)
    await lifecycle.read_status()
    samples = scrape(metrics)
    assert value(samples, "quiesce_probe_errors_total") == 1
    assert value(samples, "quiesce_probe_reads_total", verdict="unknown") == 1
    assert value(samples, "quiesce_pending_work_known") == 0
    assert all(math.isnan(v) for v in pending(samples).values())
    probe.snapshot = busy()
    await lifecycle.read_status()
    samples = scrape(metrics)
    assert value(samples, "quiesce_probe_errors_total") == 1
    assert value(samples, "quiesce_pending_work_known") == 1


async def test_unknown_counters_are_nan_and_not_known() -> None:
    snapshot = PendingWork(Role.AGGREGATED, "fake", waiting=0, running=UNKNOWN,
                           queues={"grammar": UNKNOWN, "offload": 0})
    lifecycle, metrics = build(FakeProbe(snapshot))
    admitted = [lifecycle.gate.admit(f"r{i}") for i in range(2)]
    await lifecycle.read_status()
    samples = scrape(metrics)
    work = pending(samples)
    # unknown engine work: never the preferred victim
    assert value(samples, "quiesce_drain_cost") == INT32_MAX
    for admission in admitted:
        admission.finish(Outcome.COMPLETED)
    assert set(work) == {"waiting", "running", "kv_sends_held", "kv_recvs_awaited", "grammar",
                         "offload"}
    assert work["waiting"] == 0 and work["offload"] == 0
    assert all(math.isnan(work[k]) for k in ("running", "kv_sends_held", "kv_recvs_awaited",
                                             "grammar"))
    assert value(samples, "quiesce_pending_work_known") == 0
    assert value(samples, "quiesce_probe_errors_total") == 0


async def test_engine_queues_are_kinds_and_busy_is_known() -> None:
    lifecycle, metrics = build(FakeProbe(busy(grammar=4)))
    await lifecycle.read_status()
    samples = scrape(metrics)
    assert pending(samples) == {"waiting": 1, "running": 2, "kv_sends_held": 0,
                                "kv_recvs_awaited": 0, "grammar": 4}
    assert value(samples, "quiesce_pending_work_known") == 1
    assert value(samples, "quiesce_drain_cost") == 7 * REQUEST_COST_MS  # no ETA: a minute each


async def test_before_any_reading_pending_work_is_unknown_and_infinitely_old() -> None:
    _, metrics = build(FakeProbe(busy()))
    samples = scrape(metrics)
    work = pending(samples)
    assert set(work) == {"waiting", "running", "kv_sends_held", "kv_recvs_awaited"}
    assert all(math.isnan(v) for v in work.values())
    assert value(samples, "quiesce_pending_work_known") == 0
    assert value(samples, "quiesce_pending_work_age_seconds") == math.inf


async def test_age_is_measured_on_the_given_clock() -> None:
    snapshot = busy()
    lifecycle = Lifecycle(gate=AdmissionGate(), probe=FakeProbe(snapshot),
                          discovery=InMemoryDiscovery("w0"), config=FAST)
    metrics = WorkerMetrics(lifecycle, clock=lambda: snapshot.observed_at + 7.5)
    await lifecycle.read_status()
    assert value(scrape(metrics), "quiesce_pending_work_age_seconds") == 7.5


async def test_a_drain_started_before_attaching_shows_its_last_snapshot() -> None:
    lifecycle = Lifecycle(gate=AdmissionGate(), probe=FakeProbe(busy()),
                          discovery=InMemoryDiscovery("w0"), config=FAST)
    await lifecycle.start()
    read = on_probe_read(lifecycle)
    run = await lifecycle.drain()
    await asyncio.wait_for(read.wait(), WAIT_S)
    assert run.last_pending_work is not None
    metrics = WorkerMetrics(lifecycle)
    samples = scrape(metrics)
    assert pending(samples)["running"] == 2
    assert value(samples, "quiesce_pending_work_known") == 1
    await lifecycle.stop()
    assert states(scrape(metrics))["stopping"] == 1


async def test_two_workers_do_not_collide(engine: SimEngine) -> None:
    first, first_metrics = build(SimProbe(engine), "w0")
    second, second_metrics = build(FakeProbe(busy()), "w1")
    assert first_metrics.registry is not second_metrics.registry
    await first.start()
    await second.start()
    await finished(await first.drain())
    with pytest.raises(WorkerDraining):
        first.gate.admit("late")
    second.gate.admit("kept")
    one, two = scrape(first_metrics), scrape(second_metrics)
    assert states(one)["drained"] == 1 and states(two)["serving"] == 1
    assert value(one, "quiesce_rejected_admissions_total") == 1
    assert value(two, "quiesce_rejected_admissions_total") == 0
    assert value(two, "quiesce_inflight_requests") == 1
    assert drain_samples(one, "completed")["count"] == 1
    assert drain_samples(two, "completed")["count"] == 0
    assert value(two, "quiesce_probe_reads_total", verdict="quiescent") == 0


def test_one_registry_holds_one_worker() -> None:
    registry = prometheus_client.CollectorRegistry()

    def lifecycle() -> Lifecycle:
        return Lifecycle(gate=AdmissionGate(), probe=FakeProbe(busy()),
                         discovery=InMemoryDiscovery("w"), config=FAST)

    metrics = WorkerMetrics(lifecycle(), registry)
    assert metrics.registry is registry
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        WorkerMetrics(lifecycle(), registry)


async def test_drain_eta_is_exported_and_nan_where_not_estimated() -> None:
    snapshot = dataclasses.replace(busy(), eta=DrainEta(2.5, None, "test", "no lease"))
    lifecycle, metrics = build(FakeProbe(snapshot))
    samples = scrape(metrics)
    assert math.isnan(value(samples, "quiesce_drain_eta_seconds", bound="expected"))
    await lifecycle.read_status()
    samples = scrape(metrics)
    assert value(samples, "quiesce_drain_eta_seconds", bound="expected") == 2.5
    assert math.isnan(value(samples, "quiesce_drain_eta_seconds", bound="upper"))
