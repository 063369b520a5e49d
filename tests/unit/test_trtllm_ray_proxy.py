"""The TensorRT-LLM probes of the Ray and multi-process (proxy) layouts, against FAKES.

As in tests/unit/test_trtllm_probe.py (whose fake executors these reuse): TensorRT-LLM
cannot run here, so Ray's collective RPC and the proxy's results map and statistics
stream are stand-ins mirroring the research notes. The worker extension itself is the
real class, mixed into a stand-in worker. What these prove: ranks are ANDed and a short
or broken rank list is UNKNOWN; the proxy path is labelled weak and is UNKNOWN for
prefill. The real engine: tests/gpu/test_trtllm.py (ci/gpu/trtllm.sh on an H200).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from quiesce import Role, Verdict
from quiesce.adapters.trtllm.probe import RayProbe, probe_for_llm
from quiesce.adapters.trtllm.ray_extension import METHOD, QuiesceWorkerExtension
from quiesce.probe import UNKNOWN, observe
from tests.unit.test_trtllm_probe import (
    DriftedExecutor,
    FakeLLM,
    NewExecutor,
    Request,
    executor_named,
)

# -- Ray: the same reading in every rank, ANDed -----------------------------------------

class RayWorker(QuiesceWorkerExtension):
    """The extension mixed into a stand-in for TensorRT-LLM's Ray worker."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine


class RayLLM(FakeLLM):
    def __init__(self, workers: list[Any], world: int | None = None, adp: bool = False) -> None:
        parallel = type("Parallel", (), {"world_size": world if world else len(workers)})()
        super().__init__(executor_named("RayExecutor"), parallel_config=parallel,
                         enable_attention_dp=adp)
        self.workers = workers
        self.calls: list[str] = []

    def _collective_rpc(self, method: str) -> list[Any]:
        self.calls.append(method)
        return [getattr(w, method)() for w in self.workers]


async def test_ray_ranks_are_anded() -> None:
    idle = RayLLM([RayWorker(NewExecutor()), RayWorker(NewExecutor())])
    work = await observe(probe_for_llm(idle, Role.PREFILL))
    assert work.verdict is Verdict.QUIESCENT and work.details["ranks"] == 2
    assert idle.calls == [METHOD]
    one_busy = RayLLM([RayWorker(NewExecutor()), RayWorker(NewExecutor(in_transfer=1))])
    assert (await observe(probe_for_llm(one_busy, Role.PREFILL))).kv_sends_held == 1


async def test_ray_rank_counts_add_up_only_with_attention_dp() -> None:
    workers = [RayWorker(NewExecutor([Request()])), RayWorker(NewExecutor([Request()]))]
    assert (await observe(probe_for_llm(RayLLM(workers, adp=True)))).running == 2
    assert (await observe(probe_for_llm(RayLLM(workers, adp=False)))).running == 1


async def test_a_short_rank_list_is_unknown() -> None:
    llm = RayLLM([RayWorker(NewExecutor())], world=2)
    work = await observe(probe_for_llm(llm))
    assert work.verdict is Verdict.UNKNOWN and "only 1 of 2 Ray ranks" in work.reasons[0]


async def test_one_drifted_or_engineless_rank_makes_the_whole_unknown() -> None:
    for other in (DriftedExecutor(), None):
        work = await observe(probe_for_llm(RayLLM([RayWorker(NewExecutor()),
                                                   RayWorker(other)])))
        assert work.verdict is Verdict.UNKNOWN, work.summary()
        assert all(r.startswith("rank 1:") for r in work.errors)


async def test_a_busy_rank_wins_over_an_unknown_one() -> None:
    llm = RayLLM([RayWorker(NewExecutor(waiting=3)), RayWorker(DriftedExecutor())])
    assert (await observe(probe_for_llm(llm))).verdict is Verdict.BUSY


async def test_malformed_rank_answers_are_unknown() -> None:
    llm = RayLLM([RayWorker(NewExecutor())])
    llm._collective_rpc = lambda method: [{"running": 0}]  # type: ignore[method-assign]
    work = await observe(probe_for_llm(llm))
    assert work.verdict is Verdict.UNKNOWN and "reading version" in work.reasons[0]


async def test_missing_extension_is_unknown_with_the_fix() -> None:
    llm = RayLLM([])

    def rpc(method: str) -> list[Any]:
        raise AttributeError(f"The RayGPUWorker has no method called '{method}'.")

    llm._collective_rpc = rpc  # type: ignore[method-assign]
    work = await observe(RayProbe(llm, ranks=1))
    assert work.verdict is Verdict.UNKNOWN
    assert "ray_worker_extension_cls=" in work.reasons[0]


async def test_unreadable_world_size_is_unknown() -> None:
    llm = FakeLLM(executor_named("RayExecutor"))
    work = await observe(probe_for_llm(llm))
    assert work.verdict is Verdict.UNKNOWN and "how many Ray ranks" in work.reasons[0]


async def test_a_hanging_ray_call_is_unknown_at_the_timeout() -> None:
    release = threading.Event()
    llm = RayLLM([RayWorker(NewExecutor())])
    llm._collective_rpc = lambda method: release.wait()  # type: ignore[method-assign,assignment,return-value]
    try:
        work = await observe(probe_for_llm(llm), timeout=0.05)
    finally:
        release.set()
    assert work.verdict is Verdict.UNKNOWN and "did not answer within" in work.reasons[0]


def test_the_extension_guards_nothing_outside_a_quiesce_worker() -> None:
    reading = RayWorker(NewExecutor()).quiesce_pending_work()
    assert reading["signal_guarded"] is False and reading["errors"] == []


# -- the multi-process proxy: the weak statistics path -----------------------------------

class Stats:
    """``llm.get_stats_async``: yields what is queued, then times out like TensorRT-LLM."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[Any]:
        while self.items:
            yield self.items.pop(0)
        raise asyncio.TimeoutError


class ProxyLLM(FakeLLM):
    def __init__(self, unfinished: int = 0, stats: list[Any] | None = None) -> None:
        super().__init__(executor_named("GenerationExecutorProxy",
                                        _results=dict.fromkeys(range(unfinished))))
        self.stats = Stats(stats or [])

    def get_stats_async(self, timeout: float) -> Stats:
        return self.stats


async def test_proxy_prefill_is_always_unknown() -> None:
    work = await observe(probe_for_llm(ProxyLLM(), Role.PREFILL))
    assert work.verdict is Verdict.UNKNOWN and work.kv_sends_held is UNKNOWN
    assert any("cannot see context requests" in r for r in work.reasons)


@pytest.mark.parametrize("role", [Role.AGGREGATED, Role.DECODE])
async def test_proxy_is_a_labelled_weak_signal(role: Role) -> None:
    work = await observe(probe_for_llm(ProxyLLM(), role))
    assert work.verdict is Verdict.QUIESCENT
    assert work.details["confidence"] == "low" and work.source == "trtllm.proxy_stats"
    assert (await observe(probe_for_llm(ProxyLLM(unfinished=2), role))).running == 2


async def test_proxy_uses_the_newest_statistic_and_json_text() -> None:
    stats = [{"iter": 1, "numActiveRequests": 5, "numQueuedRequests": 0},
             json.dumps({"iter": 2, "numActiveRequests": 3, "numQueuedRequests": 1})]
    work = await observe(probe_for_llm(ProxyLLM(stats=stats), stats_per_read=2))
    assert (work.running, work.waiting, work.details["stats_iter"]) == (3, 1, "2")


async def test_proxy_statistic_without_counts_is_unknown() -> None:
    work = await observe(probe_for_llm(ProxyLLM(stats=[{"iter": 3}])))
    assert work.verdict is Verdict.UNKNOWN


async def test_proxy_without_results_map_is_unknown() -> None:
    llm = ProxyLLM()
    del llm._executor._results
    assert (await observe(probe_for_llm(llm))).verdict is Verdict.UNKNOWN


async def test_proxy_takes_at_most_one_statistic_and_only_when_idle() -> None:
    """The statistics queue is shared (Dynamo's metrics read it too): a read takes one
    record by default, and none while the proxy holds unfinished results."""
    stats = [{"iter": i, "numActiveRequests": 0, "numQueuedRequests": 0} for i in range(5)]
    busy = ProxyLLM(unfinished=1, stats=stats)
    assert (await observe(probe_for_llm(busy))).running == 1
    assert len(busy.stats.items) == 5  # nothing consumed
    idle = ProxyLLM(stats=stats)
    work = await observe(probe_for_llm(idle))
    assert work.verdict is Verdict.QUIESCENT and len(idle.stats.items) == 4
    never = ProxyLLM(stats=[{"iter": 1, "numActiveRequests": 0, "numQueuedRequests": 0}])
    await observe(probe_for_llm(never, stats_per_read=0))
    assert len(never.stats.items) == 1


async def test_proxy_with_a_kv_connector_is_unknown() -> None:
    """FAKE: connector saves outlive the results; the GPU suite has no connector case."""
    llm = ProxyLLM()
    llm.args.kv_connector_config = {"connector_module": "x"}
    work = await observe(probe_for_llm(llm))
    assert work.verdict is Verdict.UNKNOWN
    assert any("KV connector" in r for r in work.reasons)


async def test_a_hung_ray_read_is_not_stacked_and_does_not_fill_the_default_executor(
        ) -> None:
    """/tmp/r4.py: FAKE Ray that never answers. Each timed-out read used to leave a thread
    of the default executor stuck, until ``to_thread(llm.shutdown)`` could not start."""
    release = threading.Event()
    calls: list[str] = []
    llm = RayLLM([RayWorker(NewExecutor())])

    def hang(method: str) -> None:
        calls.append(method)
        release.wait(10)

    llm._collective_rpc = hang  # type: ignore[method-assign,assignment]
    probe = RayProbe(llm, ranks=1)
    try:
        works = [await observe(probe, timeout=0.01) for _ in range(40)]
        assert calls == [METHOD]  # one read outstanding, never a second
        assert "did not answer within" in works[0].reasons[0]
        assert all("has not returned" in w.reasons[0] for w in works[1:])
        assert all(w.verdict is Verdict.UNKNOWN for w in works)
        ran = await asyncio.wait_for(asyncio.to_thread(lambda: "shutdown ran"), 2.0)
        assert ran == "shutdown ran"
    finally:
        release.set()
    for _ in range(200):  # once the hung read returns, reads start again
        if probe._reading_since is None:
            break
        await asyncio.sleep(0.005)
    llm._collective_rpc = RayLLM._collective_rpc.__get__(llm)  # type: ignore[method-assign]
    assert (await observe(probe)).verdict is Verdict.QUIESCENT
