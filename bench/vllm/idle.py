"""Phase 1: the probe's latency on an idle engine.

Each probe variant is read in turn after a short random pause (as a poller would leave),
alongside the pieces of a read: the frontend's count of unfinished requests and one bare
``quiesce_snapshot`` utility round trip. Then the board and snapshot variants are read
back to back, which also gives the CPU time a read costs (:class:`BackToBack`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
from typing import Any

from bench.vllm.engine import cpu_sample, per_variant
from quiesce import Verdict
from quiesce.adapters.vllm import VllmProbe

IDLE_WARMUP_READS = 20
IDLE_READS = 400
"""Reads per idle variant (detailed probe, has_work probe, frontend count, bare utility)."""
IDLE_PAUSE_S = (0.0, 0.002)
"""Random pause between two idle reads, as a poller would leave."""


@dataclasses.dataclass
class BackToBack:
    """Reads with no pause between them, and the CPU time they cost."""

    reads: list[float]
    cpu_per_read_s: float
    """CPU time of this process and the engine's processes per read."""
    frontend_cpu_per_read_s: float


@dataclasses.dataclass
class IdleSamples:
    reads: dict[str, list[float]] = dataclasses.field(default_factory=per_variant)
    frontend: list[float] = dataclasses.field(default_factory=list)
    utility: list[float] = dataclasses.field(default_factory=list)
    back_to_back: dict[str, BackToBack] = dataclasses.field(default_factory=dict)
    not_quiescent: int = 0


async def _back_to_back(probe: VllmProbe, samples: IdleSamples) -> BackToBack:
    for _ in range(IDLE_WARMUP_READS):
        await probe.pending_work()
    reads: list[float] = []
    cpu_before, frontend_before = cpu_sample(), time.process_time()
    for _ in range(IDLE_READS):
        begin = time.perf_counter()
        work = await probe.pending_work()
        reads.append(time.perf_counter() - begin)
        if work.verdict is not Verdict.QUIESCENT:
            samples.not_quiescent += 1
    cpu_after, frontend_after = cpu_sample(), time.process_time()
    return BackToBack(reads, (cpu_after.ours - cpu_before.ours) / os.sysconf("SC_CLK_TCK")
                      / IDLE_READS, (frontend_after - frontend_before) / IDLE_READS)


async def idle(llm: Any, probes: dict[str, VllmProbe]) -> IdleSamples:
    samples = IdleSamples()
    rng = random.Random(1)
    client = llm.engine_core
    processor = llm.output_processor
    for i in range(IDLE_WARMUP_READS + IDLE_READS):
        keep = i >= IDLE_WARMUP_READS
        for name, probe in probes.items():
            await asyncio.sleep(rng.uniform(*IDLE_PAUSE_S))
            begin = time.perf_counter()
            work = await probe.pending_work()
            took = time.perf_counter() - begin
            if work.verdict is not Verdict.QUIESCENT:
                samples.not_quiescent += 1
            elif keep:
                samples.reads[name].append(took)
        await asyncio.sleep(rng.uniform(*IDLE_PAUSE_S))
        begin = time.perf_counter()
        processor.get_num_unfinished_requests()
        took = time.perf_counter() - begin
        if keep:
            samples.frontend.append(took)
        begin = time.perf_counter()
        await client.call_utility_async("quiesce_snapshot")
        took = time.perf_counter() - begin
        if keep:
            samples.utility.append(took)
    # No pause: a utility call finds EngineCore's threads awake. Also the CPU they cost.
    for name in ("board", "snapshot"):
        samples.back_to_back[name] = await _back_to_back(probes[name], samples)
    return samples
