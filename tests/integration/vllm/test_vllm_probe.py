"""The vLLM probe against a real vLLM engine on the CPU (tiny random-weight Llama).

One AsyncLLM per module (engine start-up is the expensive part), with the test
connector that holds every finished request's KV blocks until the test releases them,
so the "stream ended, KV still held for a decoder" state is deterministic.
The GPU suite (tests/gpu/test_vllm.py) covers the same scenarios with the CUDA build.
"""

from __future__ import annotations

import asyncio
import types
import uuid
from pathlib import Path
from typing import Any

import pytest

from quiesce import AdmissionGate, InMemoryDiscovery, Role, StageOutcome, Verdict
from quiesce.budget import Deadline
from quiesce.drain import DrainConfig, wait_quiescent
from quiesce.lifecycle import Lifecycle, State
from tests.integration.vllm.conftest import SKIP_REASON, hold, release

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)

from quiesce.adapters.vllm import VllmEngineControl, VllmProbe, installed_vllm_version  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

FAST = DrainConfig(router_grace_s=0, poll_base_s=0.001, poll_cap_s=0.01, probe_timeout_s=5)


async def generate(llm: Any, max_tokens: int, started: asyncio.Event | None = None) -> int:
    """Run one request to its end; returns how many tokens it produced."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    produced = 0
    async for output in llm.generate("hello world", params, request_id=uuid.uuid4().hex):
        produced = len(output.outputs[0].token_ids)
        if started is not None:
            started.set()
    return produced


async def settle(probe: VllmProbe, release_dir: Path) -> None:
    """Release anything held and wait until the engine is quiescent again."""
    release(release_dir)
    report, last = await wait_quiescent(probe, Deadline.after(60), FAST)
    assert report.outcome is StageOutcome.COMPLETED, last.summary()
    hold(release_dir)


def signals(work: Any) -> set[Any]:
    return {v for k, v in work.details.items() if k.endswith("signal")}


async def test_idle_engine_is_quiescent_on_the_board_and_by_utility_call(engine: Any) -> None:
    probe = VllmProbe(engine, Role.PREFILL)
    work = await probe.pending_work()
    assert work.verdict is Verdict.QUIESCENT, work.summary()
    assert work.kv_sends_held == 0
    assert signals(work) == {"board"}, probe.board_off
    assert probe.version == installed_vllm_version()
    by_call = await VllmProbe(engine, Role.PREFILL, board=False).pending_work()
    assert by_call.verdict is Verdict.QUIESCENT, by_call.summary()
    assert signals(by_call) == {"quiesce_snapshot"}


async def test_busy_engine_is_not_quiescent(engine: Any, release_dir: Path) -> None:
    probe = VllmProbe(engine, Role.PREFILL)
    by_call = VllmProbe(engine, Role.PREFILL, board=False)
    started = asyncio.Event()
    streams = [asyncio.create_task(generate(engine, 96, started)) for _ in range(4)]
    await asyncio.wait_for(started.wait(), timeout=60)
    for reader in (probe, by_call):
        work = await reader.pending_work()
        assert work.verdict is Verdict.BUSY, work.summary()
        assert work.running > 0 or work.waiting > 0  # type: ignore[operator]
    assert signals(work) == {"quiesce_snapshot"} and signals(await probe.pending_work()) == {
        "board"}
    assert await asyncio.gather(*streams) == [96] * 4
    await settle(probe, release_dir)


async def test_held_kv_keeps_a_prefill_worker_busy_until_released(engine: Any,
                                                                 release_dir: Path) -> None:
    hold(release_dir)
    detailed = VllmProbe(engine, Role.PREFILL)
    by_call = VllmProbe(engine, Role.PREFILL, board=False)
    has_work_only = VllmProbe(engine, Role.PREFILL, detailed=False)
    assert await asyncio.gather(*(generate(engine, 8) for _ in range(3))) == [8] * 3
    # every stream has ended: the frontend sees nothing, the engine still holds the KV
    assert engine.output_processor.get_num_unfinished_requests() == 0
    for reader in (detailed, by_call):
        work = await reader.pending_work()
        assert work.verdict is Verdict.BUSY, work.summary()
        assert work.kv_sends_held == 3
        assert work.running == 0 and work.waiting == 0
    coarse = await has_work_only.pending_work()
    assert coarse.verdict is Verdict.BUSY
    assert coarse.engine_has_work is True
    release(release_dir)
    report, last = await wait_quiescent(detailed, Deadline.after(60), FAST)
    assert report.outcome is StageOutcome.COMPLETED, last.summary()
    assert last.kv_sends_held == 0
    assert (await has_work_only.pending_work()).is_quiescent
    hold(release_dir)


async def test_the_board_wakes_a_waiter_when_held_kv_is_released(engine: Any,
                                                                release_dir: Path) -> None:
    """No polling: each wait ends on a board change (or the test's 60 s guard fails it)."""
    hold(release_dir)
    probe = VllmProbe(engine, Role.PREFILL)
    assert await generate(engine, 8) == 8
    work = await probe.pending_work()
    assert work.kv_sends_held == 1, work.summary()
    release(release_dir)
    wakes = 0
    while not work.is_quiescent:
        await asyncio.wait_for(probe.wait_for_change(work, timeout=3600), timeout=60)
        wakes += 1
        work = await probe.pending_work()
        assert work.verdict is not Verdict.UNKNOWN, work.reasons
    assert signals(work) == {"board"}
    assert wakes <= 10, f"{wakes} wake-ups for one release: the notifier spins"
    hold(release_dir)


async def test_drain_of_a_prefill_worker_waits_for_the_kv_and_never_lies(
        engine: Any, release_dir: Path) -> None:
    hold(release_dir)
    probe = VllmProbe(engine, Role.PREFILL)
    gate = AdmissionGate()
    lifecycle = Lifecycle(gate=gate, probe=probe, discovery=InMemoryDiscovery("p"),
                          config=FAST)
    await lifecycle.start()

    async def serve(max_tokens: int) -> int:
        async with gate.admit():
            return await generate(engine, max_tokens)

    assert await asyncio.gather(serve(8), serve(8)) == [8, 8]
    # the decoder never pulls within the budget: forced outcome, never a false drained
    run = await lifecycle.drain(budget_s=1.0)
    report = await run.wait(30)
    assert report is not None and not report.drained
    assert report.outcome is StageOutcome.TIMED_OUT
    assert lifecycle.state is State.DRAINING
    assert "kv_sends_held=2" in (lifecycle.last_error or "")
    # now the decoder pulls: a fresh drain completes
    run = await lifecycle.drain(budget_s=60)
    release(release_dir)
    report = await run.wait(60)
    assert report is not None and report.drained, lifecycle.last_error
    assert lifecycle.state is State.DRAINED
    await lifecycle.stop()
    hold(release_dir)


async def test_abort_all_aborts_running_requests(engine: Any, release_dir: Path) -> None:
    control = VllmEngineControl(engine)
    probe = VllmProbe(engine, Role.AGGREGATED)
    started = asyncio.Event()
    streams = [asyncio.create_task(generate(engine, 400, started)) for _ in range(2)]
    await asyncio.wait_for(started.wait(), timeout=60)
    assert await control.abort_all("test") == 2
    produced = await asyncio.gather(*streams, return_exceptions=True)
    assert all(isinstance(p, BaseException) or p < 400 for p in produced), produced
    await settle(probe, release_dir)


async def test_an_engine_object_missing_attributes_is_unknown(engine: Any) -> None:
    no_core = types.SimpleNamespace(output_processor=engine.output_processor)
    work = await VllmProbe(no_core, Role.AGGREGATED).pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("engine_core" in r for r in work.reasons), work.reasons
    no_frontend = types.SimpleNamespace(engine_core=engine.engine_core,
                                        vllm_config=engine.vllm_config)
    work = await VllmProbe(no_frontend, Role.AGGREGATED).pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("output_processor" in r for r in work.reasons), work.reasons


async def test_probe_after_engine_shutdown_is_unknown_with_the_reason(engine: Any) -> None:
    """Last in this module: it stops the shared engine."""
    probe = VllmProbe(engine, Role.AGGREGATED)
    await asyncio.to_thread(engine.shutdown)
    work = await probe.pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert work.reasons
