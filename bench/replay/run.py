"""One replay: a trace driven by aiperf through the router while workers are scaled down.

:func:`replay` runs one policy end to end:

1. writes the two-phase mooncake trace (:func:`bench.replay.trace.write_trace`);
2. starts the cluster (:class:`bench.replay.cluster.Cluster`: etcd, ``workers``
   reference workers under the policy, the router);
3. starts aiperf against the router (its own process tree) and waits for the router's
   first request: the trace's time zero, give or take aiperf's first dispatch;
4. at each planned moment of the load, scales one worker down (the victim: the first
   serving worker by name, or the one with the lowest drain cost) with the planned
   delivery, each as its own task, and waits until every victim's process is gone;
5. waits for aiperf to finish, then stops the remaining workers;
6. judges every request from aiperf's raw export by reading its stream to the end
   (:func:`bench.replay.judge.read_outcomes`), and keeps aiperf's own count beside it.

Failure behaviour: a worker, the router or aiperf that cannot start raises (the run is
void, never counted as a pass), and so does a scale-down that finds no worker to remove;
aiperf is killed on the way out. A run in which not every planned request was sent and
judged once says so (``complete`` False).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.replay import aiperf
from bench.replay.cluster import DELIVERIES, Cluster, ScaleDown
from bench.replay.judge import read_outcomes, summarize
from bench.replay.trace import LogNormalLengths, Phase, write_trace

log = logging.getLogger("bench.replay")

MODEL = "quiesce"
"""The served model name of the simulated workers (what aiperf sends)."""
LOAD_START_TIMEOUT_S = 300.0
"""How long aiperf may take to send its first request (it synthesizes the dataset and
starts its services first: 10-30 s here)."""


OUTPUT_LENGTHS = LogNormalLengths(median=50, sigma=0.8, minimum=4, maximum=300)
"""The default trace's output lengths. At :data:`DECODE_STEP_S` a token a median stream
runs 5 s and the tail 30 s, as a reasoning model's answers do at ~100 tokens/s, with ten
times fewer tokens (so that this 2-core machine carries every token through the router
and aiperf without running out of CPU): about half the streams outlive a fixed 5 s grace,
as in the field report."""
DECODE_STEP_S = 0.1


def _default_trace_options() -> dict[str, Any]:
    return {"output_lengths": OUTPUT_LENGTHS}


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """What one replay does. ``scale_downs``: (seconds into the load, delivery)."""

    phases: tuple[Phase, ...] = (Phase(8.0, 90.0), Phase(0.2, 30.0))
    workers: int = 4
    scale_downs: tuple[tuple[float, str], ...] = ((25.0, "kubelet"), (55.0, "group"))
    decode_step_s: float = DECODE_STEP_S
    seed: int = 1
    trace_options: dict[str, Any] = dataclasses.field(default_factory=_default_trace_options)
    """Passed to :func:`bench.replay.trace.write_trace` (output lengths and the like)."""

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("phases: at least one")
        if len(self.scale_downs) >= self.workers:
            raise ValueError(f"scale_downs: {len(self.scale_downs)} would leave no worker "
                             f"of {self.workers}")
        load_s = sum(phase.duration_s for phase in self.phases)
        for at, delivery in self.scale_downs:
            if delivery not in DELIVERIES:
                raise ValueError(f"scale_downs: unknown delivery {delivery!r}; one of "
                                 f"{DELIVERIES}")
            if not 0 <= at < load_s:
                raise ValueError(f"scale_downs: {at} s is outside the load (0..{load_s} s)")

    @property
    def load_s(self) -> float:
        return sum(phase.duration_s for phase in self.phases)


@dataclasses.dataclass
class PolicyRun:
    """What one replay found."""

    policy: str
    victim_by_cost: bool
    planned: int
    """Requests in the trace."""
    sent: int
    """Requests in aiperf's raw export, each judged."""
    complete: bool
    """Every planned request was sent and judged once, and aiperf neither timed out nor
    cancelled the run (its failed-request threshold cancels it): else the run is void."""
    failed: int
    failures: dict[str, int]
    aiperf_rc: int | None
    aiperf_own: dict[str, Any]
    scale_downs: list[ScaleDown]
    end: list[ScaleDown]
    router: dict[str, object]
    wall_s: float

    def to_dict(self) -> dict[str, object]:
        return {"policy": self.policy, "victim_by_cost": self.victim_by_cost,
                "planned": self.planned, "sent": self.sent, "complete": self.complete,
                "failed": self.failed, "failures": self.failures,
                "aiperf_rc": self.aiperf_rc, "aiperf_own_count": self.aiperf_own,
                "scale_downs": [record.to_dict() for record in self.scale_downs],
                "end": [record.to_dict() for record in self.end],
                "router": self.router, "wall_s": round(self.wall_s, 1)}


async def _scale_downs(cluster: Cluster, config: ReplayConfig, by_cost: bool,
                       load_began: float) -> list[ScaleDown]:
    """Each planned scale-down at its moment, as its own task: an autoscaler does not wait
    for one pod to be gone before it deletes the next."""
    async def one(at: float, delivery: str) -> ScaleDown:
        await asyncio.sleep(max(0.0, load_began + at - time.monotonic()))
        victim, costs = await cluster.choose_victim(by_cost)
        began = time.monotonic() - load_began
        log.info("replay: %.1f s into the load, scaling down %s (%s)", began, victim,
                 delivery)
        return await cluster.scale_down(victim, delivery, began, costs)

    return list(await asyncio.gather(*(one(at, delivery)
                                       for at, delivery in config.scale_downs)))


async def replay(policy: str, config: ReplayConfig, workdir: Path, *,
                 victim_by_cost: bool = False,
                 failed_request_threshold: float | None = None) -> PolicyRun:
    """Run the replay once under ``policy`` (see :data:`bench.replay.cluster.POLICIES`);
    aiperf's artifacts go to ``workdir``."""
    started = time.monotonic()
    # SIGTERM (e.g. a CI timeout) cancels the replay, so that every process it started is
    # stopped on the way out instead of outliving it.
    loop, this = asyncio.get_running_loop(), asyncio.current_task()
    assert this is not None
    terminated: list[bool] = []

    def cancel_once() -> None:  # a second SIGTERM must not interrupt the cleanup
        if not terminated:
            terminated.append(True)
            this.cancel()

    loop.add_signal_handler(signal.SIGTERM, cancel_once)
    try:
        return await _replay(policy, config, workdir, victim_by_cost=victim_by_cost,
                             failed_request_threshold=failed_request_threshold,
                             started=started)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def _replay(policy: str, config: ReplayConfig, workdir: Path, *, victim_by_cost: bool,
                  failed_request_threshold: float | None, started: float) -> PolicyRun:
    trace = workdir / "trace.jsonl"
    planned = len(write_trace(trace, config.phases, seed=config.seed,
                              **config.trace_options))
    with Cluster(policy, config.workers, config.decode_step_s) as cluster:
        async with cluster.routed() as router:
            load = asyncio.create_task(aiperf.run_aiperf(
                router.url, MODEL, trace, workdir / "aiperf",
                failed_request_threshold=failed_request_threshold,
                timeout_s=LOAD_START_TIMEOUT_S + config.load_s * 3 + 120))
            try:
                await router.until(lambda stats: stats["first_request_at"] is not None,
                                   "aiperf's first request", LOAD_START_TIMEOUT_S,
                                   done=load.done)
                scale_downs = await _scale_downs(cluster, config, victim_by_cost,
                                                 time.monotonic())
                run = await load
            except BaseException as exc:
                if load.done() and not load.cancelled() and load.exception() is not None:
                    raise RuntimeError(f"aiperf failed: {load.exception()!r}") from exc
                raise
            finally:
                if not load.done():
                    load.cancel()  # kills aiperf's process group
                    with contextlib.suppress(asyncio.CancelledError):
                        await load
            end = await cluster.stop_all()
            stats = await router.stats()
    outcomes = read_outcomes(run.raw_export)
    summary = summarize(outcomes)
    own = _aiperf_own(run)
    ids = [outcome.request_id for outcome in outcomes]
    complete = (summary["sent"] == planned and len(set(ids)) == len(ids)
                and not run.timed_out and own.get("was_cancelled") is False)
    return PolicyRun(policy=policy, victim_by_cost=victim_by_cost, planned=planned,
                     sent=summary["sent"], complete=complete,
                     failed=summary["failed"], failures=summary["failures"],
                     aiperf_rc=run.returncode, aiperf_own=own,
                     scale_downs=scale_downs, end=end, router=stats,
                     wall_s=time.monotonic() - started)


def _aiperf_own(run: aiperf.AiperfRun) -> dict[str, Any]:
    """aiperf's own counts, or why there are none."""
    try:
        return dataclasses.asdict(aiperf.read_aiperf_summary(run.artifact_dir))
    except (OSError, ValueError) as exc:
        return {"unreadable": repr(exc)}


def unregister_to_router_ms(runs: Sequence[PolicyRun]) -> tuple[list[float], int]:
    """Every scale-down's unregister → router time over ``runs``, and how many scale-downs
    have none (the drain's start or the router's removal was not seen)."""
    values = [record.unregister_to_router_ms for run in runs for record in run.scale_downs]
    return [v for v in values if v is not None], sum(v is None for v in values)
