"""Unit tests of :class:`quiesce.lifecycle.Lifecycle`: drain budgets.

A budget that runs out (the run reports and the worker stays draining), budgets spent by
the router grace or zero, a late unregister after a timed-out run, and invalid budgets
that change nothing.

Fakes (a scripted probe and discovery) and helpers: :mod:`tests.unit.lifecycle_harness`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any, cast

import pytest

from quiesce import ConfigError, StageOutcome
from quiesce.lifecycle import State
from tests.unit.lifecycle_harness import FAST, WAIT_S, Mode, Workers, finished, until

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
