"""The drain ETA (:mod:`quiesce.eta`): its rules, how it joins, where it shows."""

from __future__ import annotations

import math

import pytest

from quiesce import PendingWork, Role, Verdict
from quiesce.adapters.sim import RequestAborted, SimConfig, SimEngine, SimProbe, SimRequest
from quiesce.errors import ConfigError
from quiesce.eta import DrainEta
from quiesce.ops.status_format import format_status, progress_line


def work(eta: DrainEta | None, running: int = 1, source: str = "test") -> PendingWork:
    return PendingWork(Role.AGGREGATED, source, waiting=0, running=running, kv_sends_held=0,
                       kv_recvs_awaited=0, eta=eta)


@pytest.mark.parametrize("expected,upper,reason", [
    (-1.0, 2.0, None), (math.nan, 2.0, None), (1.0, math.inf, None), (3.0, 2.0, None),
    (None, 2.0, None), (1.0, None, None), (True, 2.0, None)])
def test_bad_estimates_are_refused(expected: float | None, upper: float | None,
                                   reason: str | None) -> None:
    with pytest.raises(ConfigError):
        DrainEta(expected, upper, "test", reason)


def test_combine_takes_the_slowest_part_and_keeps_why_one_is_unknown() -> None:
    fast, slow = DrainEta(1.0, 2.0, "a"), DrainEta(3.0, 4.0, "b")
    assert DrainEta.combine([fast, None, slow]) == DrainEta(3.0, 4.0, "a+b")
    assert DrainEta.combine([None, None]) is None
    assert DrainEta.combine([fast]) is fast
    unbounded = DrainEta(0.5, None, "c", "KV held for a reader without a lease")
    joined = DrainEta.combine([slow, unbounded])
    assert joined == DrainEta(3.0, None, "b+c", "KV held for a reader without a lease")
    unknown = DrainEta.combine([slow, DrainEta.unknown("d", "no step time yet")])
    assert unknown is not None and unknown.expected_s is None
    assert unknown.summary() == "unknown: no step time yet"


def test_the_eta_never_changes_the_verdict_or_the_work() -> None:
    idle = work(DrainEta(30.0, 60.0, "test"), running=0)
    assert idle.verdict is Verdict.QUIESCENT
    busy = work(None)
    assert busy.same_work(work(DrainEta(5.0, 6.0, "test")))  # it moves every step
    merged = PendingWork.merge(Role.AGGREGATED, [work(DrainEta(1.0, 2.0, "a"), source="x"),
                                                 work(DrainEta(4.0, 5.0, "b"), source="y")])
    assert merged.eta == DrainEta(4.0, 5.0, "a+b")
    assert merged.to_dict()["eta"] == {"expected_s": 4.0, "upper_s": 5.0, "basis": "a+b",
                                       "reason": None}


async def test_the_simulator_estimates_its_own_drain() -> None:
    engine = SimEngine(SimConfig(decode_step_s=0.01, kv_pull_latency_s=(0.1, 0.3)))
    probe = SimProbe(engine)
    await engine.start()
    try:
        idle = (await probe.pending_work()).eta
        assert idle is not None and idle.expected_s == 0.0
        stream = engine.generate(SimRequest("r1", max_tokens=50, remote_decode=True))
        await anext(stream)
        eta = (await probe.pending_work()).eta
        assert eta is not None and eta.expected_s is not None and eta.upper_s is not None
        # 49 or 50 steps of 10 ms left, plus the KV pull: 0.2 s mean, 0.3 s at most,
        # the bound with its margin for the event loop (a quarter and two steps)
        assert 0.68 <= eta.expected_s <= 0.7 < eta.upper_s <= (0.5 + 0.3) * 1.25 + 0.02
        engine.abort("r1")
        with pytest.raises(RequestAborted):
            async for _ in stream:
                pass
    finally:
        await engine.shutdown()


def test_status_and_progress_show_the_eta() -> None:
    pending = work(DrainEta(3.0, 5.0, "remaining tokens x step time")).to_dict()
    status = {"state": "draining", "pending_work": pending, "inflight_requests": 1,
              "drain": {"stage": "quiescent", "elapsed_s": 1.0, "budget_s": 30.0}}
    assert "drain ETA:    ~3.0s (at most 5.0s) from remaining tokens x step time" \
        in format_status(status)
    line = progress_line(status)
    assert "[#####---------------]  25% ETA ~3.0s (at most 5.0s)" in line
    pending["eta"] = DrainEta(3.0, None, "x", "a reader without a lease").to_dict()
    assert "no bound: a reader without a lease" in progress_line(status)
    pending["eta"] = None
    assert "ETA" not in progress_line(status) and "drain ETA" not in format_status(status)


def brute_force_drain_s(config: SimConfig, running: list[int],
                        waiting: list[tuple[int, int]]) -> float:
    """The step loop, one step at a time: ``running`` holds steps left, ``waiting``
    (prompt tokens, max tokens); no KV pulls."""
    left = list(running)
    queue = list(waiting)
    elapsed = 0.0
    while left or queue:
        prefill = 0
        while queue and len(left) < config.max_running:
            prompt, tokens = queue.pop(0)
            left.append(tokens)
            prefill += prompt
        elapsed += config.decode_step_s + prefill * config.prefill_s_per_token
        left = [n - 1 for n in left if n > 1]
    return elapsed


async def test_the_simulators_estimate_follows_its_step_loop_schedule() -> None:
    """Arithmetic, no clock: the estimate equals the step loop run step by step, with a
    batch over ``max_running`` (later requests wait for a slot) and prefill time."""
    config = SimConfig(max_running=3, decode_step_s=0.01, prefill_s_per_token=0.001)
    engine = SimEngine(config)  # never started: requests stay where they are put
    lengths = [(50, 7), (10, 3), (200, 12), (30, 5), (40, 9), (5, 1)]
    for i, (prompt, tokens) in enumerate(lengths):
        engine._add(SimRequest(f"r{i}", prompt_tokens=prompt, max_tokens=tokens))
    assert engine.estimated_drain_s() == pytest.approx(
        brute_force_drain_s(config, [], lengths))
    eta = engine.drain_eta()
    assert eta.upper_s is not None and eta.expected_s is not None
    assert eta.upper_s >= eta.expected_s == pytest.approx(engine.estimated_drain_s())


async def test_kv_a_decoder_never_pulls_has_no_bound() -> None:
    engine = SimEngine(SimConfig())
    engine._add(SimRequest("r1", max_tokens=2, remote_decode=True, never_pulled=True))
    eta = engine.drain_eta()
    assert eta.expected_s is not None and eta.expected_s > 0
    assert eta.upper_s is None and eta.reason == "KV held for a decoder that never pulls it"
