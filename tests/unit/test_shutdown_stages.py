"""The budgeted Shutdown's stages and exit codes: clean or forced.

A shutdown under load drains cleanly (every stream finishes, every held KV is pulled,
EXIT_CLEAN) and later requests are refused retryably; held KV never pulled, requests
still running at the deadline, an abort that raises or hangs, no engine control and a
drain cap force the exit (EXIT_FORCED), always within the budget.

No real signals are sent. Fakes and helpers: :mod:`tests.unit.shutdown_harness`.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from quiesce import StageOutcome, WorkerDraining
from quiesce.adapters.sim import KVFate, RequestAborted, SimConfig, SimEngine, SimRequest
from quiesce.drain import DrainConfig
from quiesce.lifecycle import State
from quiesce.shutdown import EXIT_CLEAN, EXIT_FORCED, Shutdown, ShutdownPolicy
from tests.unit.shutdown_harness import (
    CLEAN_STAGES,
    OUTER_S,
    SLACK_S,
    FailingAbortEngine,
    HangingEngine,
    admitted_stream,
    make_lifecycle,
    registered,
    stage_outcomes,
    state_of,
    stuck_lifecycle,
    until,
)

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
        assert stage_outcomes(report) == CLEAN_STAGES
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
