"""Unit tests of :class:`quiesce.lifecycle.Lifecycle`: a drain run from serving to drained.

Admission during the router grace and after it, in-flight requests holding the run,
a request lost to an exception, drained published only on a known-zero probe read,
discovery failures during the drain, and a run that outlives the caller that started it.

Fakes (a scripted probe and discovery) and helpers: :mod:`tests.unit.lifecycle_harness`.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from quiesce import StageOutcome, Verdict, WorkerDraining
from quiesce.admission import Admission, Outcome
from quiesce.lifecycle import DrainRun, State
from tests.unit.lifecycle_harness import FAST, WAIT_S, Mode, Workers, at_stage, finished, until

STAGES = ("unregister", "router_grace", "close_admission", "inflight", "engine", "publish")


# -- serving → draining → drained ---------------------------------------------------


async def test_drain_admits_during_router_grace_then_publishes_drained(workers: Workers) -> None:
    h = await workers.new("zero")
    admitted: list[Admission] = []
    seen: list[tuple[str, bool]] = []
    errors: list[BaseException] = []

    def admit_in_grace() -> None:
        run = h.lc.current_run
        seen.append((run.stage if run is not None else "no run", h.gate.accepting))
        try:
            admitted.append(h.gate.admit("routed-before-unregister"))
        except Exception as exc:
            errors.append(exc)

    generation = h.lc.generation
    at_stage(h.lc, "router_grace", admit_in_grace)
    run = await h.lc.drain()
    assert h.lc.state is State.DRAINING
    assert run.generation == h.lc.generation == generation + 1
    assert run.budget_s is None

    await until(lambda: bool(seen), "the admission attempted in the grace window")
    assert errors == []
    assert seen == [("router_grace", True)]
    assert len(admitted) == 1 and h.gate.inflight == 1
    assert not h.discovery.registered

    # after the grace admission closes, but the admitted request keeps the run waiting
    await until(lambda: run.stage == "inflight", "the run to wait for in-flight requests")
    assert not h.gate.accepting
    assert h.lc.state is State.DRAINING
    assert h.probe.reads == 0  # the engine is not consulted before admitted reaches zero
    await asyncio.sleep(0.01)  # let the run do whatever it would
    assert h.lc.state is State.DRAINING and not run.task.done()

    admitted[0].finish(Outcome.COMPLETED)
    report = await finished(run)
    assert report.drained and report.outcome is StageOutcome.COMPLETED
    assert report.generation == run.generation
    assert [s.stage for s in report.stages] == list(STAGES)
    assert all(s.outcome is StageOutcome.COMPLETED for s in report.stages)
    assert h.lc.state is State.DRAINED
    assert h.lc.generation == generation + 2
    assert not h.gate.accepting and h.gate.inflight == 0
    assert h.lc.last_error is None
    assert h.gate.admitted_total == 1


async def test_admission_closed_after_grace_raises_worker_draining(workers: Workers) -> None:
    h = await workers.new("busy")
    run = await h.lc.drain()
    await until(lambda: not h.gate.accepting, "admission to close")
    rejected = h.gate.refused_total

    with pytest.raises(WorkerDraining) as info:
        h.gate.admit("too-late")
    assert info.value.retryable is True
    assert info.value.state == "draining"
    assert info.value.request_id == "too-late"
    assert h.gate.refused_total == rejected + 1
    assert h.gate.inflight == 0
    assert h.lc.state is State.DRAINING

    # still closed, and still counted, once drained
    h.probe.mode = "zero"
    assert (await finished(run)).drained
    with pytest.raises(WorkerDraining):
        h.gate.admit("after-drained")
    assert h.gate.refused_total == rejected + 2


async def test_unregistered_worker_skips_grace_and_closes_at_once(workers: Workers) -> None:
    h = await workers.new("zero", config=dataclasses.replace(FAST, router_grace_s=60.0),
                          start=False)
    assert not h.discovery.registered
    report = await finished(await h.lc.drain())
    assert report.drained
    grace = report.stages[1]
    assert grace.stage == "router_grace" and grace.outcome is StageOutcome.SKIPPED
    assert "was not registered" in grace.detail


async def test_drained_not_published_while_a_request_is_admitted(workers: Workers) -> None:
    h = await workers.new("zero")
    with h.gate.admit("long-generation") as admission:
        run = await h.lc.drain()
        await until(lambda: run.stage == "inflight", "the in-flight stage")
        await asyncio.sleep(0.02)
        assert h.lc.state is State.DRAINING
        assert h.lc.status().inflight_requests == 1
        admission.finish(Outcome.COMPLETED)
    report = await finished(run)
    assert report.drained
    assert report.requests.completed == 1 and report.requests.lost == 0
    assert h.lc.state is State.DRAINED


async def test_request_ended_by_an_exception_ends_the_drain_lost(workers: Workers) -> None:
    """An exception nobody mapped to an outcome is a loss: the run ends, never drained."""
    h = await workers.new("zero")
    release = asyncio.Event()

    async def request() -> None:
        async with h.gate.admit("fails"):
            await release.wait()
            raise RuntimeError("client disconnected")

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    assert h.gate.inflight == 1
    run = await h.lc.drain()
    await until(lambda: run.stage == "inflight", "the in-flight stage")
    release.set()
    with pytest.raises(RuntimeError, match="client disconnected"):
        await task
    report = await finished(run)
    assert not report.drained
    assert report.outcome is StageOutcome.LOST
    assert report.requests.lost == 1
    assert h.lc.state is State.DRAINING
    assert "1 admitted request(s) lost during the drain" in (h.lc.last_error or "")


@pytest.mark.parametrize(
    ("mode", "verdict", "reason"),
    [
        ("busy", Verdict.BUSY, None),
        ("unknown", Verdict.UNKNOWN, "metrics endpoint unavailable"),
        ("raise", Verdict.UNKNOWN, "probe raised RuntimeError: engine RPC failed"),
        ("hang", Verdict.UNKNOWN, "probe did not answer within"),
    ],
)
async def test_drained_not_published_until_the_probe_reads_known_zero(
        workers: Workers, mode: Mode, verdict: Verdict, reason: str | None) -> None:
    h = await workers.new(mode, config=dataclasses.replace(FAST, probe_timeout_s=0.01))
    run = await h.lc.drain()
    await h.probe.wait_reads(3)  # hence at least two answers were delivered
    assert h.lc.state is State.DRAINING
    assert run.stage == "engine" and not run.task.done()
    pending = h.lc.status().pending_work
    assert pending is not None and pending.verdict is verdict
    if reason is not None:
        assert any(reason in r for r in pending.reasons), pending.reasons
    progress = h.lc.status().to_dict()["drain"]
    assert isinstance(progress, dict) and progress["stage"] == "engine"

    h.probe.mode = "zero"
    report = await finished(run)
    assert report.drained
    assert report.last_pending_work is not None and report.last_pending_work.is_quiescent
    assert h.lc.state is State.DRAINED


# -- discovery failures during the drain ----------------------------------------------------


async def test_unregister_failure_is_reported_but_the_drain_goes_on(workers: Workers) -> None:
    h = await workers.new("zero")
    h.discovery.fail_unregister = ConnectionError("discovery down")
    report = await finished(await h.lc.drain())
    assert report.drained
    unregister = report.stages[0]
    assert unregister.stage == "unregister" and unregister.outcome is StageOutcome.FAILED
    assert "ConnectionError: discovery down" in unregister.detail
    assert h.lc.state is State.DRAINED and not h.gate.accepting


async def test_blocked_unregister_keeps_admitting_until_it_returns(workers: Workers) -> None:
    h = await workers.new("zero")
    h.discovery.unregister_gate = asyncio.Event()
    run = await h.lc.drain()
    await asyncio.wait_for(h.discovery.unregister_entered.wait(), WAIT_S)
    assert run.stage == "unregister" and h.lc.state is State.DRAINING
    h.gate.admit("routed-meanwhile").finish(Outcome.COMPLETED)
    h.discovery.unregister_gate.set()
    assert (await finished(run)).drained
    assert not h.discovery.registered


# -- the drain run outlives its caller ---------------------------------------------------


async def test_cancelling_the_caller_does_not_cancel_the_run(workers: Workers) -> None:
    h = await workers.new("busy")
    started: asyncio.Future[DrainRun] = asyncio.get_running_loop().create_future()

    async def admin_request() -> None:
        run = await h.lc.drain()
        started.set_result(run)
        await run.wait()  # the HTTP client hangs up while waiting

    caller = asyncio.create_task(admin_request())
    run = await asyncio.wait_for(started, WAIT_S)
    await h.probe.wait_reads(1)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not run.task.done()
    assert h.lc.state is State.DRAINING

    h.probe.mode = "zero"
    assert (await finished(run)).drained
    assert h.lc.state is State.DRAINED


async def test_waiting_with_a_timeout_does_not_cancel_the_run(workers: Workers) -> None:
    h = await workers.new("busy")
    run = await h.lc.drain()
    assert await run.wait(timeout=0.01) is None
    assert not run.task.done()
    h.probe.mode = "zero"
    assert (await finished(run)).drained
