"""Admission overhead: the cost of one admit + release pair on an :class:`AdmissionGate`.

Each figure is the median, over ``REPEATS`` batches, of a batch's mean cost per pair
(``time.perf_counter_ns`` around ``BATCH`` iterations). The variants are interleaved
in every repeat so that drift of the machine hits them alike. The bare loop is
measured the same way and reported as its own metric, never subtracted.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable

from bench.results_format import Result
from bench.stats import median
from quiesce.admission import Admission, AdmissionGate, Outcome

NAME = "admission"

REPEATS = 31
BATCH = 100_000
HELD = 10_000
TARGET_NS = 1000.0
REQUEST_ID = "req-0"


def _admit_release(gate: AdmissionGate, n: int) -> int:
    rid = REQUEST_ID
    start = time.perf_counter_ns()
    for _ in range(n):
        with gate.admit(rid):
            pass
    return time.perf_counter_ns() - start


def _bare_loop(gate: AdmissionGate, n: int) -> int:
    start = time.perf_counter_ns()
    for _ in range(n):
        pass
    return time.perf_counter_ns() - start


async def _admit_release_async(gate: AdmissionGate, n: int) -> int:
    rid = REQUEST_ID
    start = time.perf_counter_ns()
    for _ in range(n):
        async with gate.admit(rid):
            pass
    return time.perf_counter_ns() - start


async def _bare_loop_async(gate: AdmissionGate, n: int) -> int:
    start = time.perf_counter_ns()
    for _ in range(n):
        pass
    return time.perf_counter_ns() - start


SyncCase = Callable[[AdmissionGate, int], int]
AsyncCase = Callable[[AdmissionGate, int], Awaitable[int]]


def _hold(gate: AdmissionGate, count: int) -> list[Admission]:
    return [gate.admit(f"held-{i}") for i in range(count)]


def _timed(case: SyncCase, gate: AdmissionGate, gc_enabled: bool) -> float:
    """One batch: the mean ns per iteration, with the GC on (as in a server) unless told."""
    gc.collect()
    if not gc_enabled:
        gc.disable()
    try:
        return case(gate, BATCH) / BATCH
    finally:
        gc.enable()


async def _measure_all() -> dict[str, list[float]]:
    """Every variant, interleaved, all from inside a running event loop.

    The synchronous variants run inside the loop too (as they do in a worker); the
    loop is otherwise idle, so nothing else is scheduled between the clock reads.
    """
    free = AdmissionGate()
    busy = AdmissionGate()
    held = _hold(busy, HELD)
    sync_cases: dict[str, tuple[SyncCase, AdmissionGate, bool]] = {
        "admit_release": (_admit_release, free, True),
        "admit_release_10k_inflight": (_admit_release, busy, True),
        "admit_release_gc_disabled": (_admit_release, free, False),
        "loop": (_bare_loop, free, True),
    }
    async_cases: dict[str, tuple[AsyncCase, AdmissionGate]] = {
        "admit_release_async": (_admit_release_async, free),
        "admit_release_async_10k_inflight": (_admit_release_async, busy),
        "loop_async": (_bare_loop_async, free),
    }
    samples: dict[str, list[float]] = {name: [] for name in (*sync_cases, *async_cases)}
    for repeat in range(REPEATS + 1):  # repeat 0 warms up and is dropped
        for name, (sync_case, gate, gc_enabled) in sync_cases.items():
            value = _timed(sync_case, gate, gc_enabled)
            if repeat:
                samples[name].append(value)
        for name, (async_case, gate) in async_cases.items():
            gc.collect()
            value = await async_case(gate, BATCH) / BATCH
            if repeat:
                samples[name].append(value)
    if free.inflight != 0 or busy.inflight != HELD:
        raise RuntimeError(f"gate counts drifted: {free.inflight}, {busy.inflight}")
    for admission in held:
        admission.finish(Outcome.COMPLETED)
    if busy.inflight != 0:
        raise RuntimeError("held admissions did not release")
    return samples


def run() -> Result:
    samples = asyncio.run(_measure_all())
    med = {name: round(median(values), 1) for name, values in samples.items()}
    metrics = {
        "admit_release_median_ns": med["admit_release"],
        "admit_release_median_ns_10k_inflight": med["admit_release_10k_inflight"],
        "admit_release_async_median_ns": med["admit_release_async"],
        "admit_release_async_median_ns_10k_inflight": med["admit_release_async_10k_inflight"],
        "admit_release_gc_disabled_median_ns": med["admit_release_gc_disabled"],
        "loop_overhead_ns": med["loop"],
        "loop_overhead_async_ns": med["loop_async"],
        "admit_release_min_ns": round(min(samples["admit_release"]), 1),
        "admit_release_max_ns": round(max(samples["admit_release"]), 1),
    }
    headline = metrics["admit_release_median_ns"]
    verdict = "met" if headline <= TARGET_NS else "NOT met"
    return Result(
        name=NAME, metrics=metrics, units=dict.fromkeys(metrics, "ns"),
        parameters={"repeats": REPEATS, "batch": BATCH, "held_admissions": HELD,
                    "clock": "time.perf_counter_ns", "statistic": "median of batch means"},
        notes=[
            f"Target: admit+release <= {TARGET_NS:g} ns median: {verdict} "
            f"(measured {headline:g} ns per pair, loop overhead included).",
            "One pair is `with gate.admit(rid): pass` (async: `async with`), inside a "
            f"`for _ in range({BATCH})` loop timed with time.perf_counter_ns; each metric is "
            f"the median over {REPEATS} batches of the batch's mean ns per pair (one extra "
            "warm-up batch is dropped). Variants are interleaved within every repeat.",
            "loop_overhead_ns / loop_overhead_async_ns: the same loop with an empty body, "
            "measured the same way. It is included in every admit_release figure and NOT "
            "subtracted; the gate's own cost is roughly admit_release - loop_overhead.",
            f"*_10k_inflight: the same with {HELD} admissions held open on that gate.",
            "Everything runs inside a running asyncio loop (asyncio.run), the way a worker "
            "calls the gate; the GC is enabled (gc.collect() before each batch) except in "
            "admit_release_gc_disabled_median_ns. admit_release_min_ns / _max_ns: the "
            "spread of the sync batch means.",
        ],
    )


HEADLINE = ("admit_release_median_ns", "admit_release_median_ns_10k_inflight",
            "admit_release_async_median_ns", "loop_overhead_ns")
