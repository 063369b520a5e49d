"""The drain wait: event-driven admitted → 0, probe quiescence with backoff, outcomes."""

from __future__ import annotations

import asyncio

import pytest

from quiesce import AdmissionGate, ConfigError, PendingWork, Role, StageOutcome
from quiesce.adapters.sim import SimConfig, SimEngine, SimProbe, SimRequest
from quiesce.admission import Outcome
from quiesce.budget import Deadline
from quiesce.drain import (
    Backoff,
    DrainConfig,
    DrainReport,
    StageReport,
    wait_admitted_zero,
    wait_quiescent,
    wait_router_quiet,
)
from tests.unit.test_probe import FakeProbe

FAST = DrainConfig(router_grace_s=0, poll_base_s=0.001, poll_cap_s=0.004, probe_timeout_s=0.05)


def test_backoff_doubles_to_cap_and_resets() -> None:
    backoff = Backoff(0.001, 0.008)
    assert [backoff.next() for _ in range(6)] == [0.001, 0.002, 0.004, 0.008, 0.008, 0.008]
    backoff.reset()
    assert backoff.next() == 0.001


@pytest.mark.parametrize("field,value", [
    ("router_grace_s", -1), ("budget_s", -0.5), ("probe_timeout_s", 0), ("poll_base_s", 0),
    ("poll_cap_s", "fast"), ("heartbeat_s", float("nan")), ("budget_s", float("inf")),
])
def test_drain_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        DrainConfig(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field


def test_poll_cap_below_base_is_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        DrainConfig(poll_base_s=0.01, poll_cap_s=0.001)
    assert info.value.field == "poll_cap_s"


async def test_wait_admitted_zero_completes_on_release_and_times_out_otherwise() -> None:
    gate = AdmissionGate()
    admission = gate.admit()
    waiting = asyncio.create_task(wait_admitted_zero(gate, Deadline.after(None)))
    await asyncio.sleep(0)
    admission.finish(Outcome.COMPLETED)
    report = await asyncio.wait_for(waiting, timeout=5)
    assert report.outcome is StageOutcome.COMPLETED
    gate.admit()
    report = await wait_admitted_zero(gate, Deadline.after(0.01))
    assert report.outcome is StageOutcome.TIMED_OUT
    assert "1 admitted" in report.detail


async def test_wait_quiescent_polls_until_idle() -> None:
    probe = FakeProbe()
    probe.answer = PendingWork(role=Role.AGGREGATED, source="fake", waiting=0, running=1)

    seen: list[PendingWork] = []

    def progress(work: PendingWork) -> None:
        seen.append(work)
        if len(seen) == 3:  # the engine finishes after the third read
            probe.answer = PendingWork.idle(Role.AGGREGATED, "fake")

    report, last = await asyncio.wait_for(
        wait_quiescent(probe, Deadline.after(None), FAST, progress), timeout=10)
    assert report.outcome is StageOutcome.COMPLETED
    assert last.is_quiescent
    assert len(seen) == 4
    assert seen[0].running == 1


async def test_wait_quiescent_reports_timed_out_when_busy_and_unsupported_when_unknown() -> None:
    probe = FakeProbe()
    probe.answer = PendingWork(role=Role.AGGREGATED, source="fake", waiting=2, running=0)
    report, last = await wait_quiescent(probe, Deadline.after(0.02), FAST)
    assert report.outcome is StageOutcome.TIMED_OUT
    assert last.waiting == 2
    assert "waiting=2" in report.detail
    probe.error = RuntimeError("no scheduler")
    report, last = await wait_quiescent(probe, Deadline.after(0.02), FAST)
    assert report.outcome is StageOutcome.UNSUPPORTED
    assert "no scheduler" in report.detail


async def test_wait_quiescent_bounds_a_hanging_probe() -> None:
    probe = FakeProbe()
    probe.hang = True
    report, _ = await asyncio.wait_for(
        wait_quiescent(probe, Deadline.after(0.1), FAST), timeout=10)
    assert report.outcome is StageOutcome.UNSUPPORTED
    assert "did not answer" in report.detail


async def test_wait_quiescent_wakes_on_engine_events() -> None:
    """With the sim engine's change notification, the wait ends on the KV pull itself."""
    engine = SimEngine(SimConfig(decode_step_s=0.001, kv_pull_latency_s=(0.02, 0.02)))
    await engine.start()
    try:
        async for _ in engine.generate(SimRequest("r", max_tokens=2, remote_decode=True)):
            pass
        probe = SimProbe(engine, Role.PREFILL)
        slow_polling = DrainConfig(poll_base_s=10.0, poll_cap_s=10.0)
        report, last = await asyncio.wait_for(
            wait_quiescent(probe, Deadline.after(None), slow_polling), timeout=5)
        assert report.outcome is StageOutcome.COMPLETED
        assert last.kv_sends_held == 0
    finally:
        await engine.shutdown()


def test_drain_report_outcome_and_dict() -> None:
    stages = (StageReport("unregister", StageOutcome.COMPLETED, 0.1),
              StageReport("inflight", StageOutcome.TIMED_OUT, 1.0, "2 admitted"))
    report = DrainReport(3, stages, 1.1, drained=False)
    assert report.outcome is StageOutcome.TIMED_OUT
    data = report.to_dict()
    assert data["outcome"] == "timed_out"
    assert data["stages"][1]["detail"] == "2 admitted"  # type: ignore[index]
    assert DrainReport(3, stages[:1], 0.1, drained=True).outcome is StageOutcome.COMPLETED


async def test_router_quiet_keeps_the_gate_open_while_requests_keep_coming() -> None:
    """A router that has not seen the unregister still sends: the quiet period ends only
    once the requests stopped (an ordering, not a timing, assertion)."""
    gate = AdmissionGate()

    async def router_still_sending() -> None:
        for _ in range(10):
            gate.admit().finish(Outcome.COMPLETED)
            await asyncio.sleep(0.02)

    sender = asyncio.create_task(router_still_sending())
    await asyncio.sleep(0)
    await wait_router_quiet(gate, 0.2, Deadline.after(30.0))
    assert sender.done() and gate.admitted_total == 10
    assert gate.accepting  # it only waits: closing is the drain's next step


async def test_router_quiet_is_bounded_by_the_deadline_and_off_at_zero() -> None:
    gate = AdmissionGate()
    stop = asyncio.Event()

    async def never_quiet() -> None:
        while not stop.is_set():
            gate.admit().finish(Outcome.COMPLETED)
            await asyncio.sleep(0.01)

    sender = asyncio.create_task(never_quiet())
    try:
        await wait_router_quiet(gate, 10.0, Deadline.after(0.2))
        assert not sender.done()  # the deadline ended the wait, not a quiet gap
    finally:
        stop.set()
        await sender
    assert await wait_router_quiet(gate, 0.0, Deadline.after(30.0)) == 0.0
