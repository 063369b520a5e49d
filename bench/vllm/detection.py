"""Phase 4: drain detection lag.

Finished requests hold their KV (the ``HoldingConnector``); a fresh
:class:`~quiesce.lifecycle.Lifecycle` with a prefill-role probe starts a drain; after a
random delay the release file is created at ``t0``. The lag is the ``drained``
transition's instant minus ``t0`` (:class:`Drain`), with the board (change notification)
or with utility calls (polled with the drain's backoff).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

from bench.vllm.engine import generate, hold, release, settle
from quiesce import AdmissionGate, InMemoryDiscovery, Role, StageOutcome, Verdict
from quiesce.adapters.vllm import VllmProbe
from quiesce.admission import Outcome
from quiesce.drain import DrainConfig
from quiesce.lifecycle import Lifecycle, State

DETECT_REQUESTS = 2
DETECT_TOKENS = 8
DETECT_DRAINS = 24
DETECT_WARMUP = 2
RELEASE_DELAY_S = (0.15, 0.30)
"""The release comes this long after the drain started (a decoder pulls at a time the
prefill worker cannot know); by then the drain's poll backoff has reached its cap."""

DEFAULT_DRAIN = DrainConfig(router_grace_s=0)


@dataclasses.dataclass(frozen=True)
class Drain:
    lag_s: float
    """The lifecycle's ``drained`` instant (``Status.since``, monotonic) minus ``t0``."""
    observed_lag_s: float
    """When a caller awaiting ``run.wait()`` resumed, minus ``t0``."""
    probe_reads: int
    held_before: int


async def _detect_once(llm: Any, release_dir: Path, board: bool,
                       rng: random.Random, index: int) -> Drain:
    probe = VllmProbe(llm, Role.PREFILL, board=board)
    await settle(probe, release_dir)
    hold(release_dir)
    gate = AdmissionGate()
    # wall_clock=time.monotonic: Status.since is the monotonic instant of the transition.
    lifecycle = Lifecycle(gate=gate, probe=probe, discovery=InMemoryDiscovery(f"p-{index}"),
                          config=DEFAULT_DRAIN, wall_clock=time.monotonic)
    await lifecycle.start()

    async def serve() -> int:
        with gate.admit() as admission:
            produced = await generate(llm, DETECT_TOKENS)
            admission.finish(Outcome.COMPLETED)
            return produced

    produced = await asyncio.gather(*(serve() for _ in range(DETECT_REQUESTS)))
    if produced != [DETECT_TOKENS] * DETECT_REQUESTS:
        raise RuntimeError(f"detection requests produced {produced}")
    before = await probe.pending_work()
    if before.verdict is not Verdict.BUSY or before.kv_sends_held != DETECT_REQUESTS:
        raise RuntimeError(f"the finished requests' KV is not held: {before.summary()}")
    reads = 0

    def count(_: Any) -> None:
        nonlocal reads
        reads += 1

    lifecycle.add_listener(count)
    run = await lifecycle.drain()
    await asyncio.sleep(rng.uniform(*RELEASE_DELAY_S))
    if lifecycle.state is not State.DRAINING:
        raise RuntimeError(f"drained before the KV was released: {lifecycle.status()}")
    t0 = time.monotonic()
    release(release_dir)
    report = await run.wait(30)
    observed = time.monotonic()
    status = lifecycle.status()
    if report is None or not report.drained or status.state is not State.DRAINED:
        raise RuntimeError(f"drain {index} did not end drained: {lifecycle.last_error}")
    if any(s.outcome not in (StageOutcome.COMPLETED, StageOutcome.SKIPPED)
           for s in report.stages):
        raise RuntimeError(f"drain {index} had a failed stage: {report.to_dict()}")
    await lifecycle.stop()
    return Drain(status.since - t0, observed - t0, reads, before.kv_sends_held or 0)


async def detect(llm: Any, release_dir: Path, board: bool, seed: int) -> list[Drain]:
    rng = random.Random(seed)
    drains = [await _detect_once(llm, release_dir, board, rng, i)
              for i in range(DETECT_WARMUP + DETECT_DRAINS)]
    release(release_dir)
    return drains[DETECT_WARMUP:]
