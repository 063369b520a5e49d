"""The drain cost rule (:mod:`quiesce.drain_cost`) and where it shows: the status."""

from __future__ import annotations

from quiesce import AdmissionGate, InMemoryDiscovery, PendingWork, Role
from quiesce.admission import Outcome
from quiesce.drain_cost import INT32_MAX, drain_cost
from quiesce.lifecycle import Lifecycle
from quiesce.probe import UNKNOWN


def snapshot(**counts: int) -> PendingWork:
    base = {"waiting": 0, "running": 0, "kv_sends_held": 0, "kv_recvs_awaited": 0}
    base.update(counts)
    return PendingWork(Role.PREFILL, "test", **base)  # type: ignore[arg-type]


def test_known_work_is_the_cost() -> None:
    cost = drain_cost(snapshot(running=3, kv_sends_held=2), inflight=1)
    assert (cost.value, cost.source, cost.unit, cost.reason) == (5, "pending_work", "requests",
                                                                 None)


def test_admitted_requests_the_engine_has_not_seen_count_too() -> None:
    assert drain_cost(snapshot(running=1), inflight=4).value == 4


def test_unknown_work_falls_back_to_the_admitted_requests_and_says_why() -> None:
    unknown = PendingWork.unknown(Role.PREFILL, "test", "EngineCore did not answer in 0.5 s")
    cost = drain_cost(unknown, inflight=2)
    assert (cost.value, cost.source) == (2, "inflight")
    assert cost.reason is not None and cost.reason.startswith("EngineCore did not answer")
    partly = PendingWork(Role.PREFILL, "test", waiting=0, running=0, kv_sends_held=UNKNOWN,
                         kv_recvs_awaited=0)
    assert drain_cost(partly, inflight=0).source == "inflight"
    first = drain_cost(None, inflight=0)
    assert (first.value, first.source, first.reason) == (0, "inflight",
                                                         "the engine has not been read yet")


def test_the_cost_fits_kubernetes_int32() -> None:
    assert drain_cost(snapshot(waiting=INT32_MAX, running=5), inflight=0).value == INT32_MAX


async def test_status_shows_the_cost() -> None:
    class Busy:
        role = Role.PREFILL
        source = "test"

        async def pending_work(self) -> PendingWork:
            return snapshot(running=2, kv_sends_held=1)

        async def is_quiescent(self) -> bool:
            return False

    lifecycle = Lifecycle(gate=AdmissionGate(), probe=Busy(),
                          discovery=InMemoryDiscovery("w0"))
    admission = lifecycle.gate.admit("r1")
    assert lifecycle.status().to_dict()["drain_cost"] == {
        "value": 1, "unit": "requests", "source": "inflight",
        "reason": "the engine has not been read yet"}
    status = (await lifecycle.read_status()).to_dict()
    assert status["drain_cost"] == {"value": 3, "unit": "requests", "source": "pending_work",
                                    "reason": None}
    admission.finish(Outcome.COMPLETED)
