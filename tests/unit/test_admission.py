"""AdmissionGate: counted or rejected, released exactly once, waiters woken at zero."""

from __future__ import annotations

import asyncio

import pytest

from quiesce import AdmissionGate, WorkerDraining


def test_admit_counts_and_release_is_idempotent() -> None:
    gate = AdmissionGate()
    admission = gate.admit("r1")
    assert gate.inflight == 1
    assert admission.request_id == "r1"
    admission.release()
    admission.release()
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
    assert gate.rejected_total == 1
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
    a.release()
    await asyncio.sleep(0)
    assert not waiter.done()
    b.release()
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
    admission.release()
    assert gate.inflight == 0


def test_close_keeps_admitted_requests_counted() -> None:
    gate = AdmissionGate()
    admission = gate.admit()
    gate.close()
    assert not gate.accepting
    assert gate.inflight == 1
    admission.release()
    assert gate.inflight == 0
