"""Unit tests of :class:`quiesce.lifecycle.Lifecycle`: drain, resume, stop and status.

The engine is replaced by :class:`ScriptedProbe`, a fake whose answers each test sets,
and discovery by :class:`ScriptedDiscovery`, an ``InMemoryDiscovery`` whose calls can
fail or block. Nothing here asserts how long something took: every wait is on an event
or bounded by ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, cast

import pytest

from quiesce import (
    AdmissionGate,
    ConfigError,
    DrainConfig,
    InMemoryDiscovery,
    InvalidTransition,
    PendingWork,
    ResumeFailed,
    Role,
    StageOutcome,
    Verdict,
    WorkerDraining,
)
from quiesce.admission import Admission, Outcome
from quiesce.drain import DrainReport
from quiesce.lifecycle import DrainRun, Lifecycle, State

WAIT_S = 5.0
"""Upper bound of every wait in this file; a healthy run needs milliseconds."""

FAST = DrainConfig(router_grace_s=0.01, probe_timeout_s=0.05, poll_base_s=0.001,
                   poll_cap_s=0.004)

Mode = Literal["zero", "busy", "unknown", "raise", "hang"]

STAGES = ("unregister", "router_grace", "close_admission", "inflight", "engine", "publish")

STATUS_KEYS = {"state", "generation", "inflight_requests", "accepting", "discovery_registered",
               "since", "seconds_in_state", "last_error", "pending_work", "drain", "last_drain",
               "requests"}


class ScriptedProbe:
    """A fake standing in for an engine probe (the real engines are covered by their
    adapters' tests).

    ``mode`` decides every answer: ``zero`` (known idle), ``busy`` (waiting=1,
    running=2), ``unknown`` (an UNKNOWN snapshot with a reason), ``raise`` (the read
    raises) or ``hang`` (the read never answers, so ``observe`` times it out).
    :meth:`block` makes reads wait for :meth:`unblock` before answering; a
    ``stubborn`` block also swallows cancellation (a probe that breaks its contract).
    """

    def __init__(self, mode: Mode = "zero", role: Role = Role.AGGREGATED) -> None:
        self._role = role
        self.mode: Mode = mode
        self.reads = 0
        self.cancels_ignored = 0
        self.blocked = asyncio.Event()
        self._release: asyncio.Event | None = None
        self._stubborn = False
        self._read = asyncio.Event()

    @property
    def role(self) -> Role:
        return self._role

    @property
    def source(self) -> str:
        return "scripted"

    def block(self, *, stubborn: bool = False) -> None:
        self._release = asyncio.Event()
        self._stubborn = stubborn

    def unblock(self) -> None:
        if self._release is not None:
            self._release.set()

    async def pending_work(self) -> PendingWork:
        self.reads += 1
        self._read.set()
        release = self._release
        if release is not None and not release.is_set():
            self.blocked.set()
            while not release.is_set():
                try:
                    await asyncio.shield(release.wait())
                except asyncio.CancelledError:
                    if not self._stubborn:
                        raise
                    self.cancels_ignored += 1
        if self.mode == "zero":
            return PendingWork.idle(self.role, self.source)
        if self.mode == "busy":
            return PendingWork(self.role, self.source, waiting=1, running=2, kv_sends_held=0,
                               kv_recvs_awaited=0)
        if self.mode == "unknown":
            return PendingWork.unknown(self.role, self.source, "metrics endpoint unavailable")
        if self.mode == "raise":
            raise RuntimeError("engine RPC failed")
        await asyncio.Event().wait()  # hang: never answers
        raise AssertionError("unreachable")

    async def is_quiescent(self) -> bool:
        return (await self.pending_work()).is_quiescent

    async def wait_reads(self, count: int) -> None:
        """Return once ``count`` reads have started in total."""

        async def reads() -> None:
            while self.reads < count:
                self._read.clear()
                await self._read.wait()

        await asyncio.wait_for(reads(), WAIT_S)


class ScriptedDiscovery(InMemoryDiscovery):
    """An in-memory discovery whose register/unregister can fail or block on an event."""

    def __init__(self) -> None:
        super().__init__("worker-0")
        self.fail_register: Exception | None = None
        self.fail_unregister: Exception | None = None
        self.register_gate: asyncio.Event | None = None
        self.unregister_gate: asyncio.Event | None = None
        self.register_entered = asyncio.Event()
        self.unregister_entered = asyncio.Event()
        self.register_calls = 0
        self.unregister_calls = 0

    async def register(self) -> None:
        self.register_calls += 1
        self.register_entered.set()
        if self.register_gate is not None:
            await self.register_gate.wait()
        if self.fail_register is not None:
            raise self.fail_register
        await super().register()

    async def unregister(self) -> None:
        self.unregister_calls += 1
        self.unregister_entered.set()
        if self.unregister_gate is not None:
            await self.unregister_gate.wait()
        if self.fail_unregister is not None:
            raise self.fail_unregister
        await super().unregister()


class WallClock:
    """A settable wall clock, so that ``since`` can be compared exactly."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Harness:
    lc: Lifecycle
    probe: ScriptedProbe
    discovery: ScriptedDiscovery
    gate: AdmissionGate
    wall: WallClock


class Workers:
    """Builds lifecycles for a test and stops every one of them afterwards."""

    def __init__(self) -> None:
        self.made: list[Harness] = []

    async def new(self, mode: Mode = "zero", *, config: DrainConfig = FAST,
                  start: bool = True) -> Harness:
        probe = ScriptedProbe(mode)
        discovery = ScriptedDiscovery()
        gate = AdmissionGate()
        wall = WallClock()
        lc = Lifecycle(gate=gate, probe=probe, discovery=discovery, config=config,
                       wall_clock=wall)
        if start:
            await lc.start()
        harness = Harness(lc, probe, discovery, gate, wall)
        self.made.append(harness)
        return harness

    async def close(self) -> None:
        for h in self.made:
            h.probe.unblock()
            for gate in (h.discovery.register_gate, h.discovery.unregister_gate):
                if gate is not None:
                    gate.set()
            await asyncio.wait_for(h.lc.stop(), WAIT_S)


@pytest.fixture
async def workers() -> AsyncIterator[Workers]:
    made = Workers()
    yield made
    await made.close()


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Wait (bounded) until ``predicate`` holds, checking once per millisecond."""

    async def poll() -> None:
        for _ in range(int(WAIT_S * 10_000)):
            if predicate():
                return
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), WAIT_S)
    assert predicate(), f"timed out waiting for {what}"


async def finished(run: DrainRun) -> DrainReport:
    """The run's report once it ended (fails if it does not end within WAIT_S)."""
    report = await run.wait(WAIT_S)
    assert report is not None, f"drain run ended cancelled or not within {WAIT_S}s"
    return report


def at_stage(lc: Lifecycle, stage: str, action: Callable[[], None]) -> None:
    """Call ``action`` on the first loop iteration in which the current run is in ``stage``.

    Checked once per iteration from a callback that re-queues itself, so it runs before
    any timer that the run armed in that stage (e.g. the end of the router grace).
    """
    loop = asyncio.get_running_loop()

    def check(tries: int) -> None:
        run = lc.current_run
        if run is not None and run.stage == stage:
            action()
        elif tries:
            loop.call_soon(check, tries - 1)

    loop.call_soon(check, 100_000)


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


# -- budgets -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "outcome", "detail"),
    [
        ("busy", StageOutcome.TIMED_OUT, "still pending: busy"),
        ("unknown", StageOutcome.UNSUPPORTED, "metrics endpoint unavailable"),
        ("raise", StageOutcome.UNSUPPORTED, "probe raised RuntimeError"),
    ],
)
async def test_drain_budget_running_out_reports_and_stays_draining(
        workers: Workers, mode: Mode, outcome: StageOutcome, detail: str) -> None:
    h = await workers.new(mode)
    run = await h.lc.drain(budget_s=0.05)
    assert run.budget_s == 0.05
    report = await finished(run)
    assert not report.drained
    assert report.outcome is outcome
    assert report.stages[-1].stage == "engine"
    assert detail in report.stages[-1].detail

    assert h.lc.state is State.DRAINING
    assert not h.gate.accepting
    error = h.lc.last_error
    assert error is not None
    assert f"engine {outcome.value}" in error and detail in error

    status = h.lc.status().to_dict()
    assert status["state"] == "draining"
    assert status["last_error"] == error
    assert status["drain"] is None  # no run in progress any more
    last = status["last_drain"]
    assert isinstance(last, dict)
    assert last["drained"] is False and last["outcome"] == outcome.value


async def test_drain_budget_running_out_with_a_request_admitted(workers: Workers) -> None:
    h = await workers.new("zero")
    with h.gate.admit("never-finishes"):
        report = await finished(await h.lc.drain(budget_s=0.05))
    assert not report.drained
    assert report.outcome is StageOutcome.TIMED_OUT
    assert report.stages[-1].stage == "inflight"
    assert h.probe.reads == 0
    assert h.lc.state is State.DRAINING
    error = h.lc.last_error
    assert error is not None and "inflight timed_out: 1 admitted request(s)" in error


async def test_budget_spent_by_router_grace_still_drains_an_idle_worker(
        workers: Workers) -> None:
    # Regression: with no budget left the in-flight stage used wait_for(..., 0), which
    # never starts the wait and reported "0 admitted request(s) still running".
    h = await workers.new("zero", config=dataclasses.replace(FAST, router_grace_s=0.05))
    report = await finished(await h.lc.drain(budget_s=0.02))
    assert report.drained, report.to_dict()
    assert h.lc.state is State.DRAINED


async def test_zero_budget_drain_still_unregisters(workers: Workers) -> None:
    # Regression: with no budget left, wait_for(unregister(), 0) never started unregister().
    h = await workers.new("zero")
    report = await finished(await h.lc.drain(budget_s=0.0))
    assert report.drained, report.to_dict()
    await until(lambda: not h.discovery.registered, "the unregistration")
    assert h.discovery.unregister_calls == 1


async def test_resume_waits_for_a_late_unregister_before_registering(
        workers: Workers) -> None:
    h = await workers.new("busy")
    h.discovery.unregister_gate = asyncio.Event()
    run = await h.lc.drain(budget_s=0.02)
    report = await finished(run)
    unregister = report.stages[0]
    assert unregister.stage == "unregister" and unregister.outcome is StageOutcome.TIMED_OUT
    assert h.discovery.registered  # the unregistration is still pending

    resume = asyncio.create_task(h.lc.resume())
    await until(lambda: h.lc.state is State.SERVING, "resume to reopen")
    assert h.gate.accepting and not resume.done()
    h.discovery.unregister_gate.set()  # the late unregistration lands now
    await asyncio.wait_for(resume, WAIT_S)
    assert h.discovery.registered, "a late unregister undid the resume's registration"
    assert h.discovery.register_calls == 2


@pytest.mark.parametrize("budget", [-1.0, -1e-9, math.nan, math.inf, -math.inf, "10", True])
async def test_invalid_budget_raises_config_error_and_changes_nothing(
        workers: Workers, budget: object) -> None:
    h = await workers.new("zero")
    generation = h.lc.generation
    with pytest.raises(ConfigError) as info:
        await h.lc.drain(budget_s=cast(Any, budget))
    assert info.value.field == "budget_s"
    assert "budget_s" in str(info.value)
    assert h.lc.state is State.SERVING
    assert h.lc.generation == generation
    assert h.lc.current_run is None
    assert h.gate.accepting and h.discovery.registered
    assert h.discovery.unregister_calls == 0


async def test_invalid_budget_while_draining_keeps_the_current_run(workers: Workers) -> None:
    h = await workers.new("busy")
    run = await h.lc.drain()
    generation = h.lc.generation
    with pytest.raises(ConfigError, match="budget_s"):
        await h.lc.drain(budget_s=-5.0)
    assert h.lc.current_run is run and not run.task.done()
    assert h.lc.generation == generation and h.lc.state is State.DRAINING


# -- idempotence and invalid transitions ----------------------------------------------


async def test_double_drain_returns_the_same_run(workers: Workers) -> None:
    h = await workers.new("busy")
    run = await h.lc.drain()
    generation = h.lc.generation
    again = await h.lc.drain(budget_s=1.0)
    assert again is run
    assert again.budget_s is None  # the first drain's budget is kept
    assert h.lc.generation == generation and h.lc.state is State.DRAINING
    assert not run.task.done()


async def test_drain_after_drained_returns_the_finished_run(workers: Workers) -> None:
    h = await workers.new("zero")
    run = await h.lc.drain()
    assert (await finished(run)).drained
    generation = h.lc.generation
    again = await h.lc.drain(budget_s=3.0)
    assert again is run and again.task.done()
    report = again.report
    assert report is not None and report.drained
    assert h.lc.state is State.DRAINED and h.lc.generation == generation


async def test_drain_while_stopping_is_an_invalid_transition(workers: Workers) -> None:
    h = await workers.new("zero")
    await h.lc.stop()
    generation = h.lc.generation
    with pytest.raises(InvalidTransition) as info:
        await h.lc.drain()
    assert info.value.operation == "drain" and info.value.state == "stopping"
    assert h.lc.state is State.STOPPING
    assert h.lc.generation == generation
    assert h.lc.current_run is None
    assert h.discovery.unregister_calls == 0


async def test_stop_is_idempotent_and_cancels_the_run(workers: Workers) -> None:
    h = await workers.new("busy")
    run = await h.lc.drain()
    await h.probe.wait_reads(1)
    await h.lc.stop()
    assert h.lc.state is State.STOPPING
    assert run.task.cancelled()
    assert run.report is not None and run.report.outcome is StageOutcome.CANCELLED
    assert not h.gate.accepting
    with pytest.raises(WorkerDraining) as info:
        h.gate.admit()
    assert info.value.state == "stopping"

    generation = h.lc.generation
    await h.lc.stop()
    assert h.lc.state is State.STOPPING and h.lc.generation == generation

    with pytest.raises(InvalidTransition) as resume_info:
        await h.lc.resume()
    assert resume_info.value.operation == "resume"
    with pytest.raises(InvalidTransition):
        await h.lc.start()
    assert h.lc.state is State.STOPPING and h.lc.generation == generation
    assert not h.gate.accepting


async def test_stop_from_serving(workers: Workers) -> None:
    h = await workers.new("zero")
    await h.lc.stop()
    await h.lc.stop()
    assert h.lc.state is State.STOPPING and h.lc.generation == 1
    assert h.lc.current_run is None and not h.gate.accepting


# -- resume ----------------------------------------------------------------------------


async def test_resume_while_serving_is_a_no_op(workers: Workers) -> None:
    h = await workers.new("zero")
    generation = h.lc.generation
    calls = h.discovery.register_calls
    await h.lc.resume()
    assert h.lc.state is State.SERVING
    assert h.lc.generation == generation
    assert h.discovery.register_calls == calls
    assert h.gate.accepting and h.discovery.registered


@pytest.mark.parametrize("where", ["router_grace", "engine"])
async def test_resume_from_draining_cancels_the_run_and_serves(
        workers: Workers, where: str) -> None:
    grace = 60.0 if where == "router_grace" else FAST.router_grace_s
    h = await workers.new("busy", config=dataclasses.replace(FAST, router_grace_s=grace))
    run = await h.lc.drain()
    await until(lambda: run.stage == where, f"the {where} stage")
    generation = h.lc.generation

    await h.lc.resume()
    assert h.lc.state is State.SERVING
    assert h.lc.generation == generation + 1
    assert h.gate.accepting
    assert h.discovery.registered
    assert run.task.cancelled()
    assert run.report is not None and run.report.outcome is StageOutcome.CANCELLED
    assert not run.report.drained
    assert h.lc.last_error is None
    last = h.lc.status().last_drain
    assert last is not None and last.generation == run.generation
    assert last.outcome is StageOutcome.CANCELLED
    h.gate.admit("after-resume").finish(Outcome.COMPLETED)

    # a later drain is a new run of a new generation
    fresh = await h.lc.drain()
    assert fresh is not run and fresh.generation == generation + 2
    assert h.lc.state is State.DRAINING and not fresh.task.done()


async def test_resume_from_drained_serves_again(workers: Workers) -> None:
    h = await workers.new("zero")
    run = await h.lc.drain()
    assert (await finished(run)).drained
    generation = h.lc.generation
    await h.lc.resume()
    assert h.lc.state is State.SERVING
    assert h.lc.generation == generation + 1
    assert h.gate.accepting and h.discovery.registered
    assert h.discovery.register_calls == 2
    report = run.report
    assert report is not None and report.drained  # it had finished; nothing to cancel
    h.gate.admit("after-resume").finish(Outcome.COMPLETED)


async def test_drain_after_a_run_that_ran_out_of_budget_starts_a_fresh_run(
        workers: Workers) -> None:
    h = await workers.new("busy")
    run = await h.lc.drain(budget_s=0.02)
    assert not (await finished(run)).drained
    generation = h.lc.generation
    h.probe.mode = "zero"
    retry = await h.lc.drain()
    assert retry is not run
    assert retry.generation == h.lc.generation == generation + 1
    assert h.lc.last_error is None
    assert (await finished(retry)).drained
    assert h.lc.state is State.DRAINED


async def test_resume_after_a_run_that_ran_out_of_budget(workers: Workers) -> None:
    h = await workers.new("busy")
    assert not (await finished(await h.lc.drain(budget_s=0.02))).drained
    assert h.lc.last_error is not None
    await h.lc.resume()
    assert h.lc.state is State.SERVING and h.gate.accepting
    assert h.lc.last_error is None


async def test_stale_run_cannot_publish_drained_after_resume(workers: Workers) -> None:
    h = await workers.new("zero")
    h.probe.block()
    run = await h.lc.drain()
    await asyncio.wait_for(h.probe.blocked.wait(), WAIT_S)
    assert h.lc.state is State.DRAINING

    await h.lc.resume()
    generation = h.lc.generation
    h.probe.unblock()  # the probe would now say "zero"
    await asyncio.sleep(0.02)  # give a stale run every chance to publish
    assert h.lc.state is State.SERVING
    assert h.lc.generation == generation
    assert run.task.done()
    assert run.report is not None and not run.report.drained
    assert run.report.outcome is StageOutcome.CANCELLED
    assert h.gate.accepting and h.discovery.registered


async def test_stale_run_with_a_probe_that_ignores_cancellation(workers: Workers) -> None:
    h = await workers.new("zero")
    h.probe.block(stubborn=True)
    run = await h.lc.drain()
    await asyncio.wait_for(h.probe.blocked.wait(), WAIT_S)

    resume = asyncio.create_task(h.lc.resume())
    await until(lambda: h.probe.cancels_ignored >= 1, "the run to be cancelled")
    # resume joins the run before anything else: nothing has changed yet
    assert not resume.done()
    assert h.lc.state is State.DRAINING and not h.gate.accepting

    h.probe.unblock()  # the probe now answers "zero" to a cancelled run
    await asyncio.wait_for(resume, WAIT_S)
    assert h.lc.state is State.SERVING
    assert h.gate.accepting and h.discovery.registered
    assert run.task.done()
    generation = h.lc.generation
    await asyncio.sleep(0.01)
    assert h.lc.state is State.SERVING and h.lc.generation == generation


async def test_resume_whose_registration_fails_drains_again(workers: Workers) -> None:
    h = await workers.new("busy")
    run = await h.lc.drain()
    await h.probe.wait_reads(1)
    h.discovery.fail_register = RuntimeError("etcd unavailable")
    generation = h.lc.generation

    with pytest.raises(ResumeFailed, match="etcd unavailable"):
        await h.lc.resume()
    assert h.lc.state is State.DRAINING
    assert not h.gate.accepting
    assert not h.discovery.registered
    assert run.task.cancelled()
    fresh = h.lc.current_run
    assert fresh is not None and fresh is not run
    assert fresh.generation == h.lc.generation == generation + 2  # serving, then draining
    error = h.lc.last_error
    assert error is not None
    assert "resume failed" in error and "RuntimeError: etcd unavailable" in error
    assert h.lc.status().to_dict()["last_error"] == error
    with pytest.raises(WorkerDraining):
        h.gate.admit()

    # the fresh run converges to drained only through the verified path
    await h.probe.wait_reads(h.probe.reads + 2)
    assert h.lc.state is State.DRAINING
    h.probe.mode = "zero"
    assert (await finished(fresh)).drained
    assert h.lc.state is State.DRAINED

    # and once discovery works again the worker can serve
    h.discovery.fail_register = None
    await h.lc.resume()
    assert h.lc.state is State.SERVING and h.discovery.registered and h.gate.accepting


async def test_resume_admits_before_registration_completes(workers: Workers) -> None:
    h = await workers.new("zero")
    assert (await finished(await h.lc.drain())).drained
    h.discovery.register_gate = asyncio.Event()
    h.discovery.register_entered.clear()
    resume = asyncio.create_task(h.lc.resume())
    await asyncio.wait_for(h.discovery.register_entered.wait(), WAIT_S)
    assert h.lc.state is State.SERVING
    assert h.gate.accepting and not h.discovery.registered
    h.gate.admit("early").finish(Outcome.COMPLETED)
    h.discovery.register_gate.set()
    await asyncio.wait_for(resume, WAIT_S)
    assert h.discovery.registered


BOUNDED_RESUME = dataclasses.replace(FAST, registration_timeout_s=0.05)


async def test_resume_behind_a_hanging_unregister_rolls_back_in_time(workers: Workers) -> None:
    h = await workers.new("busy", config=BOUNDED_RESUME)
    h.discovery.unregister_gate = asyncio.Event()  # discovery never confirms
    run = await h.lc.drain()
    await asyncio.wait_for(h.discovery.unregister_entered.wait(), WAIT_S)
    registrations = h.discovery.register_calls
    with pytest.raises(ResumeFailed, match="unregister still runs"):
        await asyncio.wait_for(h.lc.resume(), WAIT_S)
    assert h.lc.state is State.DRAINING and not h.gate.accepting
    assert h.discovery.register_calls == registrations  # never behind a pending unregister
    assert h.lc.current_run is not None and h.lc.current_run is not run


async def test_resume_with_a_registration_that_never_returns_rolls_back(
        workers: Workers) -> None:
    h = await workers.new("zero", config=BOUNDED_RESUME)
    assert (await finished(await h.lc.drain())).drained
    h.discovery.register_gate = asyncio.Event()
    with pytest.raises(ResumeFailed, match="did not confirm within"):
        await asyncio.wait_for(h.lc.resume(), WAIT_S)
    assert h.lc.state is State.DRAINING and not h.gate.accepting
    fresh = h.lc.current_run
    assert fresh is not None
    assert (await finished(fresh)).drained  # it unregisters first, then converges


async def test_stop_during_a_blocked_registration_wins(workers: Workers) -> None:
    h = await workers.new("zero")
    assert (await finished(await h.lc.drain())).drained
    h.discovery.register_gate = asyncio.Event()
    h.discovery.register_entered.clear()
    resume = asyncio.create_task(h.lc.resume())
    await asyncio.wait_for(h.discovery.register_entered.wait(), WAIT_S)
    await h.lc.stop()
    h.discovery.register_gate.set()
    with pytest.raises(InvalidTransition):
        await asyncio.wait_for(resume, WAIT_S)
    assert h.lc.state is State.STOPPING
    assert not h.gate.accepting


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


# -- status ------------------------------------------------------------------------------


async def test_status_dict_while_serving(workers: Workers) -> None:
    h = await workers.new("zero")
    with h.gate.admit("r1"):
        status = h.lc.status().to_dict()
    assert set(status) == STATUS_KEYS
    assert status["state"] == "serving"
    assert status["generation"] == 0
    assert status["inflight_requests"] == 1
    assert status["accepting"] is True
    assert status["discovery_registered"] is True
    assert status["since"] == 1_000.0
    assert status["last_error"] is None
    assert status["pending_work"] is None
    assert status["drain"] is None
    assert status["last_drain"] is None


async def test_status_dict_shows_drain_progress(workers: Workers) -> None:
    h = await workers.new("busy")
    h.wall.now = 2_000.0
    run = await h.lc.drain(budget_s=30.0)
    await h.probe.wait_reads(3)

    status = h.lc.status().to_dict()
    assert set(status) == STATUS_KEYS
    assert status["state"] == "draining"
    assert status["generation"] == 1
    assert status["inflight_requests"] == 0
    assert status["accepting"] is False
    assert status["discovery_registered"] is False
    assert status["since"] == 2_000.0
    assert status["last_error"] is None
    pending = status["pending_work"]
    assert isinstance(pending, dict)
    assert pending["verdict"] == "busy" and pending["total"] == 3
    drain = status["drain"]
    assert isinstance(drain, dict)
    assert drain["generation"] == run.generation
    assert drain["stage"] == "engine"
    elapsed, budget_left = drain["elapsed_s"], drain["budget_left_s"]
    assert isinstance(elapsed, float) and elapsed >= 0
    assert drain["budget_s"] == 30.0
    assert isinstance(budget_left, float) and 0 <= budget_left <= 30.0
    trend = drain["trend"]
    assert isinstance(trend, list) and len(trend) >= 2
    assert all(n == 3 for _, n in trend)
    times = [t for t, _ in trend]
    assert times == sorted(times)

    h.wall.now = 3_000.0
    h.probe.mode = "zero"
    assert (await finished(run)).drained
    done = h.lc.status().to_dict()
    assert done["state"] == "drained" and done["since"] == 3_000.0
    assert done["generation"] == 2
    assert done["drain"] is None
    last = done["last_drain"]
    assert isinstance(last, dict) and last["drained"] is True and last["outcome"] == "completed"
    pending = done["pending_work"]
    assert isinstance(pending, dict) and pending["verdict"] == "quiescent"


async def test_status_with_unknown_pending_work_shows_its_trend_as_none(
        workers: Workers) -> None:
    h = await workers.new("unknown")
    run = await h.lc.drain()
    await h.probe.wait_reads(2)
    drain = h.lc.status().to_dict()["drain"]
    assert isinstance(drain, dict) and drain["budget_s"] is None and drain["budget_left_s"] is None
    trend = drain["trend"]
    assert isinstance(trend, list) and trend and all(n is None for _, n in trend)
    assert not run.task.done()


@pytest.mark.parametrize("mode", ["raise", "hang"])
async def test_read_status_never_raises(workers: Workers, mode: Mode) -> None:
    h = await workers.new(mode)
    status = await h.lc.read_status(probe_timeout=0.01)
    assert status.state is State.SERVING
    assert status.pending_work is not None
    assert status.pending_work.verdict is Verdict.UNKNOWN
    assert status.to_dict()["pending_work"] is not None
