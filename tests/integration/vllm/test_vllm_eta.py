"""The vLLM drain ETA against a real vLLM engine on the CPU (tiny random-weight Llama).

One AsyncLLM per module, with the test connector that holds every finished request's KV
blocks until the test releases them. What is asserted is the ETA's contract, not its
speed: idle is zero; with streams of known ``max_tokens`` running, the expected value is
positive and the upper bound is at least the time the drain then really takes (a
property that fails if the bound is wrong); held KV without a known lease is unbounded,
with the reason. How close the estimate is: ``bench/eta.py``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from quiesce import Role, StageOutcome, Verdict
from quiesce.budget import Deadline
from quiesce.drain import DrainConfig, wait_quiescent
from tests.integration.vllm.conftest import SKIP_REASON, hold, release

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)

from quiesce.adapters.vllm import VllmProbe  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

FAST = DrainConfig(router_grace_s=0, poll_base_s=0.001, poll_cap_s=0.01, probe_timeout_s=5)
LENGTHS = (24, 48, 96, 64)
"""max_tokens of the streams a drain waits for (known to the engine, as in production)."""


class Decoding:
    """Set once ``streams`` streams have each produced ``tokens`` tokens."""

    def __init__(self, streams: int, tokens: int = 4) -> None:
        self.left = streams
        self.tokens = tokens
        self.event = asyncio.Event()

    def passed(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.event.set()


async def generate(llm: Any, max_tokens: int, decoding: Decoding | None = None) -> int:
    """Run one request to its ``max_tokens`` (``ignore_eos``); returns the tokens produced."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    produced = 0
    async for output in llm.generate("hello world", params, request_id=uuid.uuid4().hex):
        before, produced = produced, len(output.outputs[0].token_ids)
        if decoding is not None and before < decoding.tokens <= produced:
            decoding.passed()
    return produced


async def settle(probe: VllmProbe, release_dir: Path) -> None:
    release(release_dir)
    report, last = await wait_quiescent(probe, Deadline.after(60), FAST)
    assert report.outcome is StageOutcome.COMPLETED, last.summary()


async def test_an_idle_engine_has_nothing_left_to_drain(engine: Any, release_dir: Path) -> None:
    probe = VllmProbe(engine, Role.AGGREGATED)
    await settle(probe, release_dir)
    work = await probe.pending_work()
    assert work.is_quiescent, work.summary()
    assert work.eta is not None, "the plugin's board carries no ETA"
    assert (work.eta.expected_s, work.eta.upper_s) == (0.0, 0.0)


async def test_the_bound_covers_the_drain_of_running_streams(engine: Any,
                                                            release_dir: Path) -> None:
    release(release_dir)  # finished requests free their KV at once: only compute remains
    probe = VllmProbe(engine, Role.AGGREGATED)
    await probe.pending_work()  # subscribed: EngineCore times its steps from here
    decoding = Decoding(len(LENGTHS))
    streams = [asyncio.create_task(generate(engine, n, decoding)) for n in LENGTHS]
    await asyncio.wait_for(decoding.event.wait(), 60)  # every stream is decoding
    begin = time.monotonic()
    work = await probe.pending_work()  # the drain starts: nothing new is sent
    assert work.verdict is Verdict.BUSY, work.summary()
    eta = work.eta
    assert eta is not None and eta.expected_s is not None, eta
    assert eta.upper_s is not None, eta.reason
    report, last = await wait_quiescent(probe, Deadline.after(120), FAST)
    drained_s = time.monotonic() - begin
    assert report.outcome is StageOutcome.COMPLETED, last.summary()
    assert await asyncio.gather(*streams) == list(LENGTHS)
    assert eta.expected_s > 0
    assert drained_s <= eta.upper_s, (
        f"the drain took {drained_s:.3f} s, beyond the stated bound {eta.upper_s:.3f} s "
        f"(expected {eta.expected_s:.3f} s)")
    assert last.eta is not None and last.eta.expected_s == 0.0


async def test_the_snapshot_utility_gives_the_same_kind_of_eta(engine: Any,
                                                              release_dir: Path) -> None:
    release(release_dir)
    by_call = VllmProbe(engine, Role.AGGREGATED, board=False)
    decoding = Decoding(1)
    stream = asyncio.create_task(generate(engine, 200, decoding))
    await asyncio.wait_for(decoding.event.wait(), 60)
    work = await by_call.pending_work()
    assert work.verdict is Verdict.BUSY, work.summary()
    assert work.eta is not None and work.eta.expected_s is not None, work.eta
    assert work.eta.expected_s > 0 and work.eta.upper_s is not None
    assert await stream == 200
    await settle(by_call, release_dir)


async def test_held_kv_without_a_known_lease_is_unbounded_with_the_reason(
        engine: Any, release_dir: Path) -> None:
    probe = VllmProbe(engine, Role.PREFILL)
    await settle(probe, release_dir)
    hold(release_dir)
    assert await asyncio.gather(generate(engine, 8), generate(engine, 8)) == [8, 8]
    work = await probe.pending_work()
    assert work.verdict is Verdict.BUSY and work.kv_sends_held == 2, work.summary()
    assert work.eta is not None
    assert work.eta.upper_s is None
    assert "no known lease" in (work.eta.reason or ""), work.eta
    assert work.eta.expected_s == 0.0  # no compute left; the reader's pace is not known
    await settle(probe, release_dir)
    hold(release_dir)
