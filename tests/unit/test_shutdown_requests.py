"""The budgeted Shutdown tells the truth about every admitted request, and how it is requested.

A request lost during the drain (also in an earlier preStop drain) exits EXIT_LOST, never
drained; streams cut when the listeners close count as lost; the engine gets its signals
back only after the drain; SIGTERM during or after an admin drain reuses that run;
``request()`` arms the budget once and ``wait_requested`` waits for it.

No real signals are sent. Fakes and helpers: :mod:`tests.unit.shutdown_harness`.
"""

from __future__ import annotations

import asyncio

import pytest

from quiesce import AdmissionGate, InMemoryDiscovery, StageOutcome
from quiesce.adapters.sim import RequestAborted, SimConfig, SimEngine, SimProbe, SimRequest
from quiesce.admission import Outcome
from quiesce.drain import DrainConfig
from quiesce.lifecycle import Lifecycle, State
from quiesce.shutdown import EXIT_CLEAN, EXIT_FORCED, EXIT_LOST, Shutdown, ShutdownPolicy
from quiesce.signal_guard import SignalOwnership
from tests.unit.shutdown_harness import (
    CLEAN_STAGES,
    OUTER_S,
    SLACK_S,
    FailingAbortEngine,
    FakeClock,
    admitted_stream,
    armed,
    make_lifecycle,
    stage_outcomes,
    state_of,
    stuck_lifecycle,
    until,
)

# -- Shutdown: truth about every admitted request ---------------------------------


async def test_a_request_lost_during_the_drain_is_never_drained_and_exits_lost() -> None:
    """The engine ends one stream itself mid-drain (its own abort, a dead engine): the drain
    still waits for the rest, but the report says lost with the count, never drained."""
    engine = SimEngine(SimConfig(decode_step_s=0.005))
    await engine.start()
    lifecycle = make_lifecycle(engine)
    shutdown = Shutdown(lifecycle, engine, ShutdownPolicy(total_s=5.0, cleanup_reserve_s=1.0))
    try:
        await lifecycle.start()
        kept = asyncio.create_task(
            admitted_stream(lifecycle, engine, SimRequest("kept", max_tokens=20), []))
        victim_out: list[int] = []
        victim = asyncio.create_task(
            admitted_stream(lifecycle, engine, SimRequest("victim", max_tokens=10_000),
                            victim_out))
        await until(lambda: bool(victim_out))
        shutdown.request("SIGTERM")
        running = asyncio.create_task(shutdown.run())
        await until(lambda: lifecycle.state is State.DRAINING)
        assert engine.abort("victim")  # the engine ends it by itself
        with pytest.raises(RequestAborted):
            await asyncio.wait_for(victim, OUTER_S)
        report = await asyncio.wait_for(running, OUTER_S)
        assert len(await asyncio.wait_for(kept, OUTER_S)) == 20  # the rest still finished
        assert report.outcome == "lost"
        assert report.exit_code == EXIT_LOST
        assert not report.drained
        assert report.lost_requests == 1
        assert report.requests.completed == 1
        assert report.aborted_requests == 0
        assert report.stages[0].outcome is StageOutcome.LOST
        last = lifecycle.status().last_drain
        assert last is not None and not last.drained and last.requests.lost == 1
    finally:
        await engine.shutdown()


async def test_a_loss_in_a_prestop_drain_is_not_hidden_by_the_sigterm_drain() -> None:
    """The kubelet's sequence: preStop's drain ends lost, then SIGTERM drains again. The
    retried run counts from when the worker left serving, so the exit is never clean."""
    engine = SimEngine(SimConfig(decode_step_s=0.005))
    await engine.start()
    lifecycle = make_lifecycle(engine)
    try:
        await lifecycle.start()
        victim_out: list[int] = []
        victim = asyncio.create_task(admitted_stream(
            lifecycle, engine, SimRequest("victim", max_tokens=10_000), victim_out))
        await until(lambda: bool(victim_out))
        prestop = await lifecycle.drain(budget_s=5.0)
        assert engine.abort("victim")
        with pytest.raises(RequestAborted):
            await asyncio.wait_for(victim, OUTER_S)
        first = await asyncio.wait_for(prestop.wait(), OUTER_S)
        assert first is not None and first.outcome is StageOutcome.LOST

        shutdown = Shutdown(lifecycle, engine, ShutdownPolicy(total_s=2.0,
                                                              cleanup_reserve_s=0.5))
        shutdown.request("SIGTERM")
        report = await asyncio.wait_for(shutdown.run(), OUTER_S)
        assert not report.drained
        assert report.outcome == "lost" and report.exit_code == EXIT_LOST
        assert report.lost_requests == 1
        assert lifecycle.current_run is not prestop  # it really was a second run
    finally:
        await engine.shutdown()


async def test_streams_cut_when_the_listeners_close_are_counted_lost() -> None:
    """A stream still open after the engine stopped is cut by ``close``: counted lost."""
    lifecycle, admission = stuck_lifecycle()
    closed: list[bool] = []

    async def close() -> None:  # what closing a server does to an open response
        closed.append(True)
        admission.end_by(asyncio.CancelledError())

    policy = ShutdownPolicy(total_s=0.3, cleanup_reserve_s=0.1)
    report = await asyncio.wait_for(Shutdown(lifecycle, None, policy).run(close), OUTER_S)
    assert closed == [True]
    assert admission.outcome is Outcome.LOST  # cancelled while stopping: not the client
    assert report.lost_requests == 1
    assert report.outcome == "forced" and report.exit_code == EXIT_FORCED
    assert stage_outcomes(report)[-1] == ("close", StageOutcome.TIMED_OUT)
    assert "1 stream(s) cut" in report.stages[-1].detail


async def test_the_engine_gets_its_signals_back_only_after_the_drain() -> None:
    """The signal permit is granted between the drain and the engine's shutdown."""
    order: list[str] = []

    class Ownership(SignalOwnership):
        def permit_shutdown(self) -> None:
            order.append(f"permit in {lifecycle.state.value}")

    class Engine:
        async def abort_all(self, reason: str) -> int:
            return 0

        async def shutdown(self) -> None:
            order.append("engine shutdown")

    engine = SimEngine()
    lifecycle = make_lifecycle(engine)
    await lifecycle.start()
    report = await asyncio.wait_for(
        Shutdown(lifecycle, Engine(), ShutdownPolicy(total_s=2.0, cleanup_reserve_s=0.5),
                 signals=Ownership()).run(), OUTER_S)
    assert report.drained
    assert order == ["permit in stopping", "engine shutdown"]


# -- Shutdown meets an admin drain ---------------------------------------------------


async def test_sigterm_during_unbounded_admin_drain_reuses_and_bounds_that_run() -> None:
    gate = AdmissionGate()
    _admission = gate.admit("never-ends")
    lifecycle = Lifecycle(gate=gate, probe=SimProbe(SimEngine()), discovery=InMemoryDiscovery("w"),
                          config=DrainConfig(router_grace_s=0.0, budget_s=None))
    engine = FailingAbortEngine()
    policy = ShutdownPolicy(total_s=0.3, cleanup_reserve_s=0.1)
    admin_run = await lifecycle.drain()
    assert admin_run.budget_s is None
    await asyncio.sleep(0.01)
    assert state_of(lifecycle) is State.DRAINING
    generation = lifecycle.generation

    shutdown = Shutdown(lifecycle, engine, policy)
    shutdown.request("SIGTERM")
    report = await asyncio.wait_for(shutdown.run(), OUTER_S)

    assert lifecycle.current_run is admin_run  # reused, no second run started
    assert lifecycle.generation == generation + 1  # only the stop transition
    assert admin_run.task.done()  # bounded: stop() ended it
    assert report.stages[0].stage == "drain"
    assert report.stages[0].outcome is StageOutcome.TIMED_OUT
    assert "still running" in report.stages[0].detail
    assert report.exit_code == EXIT_FORCED
    assert state_of(lifecycle) is State.STOPPING
    assert report.elapsed_s <= policy.total_s + SLACK_S


async def test_sigterm_after_admin_drain_finished_exits_clean() -> None:
    engine = SimEngine(SimConfig(decode_step_s=0.001))
    await engine.start()
    lifecycle = make_lifecycle(engine)
    try:
        await lifecycle.start()
        out: list[int] = []
        await admitted_stream(lifecycle, engine, SimRequest("r", max_tokens=5), out)
        admin_run = await lifecycle.drain()
        drained = await asyncio.wait_for(admin_run.wait(), OUTER_S)
        assert drained is not None and drained.drained
        assert state_of(lifecycle) is State.DRAINED

        shutdown = Shutdown(lifecycle, engine, ShutdownPolicy(total_s=5.0, cleanup_reserve_s=1.0))
        shutdown.request("SIGTERM")
        report = await asyncio.wait_for(shutdown.run(), OUTER_S)

        assert lifecycle.current_run is admin_run
        assert report.exit_code == EXIT_CLEAN
        assert report.drained
        assert report.aborted_requests == 0
        assert stage_outcomes(report) == CLEAN_STAGES
        assert state_of(lifecycle) is State.STOPPING
    finally:
        await engine.shutdown()


# -- request() ------------------------------------------------------------------------


async def test_request_twice_arms_the_budget_once() -> None:
    engine = SimEngine(SimConfig(decode_step_s=0.001))
    await engine.start()
    lifecycle = make_lifecycle(engine)
    clock = FakeClock()
    shutdown = Shutdown(lifecycle, engine, ShutdownPolicy(total_s=30.0, cleanup_reserve_s=5.0),
                        clock=clock)
    try:
        await lifecycle.start()
        assert not armed(shutdown)
        shutdown.request("SIGTERM")
        assert armed(shutdown)
        await asyncio.wait_for(shutdown.wait_requested(), OUTER_S)
        first_budget = shutdown._budget
        clock.advance(7.0)
        shutdown.request("SIGINT")  # changes nothing: neither the budget nor the reason
        assert shutdown._budget is first_budget
        report = await asyncio.wait_for(shutdown.run(), OUTER_S)
        assert report.signal == "SIGTERM"
        assert report.elapsed_s == 7.0  # measured from the first request, on the fake clock
        assert report.exit_code == EXIT_CLEAN
    finally:
        await engine.shutdown()


async def test_wait_requested_blocks_until_request() -> None:
    engine = SimEngine()
    shutdown = Shutdown(make_lifecycle(engine), engine)
    waiter = asyncio.create_task(shutdown.wait_requested())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    shutdown.request("test")
    await asyncio.wait_for(waiter, OUTER_S)
