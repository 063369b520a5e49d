"""The probe contract: verdicts, fail-closed rules, observe() and the AllOf combinator.

The probes here are fakes that stand in for engine probes; every engine adapter has
its own tests against the real engine (or its real code) in tests/integration and
tests/gpu.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from quiesce import UNKNOWN, AllOf, ConfigError, PendingWork, Probe, Role, Verdict, observe
from quiesce.probe import REQUIRED_COUNTERS


class FakeProbe(Probe):
    """A fake engine probe whose answer (or failure) the test sets."""

    def __init__(self, role: Role = Role.AGGREGATED, source: str = "fake",
                 answer: PendingWork | None = None) -> None:
        super().__init__(role, source)
        self.answer = answer if answer is not None else PendingWork.idle(role, source)
        self.error: Exception | None = None
        self.hang = False
        self.reads = 0

    async def pending_work(self) -> PendingWork:
        self.reads += 1
        if self.hang:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error
        return self.answer


def snap(role: Role = Role.AGGREGATED, **counts: object) -> PendingWork:
    return PendingWork(role=role, source="t", **counts)  # type: ignore[arg-type]


def test_idle_snapshot_is_quiescent() -> None:
    for role in Role:
        work = PendingWork.idle(role, "t")
        assert work.verdict is Verdict.QUIESCENT
        assert work.is_quiescent
        assert work.total == 0


@pytest.mark.parametrize("field", ["waiting", "running", "kv_sends_held", "kv_recvs_awaited"])
def test_any_known_positive_counter_is_busy(field: str) -> None:
    counts: dict[str, object] = {"waiting": 0, "running": 0, "kv_sends_held": 0,
                                 "kv_recvs_awaited": 0, field: 2}
    work = snap(Role.AGGREGATED, **counts)
    assert work.verdict is Verdict.BUSY
    assert work.total == 2


def test_engine_verdict_has_work_is_busy_even_with_zero_counts() -> None:
    work = PendingWork.idle(Role.AGGREGATED, "t")
    busy = PendingWork(role=Role.AGGREGATED, source="t", waiting=0, running=0,
                       engine_has_work=True)
    assert work.verdict is Verdict.QUIESCENT
    assert busy.verdict is Verdict.BUSY


@pytest.mark.parametrize("role", list(Role))
def test_each_required_counter_unknown_is_unknown(role: Role) -> None:
    for missing in REQUIRED_COUNTERS[role]:
        counts = dict.fromkeys(REQUIRED_COUNTERS[role], 0)
        counts[missing] = UNKNOWN  # type: ignore[assignment]
        work = snap(role, **counts)
        assert work.verdict is Verdict.UNKNOWN, (role, missing)
        assert any(missing in reason for reason in work.reasons)
        assert not work.is_quiescent
        assert work.total is None


def test_prefill_that_cannot_see_kv_sends_is_unknown_never_quiescent() -> None:
    work = snap(Role.PREFILL, waiting=0, running=0, engine_has_work=False)
    assert work.verdict is Verdict.UNKNOWN
    assert "kv_sends_held" in work.reasons[0]
    # the same counters are enough for an aggregated worker
    assert snap(Role.AGGREGATED, waiting=0, running=0).verdict is Verdict.QUIESCENT


def test_decode_needs_kv_receives() -> None:
    assert snap(Role.DECODE, waiting=0, running=0).verdict is Verdict.UNKNOWN
    assert snap(Role.DECODE, waiting=0, running=0,
                kv_recvs_awaited=0).verdict is Verdict.QUIESCENT
    assert snap(Role.DECODE, waiting=0, running=0,
                kv_recvs_awaited=1).verdict is Verdict.BUSY


def test_errors_make_an_otherwise_idle_snapshot_unknown() -> None:
    work = PendingWork(role=Role.AGGREGATED, source="t", waiting=0, running=0,
                       errors=("attribute scheduler.requests missing",))
    assert work.verdict is Verdict.UNKNOWN
    assert work.reasons == ("attribute scheduler.requests missing",)
    assert "attribute scheduler.requests missing" in work.summary()


def test_errors_do_not_hide_known_work() -> None:
    work = PendingWork(role=Role.AGGREGATED, source="t", waiting=0, running=3,
                       errors=("dp rank 1 did not answer",))
    assert work.verdict is Verdict.BUSY


def test_engine_queues_count_and_unknown_queue_is_unknown() -> None:
    assert snap(queues={"grammar": 0}, waiting=0, running=0).verdict is Verdict.QUIESCENT
    assert snap(queues={"grammar": 4}, waiting=0, running=0).verdict is Verdict.BUSY
    unknown = snap(queues={"grammar": UNKNOWN}, waiting=0, running=0)
    assert unknown.verdict is Verdict.UNKNOWN
    assert "grammar" in unknown.reasons[-1]


def test_details_never_change_the_verdict() -> None:
    work = PendingWork(role=Role.AGGREGATED, source="t", waiting=0, running=0,
                       details={"kv_cache_usage": 0.9, "note": "x"})
    assert work.verdict is Verdict.QUIESCENT


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None, math.nan])
def test_bad_counts_are_rejected_naming_the_field(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        PendingWork(role=Role.AGGREGATED, source="t", running=bad)  # type: ignore[arg-type]
    assert info.value.field == "running"


def test_bad_role_is_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        Role.parse("leader")
    assert info.value.field == "role"
    assert "aggregated" in str(info.value)
    assert Role.parse("PREFILL") is Role.PREFILL
    with pytest.raises(ConfigError):
        PendingWork(role="prefill", source="t")  # type: ignore[arg-type]


def test_unknown_has_no_truth_value_and_is_a_singleton() -> None:
    from quiesce.probe import _Unknown

    assert _Unknown() is UNKNOWN
    assert repr(UNKNOWN) == "UNKNOWN"
    with pytest.raises(TypeError):
        bool(UNKNOWN)


def test_snapshot_is_immutable() -> None:
    work = PendingWork(role=Role.AGGREGATED, source="t", queues={"q": 1}, details={"d": 1})
    with pytest.raises(AttributeError):
        work.running = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        work.queues["q"] = 0  # type: ignore[index]


def test_to_dict_is_json_ready_and_names_reasons() -> None:
    import json

    work = snap(Role.PREFILL, waiting=0, running=1)
    data = work.to_dict()
    json.dumps(data)
    assert data["verdict"] == "busy"
    assert data["kv_sends_held"] is None
    assert data["running"] == 1
    assert data["total"] is None
    unknown = PendingWork.unknown(Role.DECODE, "s", "timeout").to_dict()
    assert unknown["verdict"] == "unknown"
    assert "timeout" in unknown["reasons"]  # type: ignore[operator]


def test_merge_takes_largest_known_view_and_keeps_errors() -> None:
    frontend = PendingWork(role=Role.PREFILL, source="frontend", waiting=UNKNOWN, running=2)
    engine = PendingWork(role=Role.PREFILL, source="engine", waiting=0, running=1,
                         kv_sends_held=0)
    merged = PendingWork.merge(Role.PREFILL, [frontend, engine])
    assert merged.running == 2
    assert merged.waiting == 0
    assert merged.kv_sends_held == 0
    assert merged.verdict is Verdict.BUSY
    assert merged.parts == (frontend, engine)
    failing = PendingWork.unknown(Role.PREFILL, "engine", "boom")
    idle_front = PendingWork(role=Role.PREFILL, source="frontend", waiting=0, running=0)
    merged = PendingWork.merge(Role.PREFILL, [idle_front, failing])
    assert merged.verdict is Verdict.UNKNOWN
    assert "engine: boom" in merged.reasons


def test_merge_engine_verdict_and_observation_time() -> None:
    a = PendingWork(role=Role.AGGREGATED, source="a", waiting=0, running=0,
                    engine_has_work=False, observed_at=5.0)
    b = PendingWork(role=Role.AGGREGATED, source="b", waiting=0, running=0,
                    engine_has_work=True, observed_at=3.0)
    merged = PendingWork.merge(Role.AGGREGATED, [a, b])
    assert merged.engine_has_work is True
    assert merged.observed_at == 3.0
    assert PendingWork.merge(Role.AGGREGATED, [a]).engine_has_work is False
    with pytest.raises(ConfigError):
        PendingWork.merge(Role.AGGREGATED, [])


async def test_observe_turns_raise_hang_and_wrong_type_into_unknown() -> None:
    probe = FakeProbe()
    assert (await observe(probe)).is_quiescent
    probe.error = RuntimeError("engine core died")
    work = await observe(probe)
    assert work.verdict is Verdict.UNKNOWN
    assert "RuntimeError: engine core died" in work.reasons[0]
    assert not await probe.is_quiescent()
    probe.error = None
    probe.hang = True
    work = await observe(probe, timeout=0.01)
    assert work.verdict is Verdict.UNKNOWN
    assert "did not answer" in work.reasons[0]
    probe.hang = False
    probe.answer = "idle"  # type: ignore[assignment]
    work = await observe(probe)
    assert work.verdict is Verdict.UNKNOWN
    assert "not PendingWork" in work.reasons[0]


async def test_observe_propagates_cancellation() -> None:
    probe = FakeProbe()
    probe.hang = True
    task = asyncio.create_task(observe(probe, timeout=10))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_all_of_requires_every_probe_idle() -> None:
    front = FakeProbe(source="frontend")
    engine = FakeProbe(source="engine")
    both = AllOf(front, engine)
    assert both.source == "frontend+engine"
    assert await both.is_quiescent()
    # visible to the frontend only (not yet at the engine)
    front.answer = snap(waiting=1, running=0)
    assert not await both.is_quiescent()
    # visible to the engine only (KV held after the stream ended)
    front.answer = PendingWork.idle(Role.AGGREGATED, "frontend")
    engine.answer = PendingWork(role=Role.AGGREGATED, source="engine", waiting=0, running=0,
                                kv_sends_held=1)
    assert not await both.is_quiescent()
    engine.error = TimeoutError("utility call timed out")
    work = await both.pending_work()
    assert work.verdict is Verdict.UNKNOWN


async def test_all_of_bounds_a_hanging_part() -> None:
    hanging = FakeProbe(source="slow")
    hanging.hang = True
    both = AllOf(FakeProbe(), hanging, timeout=0.01)
    work = await both.pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("slow" in r for r in work.reasons)


def test_all_of_validates_its_parts() -> None:
    with pytest.raises(ConfigError):
        AllOf()
    with pytest.raises(ConfigError) as info:
        AllOf(FakeProbe(Role.PREFILL), FakeProbe(Role.DECODE))
    assert info.value.field == "probes"
    with pytest.raises(ConfigError) as info:
        AllOf(FakeProbe(), timeout=0)
    assert info.value.field == "timeout"


async def test_all_of_wait_for_change_returns_at_timeout_without_notifiers() -> None:
    both = AllOf(FakeProbe(), FakeProbe(source="b"))
    work = await both.pending_work()
    await asyncio.wait_for(both.wait_for_change(work, 0.005), timeout=5)
