"""AdmissionGate: counted or rejected, released exactly once, waiters woken at zero."""

from __future__ import annotations

import asyncio

import pytest

from quiesce import AdmissionGate, OutcomeCounts, RequestAborted, RequestRejected, WorkerDraining
from quiesce.admission import Outcome


def test_admit_counts_and_release_is_idempotent() -> None:
    gate = AdmissionGate()
    admission = gate.admit("r1")
    assert gate.inflight == 1
    assert admission.request_id == "r1"
    admission.finish(Outcome.COMPLETED)
    admission.finish(Outcome.COMPLETED)
    assert gate.inflight == 0
    assert admission.released
    assert gate.admitted_total == 1


def test_closed_gate_rejects_with_typed_retryable_error_and_counts_it() -> None:
    gate = AdmissionGate()
    gate.close()
    with pytest.raises(WorkerDraining) as info:
        gate.admit("late")
    assert info.value.retryable is True
    assert info.value.request_id == "late"
    assert "draining" in str(info.value)
    assert gate.inflight == 0
    assert gate.refused_total == 1
    gate.close("stopping")
    with pytest.raises(WorkerDraining, match="stopping"):
        gate.admit()
    gate.open()
    with gate.admit():
        assert gate.inflight == 1


def test_with_block_releases_on_error() -> None:
    gate = AdmissionGate()
    with pytest.raises(ValueError), gate.admit("r"):
        raise ValueError("handler failed")
    assert gate.inflight == 0


async def test_async_with_releases_on_cancellation() -> None:
    gate = AdmissionGate()
    entered = asyncio.Event()

    async def handler() -> None:
        async with gate.admit("r"):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(handler())
    await entered.wait()
    assert gate.inflight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.inflight == 0


async def test_streaming_generator_closed_by_disconnect_releases() -> None:
    gate = AdmissionGate()

    async def stream() -> object:
        with gate.admit("s"):
            for i in range(100):
                yield i
                await asyncio.sleep(0)

    gen = stream()
    assert await gen.__anext__() == 0  # type: ignore[attr-defined]
    assert gate.inflight == 1
    await gen.aclose()  # type: ignore[attr-defined]
    assert gate.inflight == 0


async def test_wait_idle_wakes_when_count_reaches_zero() -> None:
    gate = AdmissionGate()
    a, b = gate.admit(), gate.admit()
    waiter = asyncio.create_task(gate.wait_idle())
    await asyncio.sleep(0)
    a.finish(Outcome.COMPLETED)
    await asyncio.sleep(0)
    assert not waiter.done()
    b.finish(Outcome.COMPLETED)
    await asyncio.wait_for(waiter, timeout=5)
    await asyncio.wait_for(gate.wait_idle(), timeout=5)  # already idle: returns at once


async def test_cancelled_waiter_is_forgotten() -> None:
    gate = AdmissionGate()
    admission = gate.admit()
    waiter = asyncio.create_task(gate.wait_idle())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate._idle_waiters == []
    admission.finish(Outcome.COMPLETED)
    assert gate.inflight == 0


def test_close_keeps_admitted_requests_counted() -> None:
    gate = AdmissionGate()
    admission = gate.admit()
    gate.close()
    assert not gate.accepting
    assert gate.inflight == 1
    admission.finish(Outcome.COMPLETED)
    assert gate.inflight == 0


# -- outcomes -------------------------------------------------------------------------


def test_finish_records_the_first_outcome_only_and_counts_it() -> None:
    gate = AdmissionGate()
    admission = gate.admit("r")
    admission.finish(Outcome.COMPLETED)
    admission.finish(Outcome.LOST)  # too late: the request already ended
    assert admission.outcome is Outcome.COMPLETED
    assert gate.outcomes() == OutcomeCounts(completed=1)
    assert gate.inflight == 0


@pytest.mark.parametrize(("exc", "stopping", "expected"), [
    (None, False, Outcome.LOST),  # nobody said how it ended: fail closed
    (asyncio.CancelledError(), False, Outcome.CLIENT_GONE),
    (GeneratorExit(), False, Outcome.CLIENT_GONE),
    (asyncio.CancelledError(), True, Outcome.LOST),  # the worker's own servers cut it
    (RequestRejected("prompt too long"), False, Outcome.REJECTED),
    (RequestAborted("engine aborted"), False, Outcome.LOST),
    (RuntimeError("engine dead"), False, Outcome.LOST),
])
def test_a_block_left_without_an_outcome_gets_the_one_its_exit_implies(
        exc: BaseException | None, stopping: bool, expected: Outcome) -> None:
    gate = AdmissionGate()
    admission = gate.admit("r")
    if stopping:
        gate.close("stopping")
    admission.__exit__(type(exc) if exc else None, exc, None)
    assert admission.outcome is expected
    assert getattr(gate.outcomes(), expected.value) == 1
    assert gate.outcomes().ended == 1


def test_draining_gate_still_counts_cancellation_as_client_gone() -> None:
    gate = AdmissionGate()
    admission = gate.admit("r")
    gate.close("draining")  # the drain closed admission; the worker is not stopping
    admission.end_by(asyncio.CancelledError())
    assert admission.outcome is Outcome.CLIENT_GONE


def test_outcome_counts_subtract_per_outcome() -> None:
    later = OutcomeCounts(completed=5, lost=2, client_gone=1, rejected=3)
    earlier = OutcomeCounts(completed=1, lost=2)
    assert later - earlier == OutcomeCounts(completed=4, lost=0, client_gone=1, rejected=3)
    assert (later - earlier).ended == 8
    assert later.to_dict() == {"completed": 5, "lost": 2, "client_gone": 1, "rejected": 3}
