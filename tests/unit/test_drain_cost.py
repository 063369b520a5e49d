"""The drain cost rule (:mod:`quiesce.drain_cost`) and where it shows: the status."""

from __future__ import annotations

from quiesce import AdmissionGate, InMemoryDiscovery, PendingWork, Role
from quiesce.admission import Outcome
from quiesce.drain_cost import INT32_MAX, REQUEST_COST_MS, drain_cost
from quiesce.eta import DrainEta
from quiesce.lifecycle import Lifecycle
from quiesce.probe import UNKNOWN


def snapshot(eta: DrainEta | None = None, **counts: int) -> PendingWork:
    base = {"waiting": 0, "running": 0, "kv_sends_held": 0, "kv_recvs_awaited": 0}
    base.update(counts)
    return PendingWork(Role.PREFILL, "test", eta=eta, **base)  # type: ignore[arg-type]


def test_the_eta_is_the_cost_when_the_probe_estimates_one() -> None:
    cost = drain_cost(snapshot(DrainEta(2.5, 4.0, "test"), running=3), inflight=1)
    assert (cost.value, cost.unit, cost.source, cost.reason) == (2500, "ms", "eta", None)


def test_without_an_eta_each_request_counts_a_minute() -> None:
    cost = drain_cost(snapshot(running=3, kv_sends_held=2), inflight=1)
    assert (cost.value, cost.source) == (5 * REQUEST_COST_MS, "pending_work")
    assert cost.reason is not None and "gives no drain ETA" in cost.reason
    unknown_eta = snapshot(DrainEta.unknown("steps", "no step time yet"), running=1)
    cost = drain_cost(unknown_eta, inflight=0)
    assert cost.value == REQUEST_COST_MS and "no step time yet" in str(cost.reason)


def test_a_worker_that_cannot_be_timed_is_never_cheaper_than_one_nearly_done() -> None:
    nearly_done = drain_cost(snapshot(DrainEta(40.0, 50.0, "test"), running=30), 30)
    untimed = drain_cost(snapshot(running=1), 1)
    idle = drain_cost(snapshot(), 0)
    assert idle.value == 0 < nearly_done.value < untimed.value


def test_admitted_requests_the_engine_has_not_seen_count_too() -> None:
    assert drain_cost(snapshot(running=1), inflight=4).value == 4 * REQUEST_COST_MS
    timed = drain_cost(snapshot(DrainEta(2.0, 3.0, "test"), running=1), inflight=3)
    assert timed.value == 2000 + 2 * REQUEST_COST_MS


def test_unreadable_work_is_never_the_preferred_victim() -> None:
    unknown = PendingWork.unknown(Role.PREFILL, "test", "EngineCore did not answer in 0.5 s")
    cost = drain_cost(unknown, inflight=0)
    assert (cost.value, cost.source) == (INT32_MAX, "unknown")
    assert cost.reason is not None and cost.reason.startswith("EngineCore did not answer")
    unread = drain_cost(None, inflight=0)
    assert (unread.value, unread.source, unread.reason) == (
        INT32_MAX, "unknown", "the engine has not been read yet")
    # an ETA does not make unknown work cheap
    partly = PendingWork(Role.PREFILL, "test", waiting=0, running=0, kv_sends_held=UNKNOWN,
                         kv_recvs_awaited=0, eta=DrainEta(1.0, 2.0, "test"))
    assert drain_cost(partly, inflight=0).value == INT32_MAX


def test_busy_with_some_counters_unknown_counts_the_known_work() -> None:
    # a prefill worker holding 7 KV sends, one counter its role does not need unknown:
    # busy, and as costly as the 7 it is known to hold (never 0)
    busy = PendingWork(Role.PREFILL, "test", waiting=0, running=0, kv_sends_held=7,
                       kv_recvs_awaited=UNKNOWN)
    cost = drain_cost(busy, inflight=0)
    assert (cost.value, cost.source) == (7 * REQUEST_COST_MS, "pending_work")
    assert "some counters are unknown" in str(cost.reason)


def test_the_cost_fits_kubernetes_int32() -> None:
    assert drain_cost(snapshot(waiting=10**6, running=5), inflight=0).value == INT32_MAX
    assert drain_cost(snapshot(DrainEta(1e9, 1e9, "t"), running=1), 0).value == INT32_MAX


async def test_status_shows_the_cost() -> None:
    class Busy:
        role = Role.PREFILL
        source = "test"

        async def pending_work(self) -> PendingWork:
            return snapshot(DrainEta(0.75, 1.0, "test"), running=2, kv_sends_held=1)

        async def is_quiescent(self) -> bool:
            return False

    lifecycle = Lifecycle(gate=AdmissionGate(), probe=Busy(),
                          discovery=InMemoryDiscovery("w0"))
    admission = lifecycle.gate.admit("r1")
    assert lifecycle.status().to_dict()["drain_cost"] == {
        "value": INT32_MAX, "unit": "ms", "source": "unknown",
        "reason": "the engine has not been read yet"}
    status = (await lifecycle.read_status()).to_dict()
    assert status["drain_cost"] == {"value": 750, "unit": "ms", "source": "eta",
                                    "reason": None}
    admission.finish(Outcome.COMPLETED)
