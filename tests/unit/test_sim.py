"""The simulated engine: queues, time model, held KV, receives, abort, determinism."""

from __future__ import annotations

import asyncio

import pytest

from quiesce import ConfigError, Role, Verdict
from quiesce.adapters.sim import (
    KVFate,
    RequestAborted,
    SimConfig,
    SimEngine,
    SimProbe,
    SimRequest,
)

FAST = SimConfig(decode_step_s=0.001, kv_pull_latency_s=(0.005, 0.01), kv_recv_latency_s=0.005)


async def collect(engine: SimEngine, request: SimRequest) -> list[int]:
    return [token async for token in engine.generate(request)]


async def test_streams_every_token_and_goes_idle() -> None:
    engine = SimEngine(FAST)
    await engine.start()
    probe = SimProbe(engine)
    try:
        results = await asyncio.gather(*(collect(engine, SimRequest(f"r{i}", max_tokens=5 + i))
                                         for i in range(4)))
        assert [len(r) for r in results] == [5, 6, 7, 8]
        assert results[0] == [1, 2, 3, 4, 5]
        assert engine.counts() == (0, 0, 0, 0)
        assert (await probe.pending_work()).verdict is Verdict.QUIESCENT
        assert engine.tokens_generated == 26
    finally:
        await engine.shutdown()


async def test_probe_sees_waiting_and_running_with_a_small_batch() -> None:
    engine = SimEngine(SimConfig(max_running=1, decode_step_s=0.002))
    await engine.start()
    probe = SimProbe(engine)
    try:
        tasks = [asyncio.create_task(collect(engine, SimRequest(f"r{i}", max_tokens=20)))
                 for i in range(3)]
        while engine.counts()[1] == 0:
            await engine.wait_for_change(1.0)
        work = await probe.pending_work()
        assert work.running == 1
        assert work.waiting == 2
        assert work.verdict is Verdict.BUSY
        assert work.details["estimated_drain_s"] > 0  # type: ignore[operator]
        await asyncio.gather(*tasks)
    finally:
        await engine.shutdown()


async def test_prefill_holds_kv_until_pulled() -> None:
    engine = SimEngine(SimConfig(decode_step_s=0.001, kv_pull_latency_s=(0.02, 0.03)))
    await engine.start()
    probe = SimProbe(engine, Role.PREFILL)
    try:
        tokens = await collect(engine, SimRequest("p", max_tokens=1, remote_decode=True))
        assert tokens == [1]
        work = await probe.pending_work()
        assert work.kv_sends_held == 1
        assert work.verdict is Verdict.BUSY
        assert await asyncio.wait_for(engine.kv_fate("p"), timeout=5) is KVFate.PULLED
        assert (await probe.pending_work()).is_quiescent
    finally:
        await engine.shutdown()


async def test_never_pulled_kv_stays_held_until_abort_which_counts_it_freed_early() -> None:
    engine = SimEngine(FAST)
    await engine.start()
    try:
        await collect(engine, SimRequest("n", max_tokens=2, remote_decode=True, never_pulled=True))
        fate = asyncio.create_task(engine.kv_fate("n"))
        await asyncio.sleep(0.05)
        assert engine.counts()[2] == 1
        assert not fate.done()
        assert await engine.abort_all() == 1
        assert await fate is KVFate.FREED_EARLY
        assert engine.kv_freed_early == 1
    finally:
        await engine.shutdown()


async def test_release_held_simulates_the_pull() -> None:
    engine = SimEngine(FAST)
    await engine.start()
    try:
        await collect(engine, SimRequest("h", max_tokens=1, remote_decode=True, never_pulled=True))
        assert engine.release_held() == 1
        assert await engine.kv_fate("h") is KVFate.PULLED
        assert engine.kv_freed_early == 0
    finally:
        await engine.shutdown()


async def test_decode_awaits_kv_before_scheduling() -> None:
    engine = SimEngine(SimConfig(decode_step_s=0.001, kv_recv_latency_s=0.05))
    await engine.start()
    probe = SimProbe(engine, Role.DECODE)
    try:
        task = asyncio.create_task(collect(engine, SimRequest("d", max_tokens=3,
                                                              remote_prefill=True)))
        await asyncio.sleep(0)
        work = await probe.pending_work()
        assert work.kv_recvs_awaited == 1
        assert work.verdict is Verdict.BUSY
        assert await task == [1, 2, 3]
        assert (await probe.pending_work()).is_quiescent
    finally:
        await engine.shutdown()


async def test_abort_ends_the_stream_with_a_typed_error() -> None:
    engine = SimEngine(SimConfig(decode_step_s=0.002))
    await engine.start()
    try:
        seen: list[int] = []

        async def consume() -> None:
            async for token in engine.generate(SimRequest("a", max_tokens=1000)):
                seen.append(token)

        task = asyncio.create_task(consume())
        while not seen:
            await engine.wait_for_change(1.0)
        assert engine.abort("a")
        with pytest.raises(RequestAborted):
            await task
        assert not engine.abort("a")
        assert engine.counts() == (0, 0, 0, 0)
    finally:
        await engine.shutdown()


async def test_client_disconnect_aborts_the_request() -> None:
    engine = SimEngine(SimConfig(decode_step_s=0.002))
    await engine.start()
    try:
        stream = engine.generate(SimRequest("c", max_tokens=1000))
        assert await stream.__anext__() == 1
        await stream.aclose()  # type: ignore[attr-defined]
        assert engine.counts() == (0, 0, 0, 0)
    finally:
        await engine.shutdown()


async def test_stopped_engine_is_unknown_to_its_probe_and_refuses_requests() -> None:
    engine = SimEngine(FAST)
    await engine.start()
    await engine.shutdown()
    work = await SimProbe(engine).pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert "stopped" in work.reasons[0]
    with pytest.raises(RequestAborted):
        await collect(engine, SimRequest("late"))


async def test_kv_pull_latencies_are_deterministic_under_a_seed() -> None:
    async def pulls(seed: int) -> list[float]:
        engine = SimEngine(SimConfig(seed=seed, decode_step_s=0.001, time_scale=0.01))
        return [engine._rng.uniform(*engine.config.kv_pull_latency_s) for _ in range(5)]

    assert await pulls(7) == await pulls(7)
    assert await pulls(7) != await pulls(8)


@pytest.mark.parametrize("field,kwargs", [
    ("max_running", {"max_running": 0}),
    ("decode_step_s", {"decode_step_s": 0}),
    ("kv_pull_latency_s", {"kv_pull_latency_s": (0.5, 0.1)}),
    ("time_scale", {"time_scale": -1}),
])
def test_sim_config_rejects_bad_values(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as info:
        SimConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_sim_request_rejects_bad_lengths() -> None:
    with pytest.raises(ConfigError) as info:
        SimRequest("x", max_tokens=0)
    assert info.value.field == "max_tokens"
