"""Phase 2: the probe's latency while ``STREAMS`` streams decode.

Waves of :class:`~bench.vllm.engine.Load` run until every variant has ``BUSY_READS``
reads, each started at a random phase of the engine step and kept only if all streams
were decoding throughout. For the utility snapshot it also measures how long after the
step in progress a read ended (:func:`_after_step`), from EngineCore's own timestamps.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
import random
import time
from collections.abc import Sequence
from typing import Any

from bench.vllm.engine import STREAMS, Load, Trace, per_variant
from quiesce import Verdict
from quiesce.adapters.vllm import VllmProbe

BUSY_READS = 320
"""Minimum reads per busy variant, each taken while all ``STREAMS`` streams decode."""
BUSY_TOKENS = 448
BUSY_PAUSE_S = (0.0, 0.010)
"""Random pause before each busy read, so that reads start at random phases of a step."""


@dataclasses.dataclass
class BusySamples:
    reads: dict[str, list[float]] = dataclasses.field(default_factory=per_variant)
    engine_steps: list[float] = dataclasses.field(default_factory=list)
    after_step: list[float] = dataclasses.field(default_factory=list)
    """Per utility snapshot read: its end minus the end of the engine step in progress
    when it started."""
    unmatched: int = 0
    not_busy: int = 0
    waves: int = 0


def _after_step(trace: Trace, reads: Sequence[tuple[float, float]],
                into: list[float]) -> int:
    """For each read, its end minus the end of the step in progress when it began.

    Steps end at EngineCore's output timestamps (``time.monotonic`` in another process:
    CLOCK_MONOTONIC, one clock for the machine). Only the timestamps the frontend saw for
    stream 0 are known; a read whose first step end after its start is not known to be
    the very next step (a token count jump: outputs were coalesced) is left out.
    Returns how many reads were left out.
    """
    points = [(n, e) for n, e, _ in trace.points if e > 0]
    ends = [e for _, e in points]
    unmatched = 0
    for begin, end in reads:
        i = bisect.bisect_right(ends, begin)
        if 0 < i < len(ends) and ends[i] <= end and points[i][0] - points[i - 1][0] == 1:
            into.append(end - ends[i])
        else:
            unmatched += 1
    return unmatched


async def busy(llm: Any, probes: dict[str, VllmProbe]) -> BusySamples:
    samples = BusySamples()
    rng = random.Random(2)
    turn = itertools.cycle(probes.items())
    while min(len(r) for r in samples.reads.values()) < BUSY_READS:
        load = Load(llm, STREAMS, BUSY_TOKENS)
        task = asyncio.create_task(load.run())
        samples.waves += 1
        snapshot_reads: list[tuple[float, float]] = []
        name, probe = next(turn)
        while not task.done():
            await asyncio.sleep(rng.uniform(*BUSY_PAUSE_S))
            if not load.decoding():
                continue
            begin = time.monotonic()
            work = await probe.pending_work()
            end = time.monotonic()
            if not load.decoding():  # a stream ended during the read: not the 16-stream load
                continue
            if work.verdict is not Verdict.BUSY:
                samples.not_busy += 1
            samples.reads[name].append(end - begin)
            if name == "snapshot":
                snapshot_reads.append((begin, end))
            name, probe = next(turn)
        await task
        samples.engine_steps += load.trace.step_intervals()[0]
        samples.unmatched += _after_step(load.trace, snapshot_reads, samples.after_step)
    return samples
