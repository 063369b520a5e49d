"""Scale-down by drain cost: how much sooner the cheapest worker drains than an arbitrary one.

Each sample is one scale-down in the demo's simulated cluster (:mod:`quiesce.ops.demo`:
four workers behind a lagging router, streaming requests with log-normal output
lengths, a quarter of them disaggregated), replayed twice from the same seed: once
removing an arbitrary worker (worker-0; among equally ready pods a ReplicaSet's choice
knows nothing of their work) and once removing the worker with the lowest drain cost
(:mod:`quiesce.drain_cost`: here the simulator's drain ETA; what
``--publish-deletion-cost`` makes a ReplicaSet do).
Both use quiesce's budgeted shutdown, so both lose nothing; what differs is how long
the victim takes to drain and how many requests it held.

Samples differ in their seed and in the moment of the scale-down (uniform in phase
1). Times are simulated seconds.
"""

from __future__ import annotations

import asyncio
import random

from bench.results_format import Result
from bench.stats import median, percentile
from quiesce.ops.demo import DemoConfig, PolicyResult, run_policy

NAME = "victim"
SCALE_DOWNS = 40
TIME_SCALE = 0.05
"""Simulated seconds run 20x faster than real ones; the decode step stays >= 1 ms wall."""
PHASE1_S = 20.0
SCALE_DOWN_WINDOW_S = (4.0, 14.0)
SHUTDOWN_BUDGET_S = 600.0
"""Long enough that no drain is forced: compressed 20x, a busy machine (another
process's load) stretches simulated time, and a forced drain would measure the budget."""


def _config(seed: int) -> DemoConfig:
    at = random.Random(seed).uniform(*SCALE_DOWN_WINDOW_S)
    return DemoConfig(seed=seed, time_scale=TIME_SCALE, phase1_s=PHASE1_S, phase2_s=0.0,
                      phase2_rps=0.0, scale_down_at_s=at, shutdown_budget_s=SHUTDOWN_BUDGET_S)


async def _pairs(count: int) -> list[tuple[PolicyResult, PolicyResult]]:
    out = []
    for seed in range(1, count + 1):
        config = _config(seed)
        out.append((await run_policy("quiesce", config),
                    await run_policy("quiesce-lowest-cost", config)))
    return out


def run(scale_downs: int = SCALE_DOWNS) -> Result:
    pairs = asyncio.run(_pairs(scale_downs))
    arbitrary = [a.drain_s for a, _ in pairs]
    cheapest = [c.drain_s for _, c in pairs]
    lost = sum(a.failed + c.failed for a, c in pairs)
    same_victim = sum(1 for a, c in pairs if a.victim == c.victim)
    metrics = {
        "drain_s_arbitrary": round(median(arbitrary), 3),
        "drain_s_lowest_cost": round(median(cheapest), 3),
        "drain_s_p90_arbitrary": round(percentile(arbitrary, 90), 3),
        "drain_s_p90_lowest_cost": round(percentile(cheapest, 90), 3),
        "moved_arbitrary": median([float(a.moved) for a, _ in pairs]),
        "moved_lowest_cost": median([float(c.moved) for _, c in pairs]),
        "lost_requests": float(lost),
        "same_victim_share": round(same_victim / len(pairs), 3),
    }
    units = {name: ("s" if name.startswith("drain_s") else
                    "share" if name.endswith("share") else "requests") for name in metrics}
    return Result(
        name=NAME, metrics=metrics, units=units,
        parameters={"scale_downs": scale_downs, "workers": DemoConfig().workers,
                    "phase1_rps": DemoConfig().phase1_rps, "phase1_s": PHASE1_S,
                    "scale_down_window_s": list(SCALE_DOWN_WINDOW_S),
                    "time_scale": TIME_SCALE, "statistic": "median (p50) and p90 over "
                    "scale-downs, simulated seconds"},
        notes=[
            "Each scale-down is replayed twice from the same seed: the victim is worker-0 "
            "(arbitrary) or the worker with the lowest drain cost at that moment (ties stay "
            "with worker-0): the simulator's drain ETA in ms (quiesce.drain_cost). Both "
            "drain with quiesce's budgeted shutdown.",
            "drain_s_*: from the scale-down to the victim's drain run ending (drained), in "
            "simulated seconds. moved_*: requests the victim held when the scale-down began "
            "(admitted and in flight, or KV held for a decoder).",
            "same_victim_share: how often worker-0 was already the cheapest (both runs then "
            "remove the same worker and differ only by the simulator's timing noise).",
            "The simulation runs 20x compressed on a shared event loop: asyncio timer jitter "
            "of a millisecond or two wall is 20-40 ms simulated.",
        ],
    )


HEADLINE = ("drain_s_arbitrary", "drain_s_lowest_cost", "moved_arbitrary",
            "moved_lowest_cost", "lost_requests")
