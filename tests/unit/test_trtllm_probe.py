"""The TensorRT-LLM probes' decision logic, against FAKE executors.

TensorRT-LLM cannot run here (no wheel is reachable, and it does not import without
CUDA), so these fakes mirror the executor layouts described in the project's research
notes: the 2026 layout (waiting queue on ``PyExecutor``, ``AsyncTransferManager``), the
older one (waiting queue on ``ExecutorRequestQueue``, ``ctx_in_transmission_requests`` as a
list or a dict), a drifted one, Ray ranks and the multi-process proxy. They prove the
probe's arithmetic and its fail-closed behaviour, not that TensorRT-LLM still looks like
this: the real engine is covered by tests/gpu/test_trtllm.py (a context/generation pair
on an H200, run by ci/gpu/trtllm.sh), and the layout by the drift checker
(tests/unit/test_trtllm_doctor.py here, against the installed package on the GPU).
"""

from __future__ import annotations

import asyncio
import enum
import json
import queue
import threading
from collections import deque
from typing import Any

import pytest

from quiesce import EngineNotInstalled, Role, Verdict
from quiesce.adapters.trtllm import probe as trt_probe
from quiesce.adapters.trtllm.executor_reader import IDLE_GAP_NOTE, read_py_executor, state_name
from quiesce.adapters.trtllm.layouts import (
    CTX_IN_TRANSMISSION,
    TRANSFER_MANAGER,
    WAITING_ON_EXECUTOR,
    WAITING_ON_REQUEST_QUEUE,
)
from quiesce.adapters.trtllm.probe import (
    InProcessProbe,
    ProxyStatsProbe,
    RayProbe,
    UnknownLayoutProbe,
    probe_factory,
    probe_for_llm,
)
from quiesce.probe import observe
from quiesce.registry import probe_for


class OldState(enum.Enum):  # values as in an older build
    CONTEXT_INIT = 2
    GENERATION_IN_PROGRESS = 4
    DISAGG_GENERATION_INIT = 7
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 10


class NewState(enum.Enum):  # the same names, other values (as in a newer build)
    DISAGG_GENERATION_INIT = 8
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 9
    CONTEXT_INIT = 10
    GENERATION_IN_PROGRESS = 13


class Request:
    def __init__(self, state: object = NewState.GENERATION_IN_PROGRESS,
                 dummy: bool | None = False) -> None:
        self.state = state
        if dummy is not None:
            self.is_attention_dp_dummy = dummy


class LiveDict(dict[int, Any]):
    """The transfer manager's live dict: iterating it from another thread is unsafe, so a
    probe that iterates instead of taking ``len()`` fails this test."""

    def __iter__(self) -> Any:
        raise RuntimeError("dictionary changed size during iteration")


class TransferManager:
    def __init__(self, in_transfer: int = 0) -> None:
        self._requests = LiveDict({i: object() for i in range(in_transfer)})

    def requests_in_transfer(self) -> dict[int, Any]:
        return self._requests


class Transceiver:
    """Status checks reap transfers and can block: the probe must never call them."""

    def check_context_transfer_status(self, *args: Any) -> None:
        raise AssertionError("the probe called check_context_transfer_status")

    def check_gen_transfer_status(self, *args: Any) -> None:
        raise AssertionError("the probe called check_gen_transfer_status")


class RequestQueue:
    def __init__(self, queued: int = 0, waiting: int | None = None) -> None:
        self.request_queue: queue.Queue[int] = queue.Queue()
        for i in range(queued):
            self.request_queue.put(i)
        if waiting is not None:  # the older layout keeps the waiting queue here
            self.waiting_queue = deque(range(waiting))

    def get_request_queue_size(self) -> int:
        return self.request_queue.qsize()

    def get_waiting_queue_size(self) -> int:
        return len(self.waiting_queue)


class NewExecutor:
    """The 2026 layout."""

    def __init__(self, active: list[Request] | None = None, waiting: int = 0, queued: int = 0,
                 in_transfer: int = 0) -> None:
        self.active_requests = active or []
        self.waiting_queue = deque(range(waiting))
        self.executor_request_queue = RequestQueue(queued)
        self.async_transfer_manager = TransferManager(in_transfer)
        self.kv_cache_transceiver = Transceiver()
        self.is_shutdown = False


class OldExecutor:
    """The 2025 layout: ctx_in_transmission_requests, waiting queue on the request queue."""

    def __init__(self, active: list[Request] | None = None, waiting: int = 0, queued: int = 0,
                 in_transfer: int = 0, as_dict: bool = False) -> None:
        self.active_requests = active or []
        self.executor_request_queue = RequestQueue(queued, waiting)
        held = [object() for _ in range(in_transfer)]
        self.ctx_in_transmission_requests: Any = (dict(enumerate(held)) if as_dict else held)
        self.kv_cache_transceiver = Transceiver()
        self.kv_connector_manager: Any = None  # no KV connector configured


class DriftedExecutor(NewExecutor):
    """A future build that renamed the transfer tracker."""

    def __init__(self) -> None:
        super().__init__()
        del self.async_transfer_manager
        self.transfers_pending: dict[int, Any] = {}


async def snapshot(executor: Any, role: Role = Role.AGGREGATED) -> Any:
    return await observe(probe_for_llm(executor, role))


# -- the in-process reading -------------------------------------------------------------

@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("executor,ctx_layout,waiting_layout", [
    (NewExecutor(), TRANSFER_MANAGER, WAITING_ON_EXECUTOR),
    (OldExecutor(), CTX_IN_TRANSMISSION, WAITING_ON_REQUEST_QUEUE),
    (OldExecutor(as_dict=True), CTX_IN_TRANSMISSION, WAITING_ON_REQUEST_QUEUE),
], ids=["2026", "2025-list", "2025-dict"])
async def test_idle_executor_is_quiescent_in_both_layouts(
        executor: Any, ctx_layout: str, waiting_layout: str, role: Role) -> None:
    work = await snapshot(executor, role)
    assert work.verdict is Verdict.QUIESCENT, work.summary()
    assert work.details["layout.ctx_in_transfer"] == ctx_layout
    assert work.details["layout.waiting"] == waiting_layout


@pytest.mark.parametrize("make,counter", [
    (lambda: NewExecutor(waiting=2), "waiting"), (lambda: OldExecutor(waiting=2), "waiting"),
    (lambda: NewExecutor(queued=2), "request_queue"),
    (lambda: OldExecutor(queued=2), "request_queue"),
    (lambda: NewExecutor([Request(), Request()]), "running"),
    (lambda: OldExecutor([Request(OldState.CONTEXT_INIT)] * 2), "running"),
], ids=["new-waiting", "old-waiting", "new-queued", "old-queued", "new-active", "old-active"])
async def test_each_queue_counts_as_work(make: Any, counter: str) -> None:
    work = await snapshot(make())
    assert work.verdict is Verdict.BUSY
    assert work.counts()[counter] == 2 and work.total == 2


@pytest.mark.parametrize("make", [lambda: NewExecutor(in_transfer=2),
                                  lambda: OldExecutor(in_transfer=2),
                                  lambda: OldExecutor(in_transfer=2, as_dict=True)])
async def test_context_transfers_hold_a_prefill_worker(make: Any) -> None:
    # Active, waiting and queued are all zero: the stats path would call this idle.
    work = await snapshot(make(), Role.PREFILL)
    assert work.verdict is Verdict.BUSY
    assert work.kv_sends_held == 2 and work.running == 0 and work.waiting == 0
    assert work.details["note"] == IDLE_GAP_NOTE  # the 1.2-era idle loop may hold them


async def test_attention_dp_dummies_are_not_work() -> None:
    assert (await snapshot(NewExecutor([Request(dummy=True)]))).verdict is Verdict.QUIESCENT
    work = await snapshot(NewExecutor([Request(dummy=True), Request()]))
    assert work.running == 1 and work.details["attention_dp_dummies"] == 1
    # a request without the flag (drift) counts as work: the safe side
    assert (await snapshot(NewExecutor([Request(dummy=None)]))).running == 1


@pytest.mark.parametrize("state", [OldState.DISAGG_GENERATION_INIT,
                                   NewState.DISAGG_GENERATION_INIT,
                                   NewState.DISAGG_GENERATION_TRANS_IN_PROGRESS,
                                   "LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS",
                                   "kDISAGG_GENERATION_INIT"])
async def test_decode_requests_awaiting_kv_are_told_by_state_name(state: object) -> None:
    work = await snapshot(NewExecutor([Request(state), Request(NewState.CONTEXT_INIT)]),
                          Role.DECODE)
    assert work.kv_recvs_awaited == 1 and work.running == 1
    assert work.verdict is Verdict.BUSY


async def test_state_values_are_never_compared() -> None:
    # NewState.CONTEXT_INIT has the value OldState.DISAGG_GENERATION_TRANS_IN_PROGRESS had
    # (10): compared by value, a new context request would pass for one awaiting KV.
    assert NewState.CONTEXT_INIT.value == OldState.DISAGG_GENERATION_TRANS_IN_PROGRESS.value
    work = await snapshot(NewExecutor([Request(NewState.CONTEXT_INIT)]), Role.DECODE)
    assert (work.running, work.kv_recvs_awaited) == (1, 0)
    assert state_name(OldState.DISAGG_GENERATION_INIT) == "DISAGG_GENERATION_INIT"
    assert state_name(None) is None
    assert state_name(7) == "7"  # a bare integer names nothing known: counted as running


async def test_drifted_layout_is_unknown_with_a_reason_for_every_role() -> None:
    for role in Role:
        work = await snapshot(DriftedExecutor(), role)
        assert work.verdict is Verdict.UNKNOWN, work.summary()
        reason = " ".join(work.reasons)
        assert "ctx_in_transfer: no known layout" in reason
        assert TRANSFER_MANAGER in reason and CTX_IN_TRANSMISSION in reason


async def test_missing_active_requests_is_unknown() -> None:
    executor = NewExecutor()
    del executor.active_requests
    work = await observe(InProcessProbe(None, executor=executor))
    assert work.verdict is Verdict.UNKNOWN
    assert any("active_requests" in r for r in work.reasons)


async def test_an_engine_exception_is_unknown_not_an_alternative() -> None:
    executor = NewExecutor()

    def broken() -> int:
        raise RuntimeError("queue closed")

    executor.executor_request_queue.get_request_queue_size = broken  # type: ignore[method-assign]
    work = await snapshot(executor)
    assert work.verdict is Verdict.UNKNOWN
    assert any("raised RuntimeError: queue closed" in r for r in work.reasons)


async def test_a_count_that_is_not_a_count_is_unknown() -> None:
    executor = NewExecutor()
    executor.executor_request_queue.get_request_queue_size = lambda: -1  # type: ignore[method-assign]
    assert (await snapshot(executor)).verdict is Verdict.UNKNOWN


async def test_a_shut_down_executor_is_unknown() -> None:
    executor = NewExecutor()
    executor.is_shutdown = True
    work = await snapshot(executor)
    assert work.verdict is Verdict.UNKNOWN and work.details["executor_shut_down"] is True


def test_reading_is_plain_data() -> None:
    reading = read_py_executor(NewExecutor([Request()], waiting=1, queued=2, in_transfer=3))
    assert json.loads(json.dumps(reading)) == reading  # crosses a Ray call as is
    assert (reading["running"], reading["waiting"], reading["queued"],
            reading["ctx_in_transfer"]) == (1, 1, 2, 3)


# -- choosing the probe by layout --------------------------------------------------------

def executor_named(name: str, **attrs: Any) -> Any:
    executor = type(name, (), {})()
    executor.__dict__.update(attrs)
    return executor


class FakeLLM:
    def __init__(self, executor: Any, **args: Any) -> None:
        self._executor = executor
        self.args = type("Args", (), args)()


@pytest.mark.parametrize("name,kind", [
    ("GenerationExecutorWorker", InProcessProbe), ("RayExecutor", RayProbe),
    ("GenerationExecutorProxy", ProxyStatsProbe), ("GenerationExecutorRpcProxy", ProxyStatsProbe),
    ("SomethingNew", UnknownLayoutProbe)])
def test_the_layout_is_chosen_by_executor_class_name(name: str, kind: type) -> None:
    assert type(probe_for_llm(FakeLLM(executor_named(name)))) is kind


async def test_in_process_probe_reads_the_workers_engine() -> None:
    worker = executor_named("GenerationExecutorWorker", engine=NewExecutor(in_transfer=1))
    work = await observe(probe_for_llm(FakeLLM(worker), Role.PREFILL))
    assert work.kv_sends_held == 1 and work.source == "trtllm.py_executor"
    worker.engine = None  # shut down
    work = await observe(probe_for_llm(FakeLLM(worker), Role.PREFILL))
    assert work.verdict is Verdict.UNKNOWN and "shut down" in work.reasons[0]


async def test_an_llm_without_executor_is_unknown() -> None:
    work = await observe(probe_for_llm(FakeLLM(None)))
    assert work.verdict is Verdict.UNKNOWN and "llm._executor" in work.reasons[0]


def test_factory_without_trtllm_names_the_extra() -> None:
    with pytest.raises(EngineNotInstalled, match=r"quiesce\[trtllm\]"):
        probe_factory(FakeLLM(executor_named("GenerationExecutorWorker")))


def test_registry_entry_point_builds_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trt_probe, "installed_trtllm_version", lambda: "1.2.1")
    probe = probe_for("trtllm", FakeLLM(executor_named("GenerationExecutorWorker")),
                      role="prefill")
    assert isinstance(probe, InProcessProbe) and probe.role is Role.PREFILL


async def test_unknown_layout_is_unknown() -> None:
    work = await observe(probe_for_llm(FakeLLM(executor_named("Future"))))
    assert work.verdict is Verdict.UNKNOWN and "'Future'" in work.reasons[0]


# -- zero readings: flow order, and confirmed across an executor iteration ---------------
# FAKES of the executor loop's interleavings; the real loop is covered by
# tests/gpu/test_trtllm.py (SIGTERM under load, every stream read to its end).

class MovesWhileRead(NewExecutor):
    """/tmp/r3.py: the loop moves the one request request queue → active right after the
    reader copied ``active_requests`` (a GIL switch between two reads)."""

    def __init__(self) -> None:
        super().__init__(queued=1)
        self._active: list[Request] = []

    @property
    def active_requests(self) -> list[Request]:
        snapshot = list(self._active)
        if self.executor_request_queue.request_queue.qsize():
            self.executor_request_queue.request_queue.get()
            self._active.append(Request())
        return snapshot

    @active_requests.setter
    def active_requests(self, value: list[Request]) -> None:
        self._active = value


async def test_a_request_moving_forward_between_reads_is_seen() -> None:
    work = await observe(InProcessProbe(None, executor=MovesWhileRead()))
    assert work.verdict is Verdict.BUSY


class Rebuilding(NewExecutor):
    """An older build's ``active_requests.clear(); extend(new)``: one read sees the list
    empty while it holds a request; ``iter_counter`` counts the loop's passes."""

    def __init__(self) -> None:
        super().__init__()
        self._held = [Request()]
        self.iter_counter = 7
        self.transient_reads = 1

    @property
    def active_requests(self) -> list[Request]:
        if self.transient_reads:
            self.transient_reads -= 1
            return []
        return self._held

    @active_requests.setter
    def active_requests(self, value: list[Request]) -> None:
        self._held = value


async def test_a_transient_empty_list_is_not_idle() -> None:
    executor = Rebuilding()
    work = await observe(InProcessProbe(None, executor=executor))
    assert work.verdict is Verdict.BUSY  # the second reading saw the request


async def test_a_zero_needs_the_loop_to_go_round() -> None:
    executor = Rebuilding()
    executor._held = []
    probe = InProcessProbe(None, executor=executor)
    work = await observe(probe)  # two zero readings, counter unchanged: not confirmed
    assert work.verdict is Verdict.UNKNOWN and "not confirmed" in work.reasons[0]
    executor.iter_counter += 1  # the loop went round since the last zero reading
    work = await observe(probe)
    assert work.verdict is Verdict.QUIESCENT and work.details["zero_confirmed"] is True


async def test_a_loop_parked_on_its_empty_request_queue_confirms_at_once() -> None:
    executor = NewExecutor()
    executor.iter_counter = 3  # type: ignore[attr-defined]
    queue_ = executor.executor_request_queue.request_queue
    parked = threading.Thread(target=lambda: queue_.get(timeout=5), daemon=True)
    parked.start()
    try:
        for _ in range(200):
            if queue_.not_empty._waiters:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.001)
        work = await observe(InProcessProbe(None, executor=executor))
        assert work.verdict is Verdict.QUIESCENT
    finally:
        queue_.put(0)
        parked.join(5)


async def test_without_a_counter_a_second_reading_confirms() -> None:
    executor = NewExecutor()
    reading = read_py_executor(executor)
    assert reading["iter_before"] is None and reading["parked"] is False
    assert (await observe(InProcessProbe(None, executor=executor))).verdict \
        is Verdict.QUIESCENT
