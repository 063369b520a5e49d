"""Budget, Deadline and the budgeted Shutdown, in process (no real signals are sent).

The budget arithmetic runs on an injected fake clock. The shutdown runs against the
simulated engine under load, with streams admitted through the lifecycle's gate, or
against small fake engines whose abort fails or hangs.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quiesce import (
    Admission,
    AdmissionGate,
    ConfigError,
    InMemoryDiscovery,
    StageOutcome,
    WorkerDraining,
)
from quiesce.adapters.sim import (
    KVFate,
    RequestAborted,
    SimConfig,
    SimEngine,
    SimProbe,
    SimRequest,
)
from quiesce.admission import Outcome
from quiesce.budget import Budget, Deadline
from quiesce.drain import DrainConfig
from quiesce.lifecycle import Lifecycle, State
from quiesce.shutdown import (
    EXIT_CLEAN,
    EXIT_FORCED,
    EXIT_LOST,
    Shutdown,
    ShutdownPolicy,
    ShutdownReport,
)
from quiesce.signal_guard import SignalOwnership

FAST_DRAIN = DrainConfig(router_grace_s=0.0, poll_base_s=0.001, poll_cap_s=0.004,
                         probe_timeout_s=0.05)
SLACK_S = 0.3
"""Scheduling slack on top of a budget when checking that run() returned within it."""
OUTER_S = 10.0
"""Outer bound on every await, so a regression fails instead of hanging the suite."""


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# -- Deadline ---------------------------------------------------------------------


def test_deadline_after_counts_down_on_the_injected_clock() -> None:
    clock = FakeClock()
    deadline = Deadline.after(5.0, clock)
    assert deadline.bounded
    assert deadline.at == 1005.0
    assert deadline.remaining() == 5.0
    assert not deadline.expired()
    clock.advance(3.0)
    assert deadline.remaining() == 2.0
    clock.advance(2.0)
    assert deadline.remaining() == 0.0
    assert deadline.expired()
    clock.advance(7.0)
    assert deadline.remaining() == 0.0  # never negative
    assert deadline.expired()


def test_unbounded_deadline_never_expires() -> None:
    clock = FakeClock()
    deadline = Deadline.after(None, clock)
    assert not deadline.bounded
    assert deadline.remaining() == math.inf
    clock.advance(1e9)
    assert not deadline.expired()


def test_deadline_earlier_takes_whichever_comes_first() -> None:
    clock = FakeClock()
    deadline = Deadline.after(10.0, clock)
    assert deadline.earlier(None) is deadline
    assert deadline.earlier(3.0).at == 1003.0
    assert deadline.earlier(30.0).at == 1010.0
    unbounded = Deadline.after(None, clock)
    tighter = unbounded.earlier(2.0)
    assert tighter.bounded
    assert tighter.at == 1002.0
    clock.advance(2.0)
    assert tighter.expired()  # the derived deadline keeps the injected clock


# -- Budget -----------------------------------------------------------------------


def test_budget_allowance_is_capped_by_time_left_minus_reserve() -> None:
    clock = FakeClock()
    budget = Budget(10.0, 2.0, clock)
    assert budget.remaining() == 10.0
    assert budget.elapsed() == 0.0
    assert budget.allowance() == 8.0
    assert budget.allowance(3.0) == 3.0
    assert budget.allowance(20.0) == 8.0
    assert budget.cleanup_allowance() == 10.0
    clock.advance(5.0)
    assert budget.allowance() == 3.0
    assert budget.allowance(1.0) == 1.0
    assert budget.allowance(4.0) == 3.0
    assert budget.elapsed() == 5.0
    clock.advance(2.5)  # 2.5 s left, inside the reserve soon
    assert budget.allowance() == 0.5
    clock.advance(1.5)  # 1 s left: all of it belongs to cleanup
    assert budget.allowance() == 0.0
    assert budget.allowance(5.0) == 0.0
    assert budget.cleanup_allowance() == 1.0
    assert budget.cleanup_allowance(0.25) == 0.25
    clock.advance(4.0)  # past the deadline
    assert budget.remaining() == 0.0
    assert budget.allowance() == 0.0
    assert budget.cleanup_allowance() == 0.0
    assert budget.deadline.expired()
    assert budget.elapsed() == 13.0


def test_budget_with_no_reserve_gives_stages_everything() -> None:
    clock = FakeClock()
    budget = Budget(4.0, 0.0, clock)
    clock.advance(1.0)
    assert budget.allowance() == 3.0
    assert budget.cleanup_allowance() == 3.0


@given(total=st.floats(min_value=0.001, max_value=1e6),
       reserve_fraction=st.floats(min_value=0.0, max_value=0.999),
       elapsed=st.floats(min_value=0.0, max_value=2e6),
       cap=st.none() | st.floats(min_value=0.0, max_value=1e6))
def test_budget_allowance_property(total: float, reserve_fraction: float, elapsed: float,
                                   cap: float | None) -> None:
    reserve = total * reserve_fraction
    clock = FakeClock(0.0)
    budget = Budget(total, reserve, clock)
    clock.advance(elapsed)
    remaining = budget.remaining()
    assert remaining == max(0.0, total - elapsed)
    left = max(0.0, remaining - reserve)
    expected = left if cap is None else min(cap, left)
    allowance = budget.allowance(cap)
    assert allowance == expected
    assert allowance >= 0.0
    # a stage never eats into the reserve: what is left after it covers cleanup
    assert allowance == 0.0 or remaining - allowance >= reserve - 1e-9 * total
    cleanup = budget.cleanup_allowance()
    assert cleanup == remaining
    assert cleanup >= allowance


BAD_SECONDS: list[object] = [-1.0, float("nan"), True, False, "5", float("inf"),
                             float("-inf"), None]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=repr)
def test_budget_rejects_a_bad_total_naming_it(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        Budget(value, 1.0)  # type: ignore[arg-type]
    assert info.value.field == "total_s"
    assert "total_s" in str(info.value)


@pytest.mark.parametrize("value", BAD_SECONDS, ids=repr)
def test_budget_rejects_a_bad_reserve_naming_it(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        Budget(10.0, value)  # type: ignore[arg-type]
    assert info.value.field == "cleanup_reserve_s"


@pytest.mark.parametrize("total,reserve", [(5.0, 5.0), (5.0, 6.0), (0.5, 1)])
def test_budget_rejects_a_reserve_not_below_the_total(total: float, reserve: float) -> None:
    with pytest.raises(ConfigError) as info:
        Budget(total, reserve)
    assert info.value.field == "cleanup_reserve_s"
    assert isinstance(info.value, ValueError)


def test_budget_rejects_a_zero_total() -> None:
    with pytest.raises(ConfigError) as info:
        Budget(0, 0)
    assert info.value.field == "total_s"


def test_budget_accepts_ints() -> None:
    budget = Budget(3, 1, FakeClock())
    assert budget.allowance() == 2


# -- ShutdownPolicy ---------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("total_s", -1.0), ("total_s", 0), ("total_s", float("nan")), ("total_s", True),
    ("total_s", "30"), ("total_s", float("inf")), ("total_s", None),
    ("cleanup_reserve_s", -0.1), ("cleanup_reserve_s", float("nan")),
    ("cleanup_reserve_s", False), ("cleanup_reserve_s", "5"),
    ("cleanup_reserve_s", float("inf")), ("cleanup_reserve_s", 30.0),
    ("cleanup_reserve_s", 31.0),
    ("drain_cap_s", -2.0), ("drain_cap_s", float("nan")), ("drain_cap_s", True),
    ("drain_cap_s", "10"), ("drain_cap_s", float("inf")),
])
def test_policy_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        ShutdownPolicy(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field
    assert field in str(info.value)


def test_policy_defaults_and_valid_values() -> None:
    policy = ShutdownPolicy()
    assert policy.cleanup_reserve_s < policy.total_s
    assert policy.drain_cap_s is None
    assert ShutdownPolicy(total_s=1, cleanup_reserve_s=0, drain_cap_s=0).drain_cap_s == 0


# -- Shutdown: helpers ------------------------------------------------------------


def make_lifecycle(engine: SimEngine, config: DrainConfig = FAST_DRAIN,
                   gate: AdmissionGate | None = None) -> Lifecycle:
    return Lifecycle(gate=gate if gate is not None else AdmissionGate(accepting=False),
                     probe=SimProbe(engine), discovery=InMemoryDiscovery("worker-0"),
                     config=config)


async def admitted_stream(lifecycle: Lifecycle, engine: SimEngine, request: SimRequest,
                          out: list[int]) -> list[int]:
    """What a worker's request handler does: admit through the gate, then stream."""
    with lifecycle.gate.admit(request.request_id) as admission:
        async for token in engine.generate(request):
            out.append(token)
        admission.finish(Outcome.COMPLETED)
    return out


async def until(condition: Callable[[], bool], timeout: float = OUTER_S) -> None:
    async def poll() -> None:
        while not condition():  # noqa: ASYNC110 (the conditions here have no event to wait on)
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout)


def state_of(lifecycle: Lifecycle) -> State:
    """The state, read through a call so that mypy does not narrow it across awaits."""
    return lifecycle.state


def registered(lifecycle: Lifecycle) -> bool:
    return lifecycle.discovery.registered


def armed(shutdown: Shutdown) -> bool:
    return shutdown.requested


def stage_outcomes(report: ShutdownReport) -> list[tuple[str, StageOutcome]]:
    return [(s.stage, s.outcome) for s in report.stages]


class FailingAbortEngine:
    """EngineControl whose abort_all raises; shutdown works."""

    def __init__(self) -> None:
        self.abort_calls = 0
        self.shutdown_calls = 0

    async def abort_all(self, reason: str) -> int:
        self.abort_calls += 1
        raise RuntimeError("abort exploded")

    async def shutdown(self) -> None:
        self.shutdown_calls += 1


class HangingEngine:
    """EngineControl whose abort_all and shutdown never return (until cancelled)."""

    def __init__(self) -> None:
        self.abort_cancelled = False
        self.shutdown_cancelled = False

    async def abort_all(self, reason: str) -> int:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.abort_cancelled = True
            raise
        return 0  # pragma: no cover

    async def shutdown(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.shutdown_cancelled = True
            raise


def stuck_lifecycle() -> tuple[Lifecycle, Admission]:
    """A started-looking lifecycle with one admitted request that never ends."""
    gate = AdmissionGate()
    admission = gate.admit("stuck")
    lifecycle = Lifecycle(gate=gate, probe=SimProbe(SimEngine()), discovery=InMemoryDiscovery("w"),
                          config=FAST_DRAIN)
    return lifecycle, admission


# -- Shutdown: clean drain under load ---------------------------------------------


async def test_shutdown_under_load_drains_cleanly() -> None:
    engine = SimEngine(SimConfig(decode_step_s=0.002, kv_pull_latency_s=(0.01, 0.03), seed=7))
    await engine.start()
    lifecycle = make_lifecycle(engine, DrainConfig(router_grace_s=0.02, poll_cap_s=0.004))
    shutdown = Shutdown(lifecycle, engine, ShutdownPolicy(total_s=10.0, cleanup_reserve_s=2.0))
    try:
        await lifecycle.start()
        assert registered(lifecycle)
        requests = [SimRequest(f"r{i}", max_tokens=30 + 5 * i, remote_decode=i % 2 == 0)
                    for i in range(6)]
        outs: list[list[int]] = [[] for _ in requests]
        tasks = [asyncio.create_task(admitted_stream(lifecycle, engine, r, o))
                 for r, o in zip(requests, outs, strict=True)]
        await until(lambda: all(outs))  # every stream is admitted and has a token
        assert lifecycle.gate.inflight == len(requests)
        fates = {r.request_id: asyncio.ensure_future(engine.kv_fate(r.request_id))
                 for r in requests if r.remote_decode}

        shutdown.request("SIGTERM")
        report = await asyncio.wait_for(shutdown.run(), OUTER_S)

        results = await asyncio.wait_for(asyncio.gather(*tasks), OUTER_S)
        for request, tokens in zip(requests, results, strict=True):
            assert tokens == list(range(1, request.max_tokens + 1)), request.request_id
        for rid, fate in fates.items():
            assert await asyncio.wait_for(fate, OUTER_S) is KVFate.PULLED, rid
        assert report.exit_code == EXIT_CLEAN
        assert report.drained
        assert report.aborted_requests == 0
        assert report.signal == "SIGTERM"
        assert stage_outcomes(report) == [
            ("drain", StageOutcome.COMPLETED),
            ("stop", StageOutcome.COMPLETED),
            ("abort", StageOutcome.SKIPPED),
            ("engine_shutdown", StageOutcome.COMPLETED),
            ("close", StageOutcome.SKIPPED),
        ]
        assert report.outcome == "drained"
        assert report.requests.completed == len(requests)
        assert report.lost_requests == 0
        assert engine.kv_freed_early == 0
        assert engine.stopped
        assert state_of(lifecycle) is State.STOPPING
        assert not lifecycle.gate.accepting
        assert lifecycle.gate.inflight == 0
        assert not registered(lifecycle)
        last = lifecycle.status().last_drain
        assert last is not None and last.drained
        assert report.elapsed_s >= 0.0
        encoded = json.loads(json.dumps(report.to_dict()))
        assert encoded["exit_code"] == EXIT_CLEAN
        assert [s["stage"] for s in encoded["stages"]] == [
            "drain", "stop", "abort", "engine_shutdown", "close"]
        assert encoded["outcome"] == "drained" and encoded["lost_requests"] == 0
        assert encoded["requests"]["completed"] == len(requests)
    finally:
        await engine.shutdown()


async def test_late_request_after_shutdown_is_rejected_retryably() -> None:
    engine = SimEngine(SimConfig(decode_step_s=0.001))
    await engine.start()
    lifecycle = make_lifecycle(engine)
    try:
        await lifecycle.start()
        report = await asyncio.wait_for(Shutdown(lifecycle, engine).run(), OUTER_S)
        assert report.exit_code == EXIT_CLEAN
        assert report.signal == "run"  # run() without request() arms the budget itself
        with pytest.raises(WorkerDraining) as info:
            lifecycle.gate.admit("late")
        assert info.value.retryable
        assert info.value.state == "stopping"
    finally:
        await engine.shutdown()


# -- Shutdown: forced ----------------------------------------------------------------


async def test_held_kv_never_pulled_forces_abort_within_the_budget() -> None:
    engine = SimEngine(SimConfig(decode_step_s=0.002))
    await engine.start()
    lifecycle = make_lifecycle(engine)
    policy = ShutdownPolicy(total_s=0.4, cleanup_reserve_s=0.2)
    shutdown = Shutdown(lifecycle, engine, policy)
    try:
        await lifecycle.start()
        held = SimRequest("held", max_tokens=3, remote_decode=True, never_pulled=True)
        out: list[int] = []
        stream = asyncio.create_task(admitted_stream(lifecycle, engine, held, out))
        await until(lambda: bool(out))
        fate = asyncio.ensure_future(engine.kv_fate("held"))
        assert await asyncio.wait_for(stream, OUTER_S) == [1, 2, 3]
        assert engine.counts()[2] == 1  # the KV is held for a decoder that never pulls

        shutdown.request("SIGTERM")
        report = await asyncio.wait_for(shutdown.run(), OUTER_S)

        assert report.exit_code == EXIT_FORCED
        assert not report.drained
        assert report.aborted_requests >= 1
        assert engine.kv_freed_early == 1
        assert await asyncio.wait_for(fate, OUTER_S) is KVFate.FREED_EARLY
        assert stage_outcomes(report) == [
            ("drain", StageOutcome.TIMED_OUT),
            ("stop", StageOutcome.COMPLETED),
            ("abort", StageOutcome.COMPLETED),
            ("engine_shutdown", StageOutcome.COMPLETED),
            ("close", StageOutcome.SKIPPED),
        ]
        assert report.outcome == "forced"
        assert str(report.aborted_requests) in report.stages[2].detail
        assert state_of(lifecycle) is State.STOPPING
        last = lifecycle.status().last_drain
        assert last is not None and not last.drained
        assert engine.stopped
        assert report.elapsed_s <= policy.total_s + SLACK_S
    finally:
        await engine.shutdown()


async def test_requests_still_running_at_the_deadline_are_aborted_and_counted() -> None:
    engine = SimEngine(SimConfig(decode_step_s=0.01))
    await engine.start()
    lifecycle = make_lifecycle(engine)
    shutdown = Shutdown(lifecycle, engine, ShutdownPolicy(total_s=0.3, cleanup_reserve_s=0.1))
    try:
        await lifecycle.start()
        requests = [SimRequest(f"long{i}", max_tokens=10_000) for i in range(3)]
        outs: list[list[int]] = [[] for _ in requests]
        tasks = [asyncio.create_task(admitted_stream(lifecycle, engine, r, o))
                 for r, o in zip(requests, outs, strict=True)]
        await until(lambda: all(outs))
        report = await asyncio.wait_for(shutdown.run(), OUTER_S)
        assert report.exit_code == EXIT_FORCED
        assert report.aborted_requests == 3
        assert report.stages[0].outcome is StageOutcome.TIMED_OUT
        for task in tasks:
            with pytest.raises(RequestAborted):
                await asyncio.wait_for(task, OUTER_S)
        assert lifecycle.gate.inflight == 0  # aborted streams released their admission
        assert report.outcome == "forced"
        assert report.lost_requests == 3  # every aborted stream is a loss, in the report
        assert report.requests.completed == 0
    finally:
        await engine.shutdown()


async def test_abort_that_raises_is_reported_failed_and_run_still_finishes() -> None:
    lifecycle, _admission = stuck_lifecycle()
    engine = FailingAbortEngine()
    policy = ShutdownPolicy(total_s=0.3, cleanup_reserve_s=0.1)
    report = await asyncio.wait_for(Shutdown(lifecycle, engine, policy).run(), OUTER_S)
    assert report.exit_code == EXIT_FORCED
    assert report.aborted_requests == 0
    outcomes = dict(stage_outcomes(report))
    assert outcomes["drain"] is StageOutcome.TIMED_OUT
    assert outcomes["abort"] is StageOutcome.FAILED
    assert "abort exploded" in report.stages[2].detail
    assert outcomes["engine_shutdown"] is StageOutcome.COMPLETED
    assert engine.abort_calls == 1
    assert engine.shutdown_calls == 1
    assert state_of(lifecycle) is State.STOPPING
    assert report.elapsed_s <= policy.total_s + SLACK_S


async def test_abort_that_hangs_times_out_and_run_returns_within_the_budget() -> None:
    lifecycle, _admission = stuck_lifecycle()
    engine = HangingEngine()
    policy = ShutdownPolicy(total_s=0.3, cleanup_reserve_s=0.1)
    started = time.monotonic()
    report = await asyncio.wait_for(Shutdown(lifecycle, engine, policy).run(), OUTER_S)
    wall = time.monotonic() - started
    assert report.exit_code == EXIT_FORCED
    assert report.aborted_requests == 0
    assert stage_outcomes(report) == [
        ("drain", StageOutcome.TIMED_OUT),
        ("stop", StageOutcome.COMPLETED),
        ("abort", StageOutcome.TIMED_OUT),
        ("engine_shutdown", StageOutcome.TIMED_OUT),
        ("close", StageOutcome.TIMED_OUT),
    ]
    assert engine.abort_cancelled
    assert engine.shutdown_cancelled
    assert report.elapsed_s <= policy.total_s + SLACK_S
    assert wall <= policy.total_s + SLACK_S


async def test_no_engine_control_makes_abort_unsupported() -> None:
    lifecycle, _admission = stuck_lifecycle()
    policy = ShutdownPolicy(total_s=0.2, cleanup_reserve_s=0.1)
    report = await asyncio.wait_for(Shutdown(lifecycle, None, policy).run(), OUTER_S)
    assert report.exit_code == EXIT_FORCED
    assert stage_outcomes(report)[2:] == [
        ("abort", StageOutcome.UNSUPPORTED), ("engine_shutdown", StageOutcome.SKIPPED),
        ("close", StageOutcome.TIMED_OUT)]
    assert report.lost_requests == 1  # still open at exit: the process exit cuts it


async def test_drain_cap_bounds_the_drain_stage() -> None:
    lifecycle, _admission = stuck_lifecycle()
    policy = ShutdownPolicy(total_s=30.0, cleanup_reserve_s=5.0, drain_cap_s=0.1)
    engine = FailingAbortEngine()
    report = await asyncio.wait_for(Shutdown(lifecycle, engine, policy).run(), OUTER_S)
    assert report.stages[0].outcome is StageOutcome.TIMED_OUT
    assert report.stages[0].elapsed_s < 5.0  # the cap, not the 25 s allowance, bounded it


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
        assert stage_outcomes(report) == [
            ("drain", StageOutcome.COMPLETED),
            ("stop", StageOutcome.COMPLETED),
            ("abort", StageOutcome.SKIPPED),
            ("engine_shutdown", StageOutcome.COMPLETED),
            ("close", StageOutcome.SKIPPED),
        ]
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
