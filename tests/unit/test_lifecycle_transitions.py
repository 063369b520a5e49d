"""Unit tests of :class:`quiesce.lifecycle.Lifecycle`: idempotence and invalid transitions.

A second drain joins the run in progress or returns the finished one; drain while
stopping is an invalid transition; stop is idempotent, cancels the run and ends in
stopping for good.

Fakes (a scripted probe and discovery) and helpers: :mod:`tests.unit.lifecycle_harness`.
"""

from __future__ import annotations

import pytest

from quiesce import InvalidTransition, StageOutcome, WorkerDraining
from quiesce.lifecycle import State
from tests.unit.lifecycle_harness import Workers, finished

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
