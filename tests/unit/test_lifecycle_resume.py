"""Unit tests of :class:`quiesce.lifecycle.Lifecycle`: resume.

Resume from serving, draining and drained (each a new generation); a stale run can never
publish drained after a resume, even through a probe that ignores cancellation; a failed
or hanging registration rolls back to draining; stop during a blocked registration wins.

Fakes (a scripted probe and discovery) and helpers: :mod:`tests.unit.lifecycle_harness`.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from quiesce import InvalidTransition, ResumeFailed, StageOutcome, WorkerDraining
from quiesce.admission import Outcome
from quiesce.lifecycle import State
from tests.unit.lifecycle_harness import FAST, WAIT_S, Harness, Workers, finished, until

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


async def resume_blocked_in_registration(h: Harness) -> tuple[asyncio.Task[None], asyncio.Event]:
    """Drain ``h`` to drained, then start a resume and return once its registration
    waits on the returned gate (set it to let the registration go on)."""
    assert (await finished(await h.lc.drain())).drained
    registration = h.discovery.register_gate = asyncio.Event()
    h.discovery.register_entered.clear()
    resume = asyncio.create_task(h.lc.resume())
    await asyncio.wait_for(h.discovery.register_entered.wait(), WAIT_S)
    return resume, registration


async def test_resume_admits_before_registration_completes(workers: Workers) -> None:
    h = await workers.new("zero")
    resume, registration = await resume_blocked_in_registration(h)
    assert h.lc.state is State.SERVING
    assert h.gate.accepting and not h.discovery.registered
    h.gate.admit("early").finish(Outcome.COMPLETED)
    registration.set()
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
    resume, registration = await resume_blocked_in_registration(h)
    await h.lc.stop()
    registration.set()
    with pytest.raises(InvalidTransition):
        await asyncio.wait_for(resume, WAIT_S)
    assert h.lc.state is State.STOPPING
    assert not h.gate.accepting
