"""Issue 19 findings on the TensorRT-LLM probe and control, against FAKES.

TensorRT-LLM cannot be installed here (PyPI holds a stub that downloads from NVIDIA's
index). Each fake below follows the structure of the upstream file its docstring cites
(read, not copied); the real thing is covered by the GPU test each docstring names in
tests/gpu/test_trtllm.py. Every test here failed on the code before its fix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from typing import Any

import pytest

from quiesce import Role, Verdict
from quiesce.adapters.trtllm.control import WAKE_REQUEST_ID, TrtllmEngineControl, wake_idle_loop
from quiesce.adapters.trtllm.probe import InProcessProbe, probe_for_llm
from quiesce.adapters.trtllm.ray_extension import METHOD, QuiesceWorkerExtension
from quiesce.probe import observe
from tests.unit.test_trtllm_probe import NewExecutor, OldExecutor, RequestQueue
from tests.unit.test_trtllm_ray_proxy import RayLLM, RayWorker

CONTROL_REQUEST_ID = -2


@dataclasses.dataclass
class QueueItem:
    """``RequestQueueItem``: an id, ``is_control_request`` for the control sentinel."""

    id: int

    @property
    def is_control_request(self) -> bool:
        return self.id == CONTROL_REQUEST_ID

    @property
    def is_normal_request(self) -> bool:
        return self.id >= 0


class ParkingOnExecutor(NewExecutor):
    """Fake following tensorrt_llm/_torch/pyexecutor/py_executor.py (Jan-2026 layout,
    ``_fetch_and_enqueue_requests`` / ``_handle_special_queue_items`` on ``PyExecutor``;
    the same lists in a later 2026 py_executor.py): the control sentinel was fetched with a normal
    request behind it; ``_handle_special_queue_items`` put the sentinel in
    ``control_requests`` and the request in ``request_accumulated``;
    ``_handle_control_request`` pops the sentinel and blocks on
    ``control_action_done.wait()``. ``iter_counter`` is bumped at the end of the pass;
    the parked request is fetched again only in the next pass. The real thing is covered
    by tests/gpu/test_trtllm.py::test_a_request_parked_behind_a_control_action_is_work."""

    def __init__(self) -> None:
        super().__init__()
        self.iter_counter = 10
        self.control_requests: list[QueueItem] = [QueueItem(CONTROL_REQUEST_ID)]
        self.request_accumulated: list[QueueItem] = [QueueItem(7)]

    def block(self) -> None:
        """``_handle_control_request``: the sentinel popped, the loop waits."""
        self.control_requests.pop(0)

    def control_done(self) -> None:
        """``control_action_done`` set: the pass ends (counter bumped), nothing re-fetched."""
        self.iter_counter += 1

    def next_pass(self) -> None:
        """The next pass re-fetches the parked request into the waiting queue."""
        self.waiting_queue.extend(item.id for item in self.request_accumulated)
        self.request_accumulated.clear()
        self.iter_counter += 1


class MidEraQueue(RequestQueue):
    """The mid-era ``ExecutorRequestQueue`` (executor_request_queue.py 007a7508): it holds
    the waiting queue, ``control_requests``, ``request_accumulated`` and
    ``enqueue_control_request``."""

    def __init__(self) -> None:
        super().__init__(waiting=0)
        self.control_requests: list[QueueItem] = [QueueItem(CONTROL_REQUEST_ID)]
        self.request_accumulated: list[QueueItem] = [QueueItem(7)]

    def enqueue_control_request(self) -> None:
        self.request_queue.put(CONTROL_REQUEST_ID)


class ParkingOnRequestQueue(OldExecutor):
    """Fake following tensorrt_llm/_torch/pyexecutor/executor_request_queue.py 007a7508
    (``_fetch_and_process_requests`` returns ``[]`` while ``control_requests`` is not
    empty; ``_handle_special_queue_items`` parks what follows the sentinel in
    ``request_accumulated``) with the PyExecutor of that era. The real thing is covered
    by tests/gpu/test_trtllm.py::test_a_request_parked_behind_a_control_action_is_work."""

    def __init__(self) -> None:
        super().__init__()
        self.iter_counter = 10
        self.executor_request_queue: Any = MidEraQueue()

    def block(self) -> None:
        self.executor_request_queue.control_requests.pop(0)

    def control_done(self) -> None:
        self.iter_counter += 1

    def next_pass(self) -> None:
        queue_ = self.executor_request_queue
        queue_.waiting_queue.extend(item.id for item in queue_.request_accumulated)
        queue_.request_accumulated.clear()
        self.iter_counter += 1


@pytest.mark.parametrize("make", [ParkingOnExecutor, ParkingOnRequestQueue],
                         ids=["on-PyExecutor", "on-ExecutorRequestQueue"])
async def test_a_request_parked_behind_a_control_sentinel_is_work(make: Any) -> None:
    """Item 1: a zero read during the control block, then one after the pass ended but
    before the re-fetch, used to confirm a false zero."""
    executor = make()
    probe = InProcessProbe(None, executor=executor)
    fetched = await observe(probe)
    assert fetched.verdict is Verdict.BUSY, fetched.summary()
    assert fetched.queues["control_requests"] == 1
    assert fetched.queues["parked_behind_control"] == 1
    executor.block()
    during = await observe(probe)
    assert during.verdict is Verdict.BUSY, during.summary()
    assert during.queues["parked_behind_control"] == 1
    executor.control_done()
    after = await observe(probe)
    assert after.verdict is Verdict.BUSY, after.summary()
    assert after.queues["parked_behind_control"] == 1 and after.queues["control_requests"] == 0
    executor.next_pass()  # fetched again: now in the waiting queue
    fetched = await observe(probe)
    assert fetched.verdict is Verdict.BUSY and fetched.waiting == 1
    assert fetched.queues["parked_behind_control"] == 0


async def test_a_request_parked_behind_ray_sleep_is_work() -> None:
    """Item 1 under Ray ``sleep``/``wakeup`` (ray_gpu_worker.py 0acd798:
    ``control_action_decorator``), read through the worker extension in every rank."""
    executor = ParkingOnExecutor()
    llm = RayLLM([RayWorker(executor)])
    probe = probe_for_llm(llm)
    assert (await observe(probe)).verdict is Verdict.BUSY
    executor.block()
    assert (await observe(probe)).verdict is Verdict.BUSY
    executor.control_done()
    work = await observe(probe)
    assert work.verdict is Verdict.BUSY and work.queues["parked_behind_control"] == 1


async def test_control_lists_missing_where_control_requests_exist_is_unknown() -> None:
    """Drift: the build can take control requests but the lists moved: fail closed."""
    executor = ParkingOnExecutor()
    del executor.control_requests
    executor.executor_request_queue.enqueue_control_request = (  # type: ignore[attr-defined]
        lambda: None)
    work = await observe(InProcessProbe(None, executor=executor))
    assert work.verdict is Verdict.UNKNOWN
    assert any("control_requests" in r for r in work.reasons)


class ConnectorOldExecutor(OldExecutor):
    """Fake following tensorrt_llm/_torch/pyexecutor/py_executor.py of the older layout
    (``ctx_in_transmission_requests``, before PR #9891): ``_do_terminate_request`` keeps
    the KV when ``kv_connector_manager.request_finished()`` returns True; the request has
    left ``active_requests`` and is not in ``ctx_in_transmission_requests``. The real
    thing is covered by
    tests/gpu/test_trtllm.py::test_a_kv_connector_on_the_older_layout_is_unknown."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_connector_manager: Any = object()  # a save is in flight, invisible


@pytest.mark.parametrize("role", list(Role))
async def test_a_kv_connector_on_the_older_layout_is_unknown(role: Role) -> None:
    """Item 2, in-process and Ray: no zero can be trusted while a connector may hold KV."""
    for probe in (InProcessProbe(None, role, executor=ConnectorOldExecutor()),
                  probe_for_llm(RayLLM([RayWorker(ConnectorOldExecutor())]), role)):
        work = await observe(probe)
        assert work.verdict is Verdict.UNKNOWN, work.summary()
        assert any("KV connector" in r for r in work.reasons)


async def test_a_kv_connector_on_the_transfer_manager_layout_is_counted_there() -> None:
    """Main routes connector saves through ``AsyncTransferManager.start_transfer``."""
    executor = NewExecutor()
    executor.kv_connector_manager = object()  # type: ignore[attr-defined]
    assert (await observe(InProcessProbe(None, executor=executor))).verdict \
        is Verdict.QUIESCENT


@pytest.mark.parametrize("requested,says", [
    (True, "shutdown was requested"), (False, "fatal error")])
async def test_a_shut_down_executor_says_whether_it_was_asked_to(requested: bool,
                                                                 says: str) -> None:
    """Item 5. Fake following py_executor.py (main 0004396): ``is_shutdown`` is set when
    the shutdown sentinel is dequeued (``enqueue_shutdown_request`` also sets the
    queue's ``active = False``) and on fatal errors (``active`` stays True). The real
    thing: tests/gpu/test_trtllm.py::test_sigterm_to_the_main_process_under_load_loses_nothing."""
    executor = NewExecutor()
    executor.is_shutdown = True
    executor.executor_request_queue.active = not requested  # type: ignore[attr-defined]
    work = await observe(InProcessProbe(None, executor=executor))
    assert work.verdict is Verdict.UNKNOWN
    assert any(says in r for r in work.reasons), work.reasons


# -- item 4: the old RayExecutor never fills _results -------------------------------------

class CancellingExecutor(NewExecutor):
    """``PyExecutor.cancel_request(id)`` → ``executor_request_queue.enqueue_cancel_request``."""

    def __init__(self, ids: list[int], queued: list[int], rank: int = 0) -> None:
        super().__init__()
        self.dist = type("Dist", (), {"rank": rank})()
        self.active_requests = [type("R", (), {"py_request_id": i})() for i in ids]
        for i in queued:
            self.executor_request_queue.request_queue.put(QueueItem(i))  # type: ignore[arg-type]
        self.cancelled: list[int] = []

    def cancel_request(self, id: int) -> None:
        self.cancelled.append(id)


class OldRayLLM(RayLLM):
    """Fake following tensorrt_llm/executor/ray_executor.py 50a6f3cc: ``submit`` builds
    the ``GenerationResult`` and enqueues it on the leader worker, and never puts it in
    ``_results``. The real thing is covered by
    tests/gpu/test_trtllm.py::test_abort_all_on_the_old_ray_executor_cancels_in_the_workers."""

    def _collective_rpc(self, method: str, args: tuple[Any, ...] = (),
                        kwargs: dict[str, Any] | None = None, non_block: bool = False,
                        unique_reply_rank: int | None = None) -> list[Any]:
        self.calls.append(method)
        workers = self.workers if unique_reply_rank is None else \
            [self.workers[unique_reply_rank]]
        return [getattr(w, method)(*args, **(kwargs or {})) for w in workers]


async def test_abort_all_on_the_old_ray_executor_cancels_in_the_workers() -> None:
    """Item 4: ``llm._executor`` has no ``_results``; abort-all used to raise LookupError."""
    leader = CancellingExecutor([3, 4], queued=[5])
    other = CancellingExecutor([6], queued=[], rank=1)
    llm = OldRayLLM([RayWorker(leader), RayWorker(other)], adp=True)
    aborted = await TrtllmEngineControl(llm).abort_all("drain budget ran out")
    assert sorted(leader.cancelled) == [3, 4, 5, 6] and other.cancelled == []
    assert aborted == 4
    assert llm.calls == ["quiesce_request_ids", "quiesce_cancel_requests", METHOD]


def test_the_request_queue_snapshot_leaves_the_queue_as_it_was() -> None:
    executor = CancellingExecutor([], queued=[1, 2])
    worker = RayWorker(executor)
    assert isinstance(worker, QuiesceWorkerExtension)
    assert sorted(worker.quiesce_request_ids()) == [1, 2]
    assert executor.executor_request_queue.request_queue.qsize() == 2
    q: queue.Queue[Any] = executor.executor_request_queue.request_queue
    assert [item.id for item in list(q.queue)] == [1, 2]


# -- item 3: the idle-loop gap, and the opt-in wake-up that reaps -------------------------

class IdleWithTransfer(NewExecutor):
    """Fake following tensorrt_llm/_torch/pyexecutor/py_executor.py (Jan-2026 layout):
    with no active and no waiting request, ``_fetch_and_enqueue_requests`` blocks on the
    request queue with no timeout (MPI) while a context transfer is counted; the next
    pass has nothing to fit and calls ``_check_disagg_ctx_cache_transfer_status(1)``,
    which reaps the finished transfer; ``iter_counter`` is bumped at the end of the pass.
    ``cancel_request`` enqueues a cancel item. The real thing is covered by
    tests/gpu/test_trtllm.py::test_context_worker_drains_only_after_the_generation_worker_pulled_the_kv."""

    def __init__(self) -> None:
        super().__init__(in_transfer=1)
        self.iter_counter = 5
        self.woken_by: list[int] = []

    def cancel_request(self, id: int) -> None:
        self.executor_request_queue.request_queue.put(QueueItem(id))  # type: ignore[arg-type]

    def loop_pass(self) -> None:
        """One blocking fetch, then the no-fit reaping check, then the counter."""
        item: Any = self.executor_request_queue.request_queue.get(timeout=10)
        self.woken_by.append(item.id)
        self.async_transfer_manager._requests.clear()  # reaped: the pull had finished
        self.iter_counter += 1


async def test_the_idle_gap_is_busy_and_a_wake_up_reaps_it() -> None:
    executor = IdleWithTransfer()
    probe = InProcessProbe(None, Role.PREFILL, executor=executor)
    assert wake_idle_loop(executor) == ("not sent: the executor loop is not parked on "
                                        "its request queue")
    assert executor.executor_request_queue.request_queue.qsize() == 0
    loop = threading.Thread(target=executor.loop_pass, daemon=True)
    loop.start()
    waiters = executor.executor_request_queue.request_queue.not_empty._waiters  # type: ignore[attr-defined]
    for _ in range(500):
        if waiters:
            break
        await asyncio.sleep(0.002)
    stale = await observe(probe)
    assert stale.verdict is Verdict.BUSY and stale.kv_sends_held == 1  # stale-high, safe
    assert "idle" in str(stale.details["note"])
    assert wake_idle_loop(executor) is None
    loop.join(10)
    assert executor.woken_by == [WAKE_REQUEST_ID]
    assert (await observe(probe)).kv_sends_held == 0


def test_a_wake_up_is_refused_without_a_held_transfer() -> None:
    executor = NewExecutor()
    assert wake_idle_loop(executor) == ("not sent: no context transfer is held by an "
                                        "idle executor")
    busy = NewExecutor(waiting=1, in_transfer=1)
    assert "no context transfer is held by an idle executor" in str(wake_idle_loop(busy))
