"""Phase 3: what a probe poller costs the engine's throughput.

The same ``STREAMS``-stream load runs in rounds without and with a task reading the
default probe every 10 ms, in ABBA order after a warm-up round (:func:`throughput`).
Each :class:`Round` keeps its tokens per second, EngineCore's and the frontend's step
intervals, the poller's reads and the CPU share other processes used meanwhile.
:func:`compare` sets the two conditions against each other (ratio of medians with a 90%
bootstrap interval, paired and step-time ratios); :func:`rounds_table` lists the rounds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
from collections.abc import Sequence
from typing import Any

from bench.stats import median, percentile
from bench.vllm.engine import STREAMS, Load, cpu_sample, other_load
from quiesce.adapters.vllm import VllmProbe

THROUGHPUT_TOKENS = 128
THROUGHPUT_ROUNDS = 10
"""Rounds per condition (without / with the probe poller), in ABBA order."""
POLL_INTERVAL_S = 0.010
UNPINNED_ROUNDS = 6
"""Rounds per condition with vLLM's default worker binding (a second engine)."""
QUIET_OTHER_LOAD = 0.05
"""A throughput round counts as quiet if other processes used under 5% of the CPUs."""


@dataclasses.dataclass
class Round:
    polled: bool
    tokens_per_s: float
    engine_steps: list[float]
    frontend_steps: list[float]
    poll_reads: list[float]
    other_load: float

    @property
    def step_s(self) -> float:
        return median(self.engine_steps)


async def _poll(probe: VllmProbe, stop: asyncio.Event, into: list[float]) -> None:
    """Read the probe on a fixed 10 ms grid (a late read starts the next one at once)."""
    next_at = time.monotonic()
    while not stop.is_set():
        begin = time.perf_counter()
        await probe.pending_work()
        into.append(time.perf_counter() - begin)
        next_at = max(next_at + POLL_INTERVAL_S, time.monotonic())
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def _one_round(llm: Any, probe: VllmProbe, polled: bool) -> Round:
    """One round of the load; with ``polled`` a task reads ``probe`` every 10 ms, without
    it the probe's board is closed first, so that EngineCore counts nothing for it."""
    if polled:
        await probe.pending_work()  # subscribe before the round: once per engine in service
    else:
        probe.close()
    load = Load(llm, STREAMS, THROUGHPUT_TOKENS)
    reads: list[float] = []
    stop = asyncio.Event()
    before = cpu_sample()
    poller = asyncio.create_task(_poll(probe, stop, reads)) if polled else None
    tokens_per_s = await load.run()
    after = cpu_sample()
    stop.set()
    if poller is not None:
        await poller
    engine, frontend = load.trace.step_intervals()
    return Round(polled, tokens_per_s, engine, frontend, reads, other_load(before, after))


async def throughput(llm: Any, probe: VllmProbe, rounds: int) -> list[Round]:
    await _one_round(llm, probe, polled=False)  # warm-up
    order = "ABBA" * (rounds // 2)
    return [await _one_round(llm, probe, polled=condition == "B") for condition in order]


# -- comparing the rounds ---------------------------------------------------------------------

BOOTSTRAP_RESAMPLES = 2000


def _ratio_ci90(plain: Sequence[float], polled: Sequence[float]) -> tuple[float, float]:
    """A 90% bootstrap interval of median(polled) / median(plain) (conditions resampled
    independently, with replacement; fixed seed)."""
    rng = random.Random(5)
    ratios = [median(rng.choices(polled, k=len(polled)))
              / median(rng.choices(plain, k=len(plain))) for _ in range(BOOTSTRAP_RESAMPLES)]
    return round(percentile(ratios, 5), 4), round(percentile(ratios, 95), 4)


def compare(rounds: Sequence[Round]) -> dict[str, float]:
    """Without / with the poller: tokens/s and step ratios, and the two step medians."""
    plain = [r for r in rounds if not r.polled]
    polled = [r for r in rounds if r.polled]
    low, high = _ratio_ci90([r.tokens_per_s for r in plain], [r.tokens_per_s for r in polled])
    step = median([s for r in plain for s in r.engine_steps])
    polled_step = median([s for r in polled for s in r.engine_steps])
    # each "with" round against its neighbouring "without" rounds in the ABBA order
    paired = [b.tokens_per_s / a.tokens_per_s for a, b in itertools.pairwise(rounds)
              if not a.polled and b.polled]
    paired += [b.tokens_per_s / a.tokens_per_s for b, a in itertools.pairwise(rounds)
               if b.polled and not a.polled]
    return {
        "ratio": round(median([r.tokens_per_s for r in polled])
                       / median([r.tokens_per_s for r in plain]), 4),
        "paired": round(median(paired), 4),
        "ci90_low": low,
        "ci90_high": high,
        "from_step": round(step / polled_step, 4),
        "step_ms": round(step * 1e3, 4),
        "polled_step_ms": round(polled_step * 1e3, 4),
        "tokens_per_s": round(median([r.tokens_per_s for r in plain]), 1),
        "spread": round((percentile([r.tokens_per_s for r in plain], 75)
                         - percentile([r.tokens_per_s for r in plain], 25))
                        / median([r.tokens_per_s for r in plain]), 4),
        "polled_tokens_per_s": round(median([r.tokens_per_s for r in polled]), 1),
    }


def rounds_table(rounds: Sequence[Round]) -> list[dict[str, object]]:
    return [{"probe_10ms": r.polled, "tokens_per_s": round(r.tokens_per_s, 1),
             "engine_step_ms": round(r.step_s * 1e3, 3), "poll_reads": len(r.poll_reads),
             "other_load": round(r.other_load, 3)} for r in rounds]
