"""The replay benchmark's figures: ``bench/results/replay.json`` (``python -m bench.replay``).

Three replays of one seeded trace (8 req/s, then 0.2 req/s; :class:`ReplayConfig`), each
with ``WORKERS`` reference workers behind etcd and the router, two of them scaled down
during phase 1 (the first as the kubelet does it: preStop when the pod has one, SIGTERM to
the main process, SIGKILL at the grace period; the second with SIGTERM to the whole
process group):

- ``fixed_grace``: the field report's policy (unregister, serve 5 s more, abort the rest);
  the victim is the first serving worker by name;
- ``quiesce``: quiesce's drain, ``quiesce prestop`` as the preStop hook; same victims;
- ``quiesce_lowest_cost``: the same, but each victim is the worker with the lowest drain
  cost at that moment (what ``--publish-deletion-cost`` makes a ReplicaSet pick).

Failed requests are counted from aiperf's raw export by reading every stream to its end
(:func:`bench.replay.judge.read_outcomes`); aiperf's own error count is kept beside it.
``unregister_to_router_ms_etcd``: the slowest, over every scale-down of the replays, from
the victim entering ``draining`` (its status's ``since``; the unregister comes right
after) to the router (its own process) dropping it; ``unregister_to_router_missing``
counts scale-downs where either moment was not seen. ``unregister_to_router_ms_dynamo``:
the slowest of ``DYNAMO_SAMPLES`` unregisters of a real Dynamo endpoint to a Dynamo
client in another process (:func:`bench.discovery.dynamo_samples`; the replay itself
routes over etcd). A run that did not send and judge every planned request once is void:
the benchmark raises instead of writing figures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench import discovery
from bench.replay.run import PolicyRun, ReplayConfig, replay, unregister_to_router_ms
from bench.results_format import Result
from bench.stats import percentile

NAME = "replay"
HEADLINE = ("quiesce_sent", "quiesce_failed", "fixed_grace_sent", "fixed_grace_failed",
            "unregister_to_router_ms_etcd", "unregister_to_router_ms_dynamo")
DYNAMO_SAMPLES = 200
FAILED_REQUEST_THRESHOLD = 0.001
"""aiperf's ``--failed-request-threshold``: it exits non-zero above 0.1 % errors (of its
own count)."""
RUNS: tuple[tuple[str, str, bool], ...] = (
    ("fixed_grace", "fixed_grace", False),
    ("quiesce", "quiesce", False),
    ("quiesce_lowest_cost", "quiesce", True),
)
"""(name in the results, worker policy, victim by drain cost)."""


def _jsonable(value: object) -> object:
    """A trace option for the JSON: a dataclass (a length distribution) as its fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"kind": type(value).__name__, **dataclasses.asdict(value)}
    return value


def _metrics(runs: dict[str, PolicyRun]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for name, run in runs.items():
        metrics[f"{name}_sent"] = run.sent
        metrics[f"{name}_failed"] = run.failed
        metrics[f"{name}_aiperf_errors"] = int(run.aiperf_own.get("error_request_count") or 0)
        removals = [r.ended - r.began for r in run.scale_downs if r.ended is not None]
        if removals:
            metrics[f"{name}_victim_removal_s_mean"] = round(sum(removals) / len(removals), 3)
    etcd, missing = unregister_to_router_ms(list(runs.values()))
    metrics["unregister_to_router_missing"] = missing
    if etcd:
        metrics["unregister_to_router_ms_etcd"] = round(max(etcd), 3)
        metrics["unregister_to_router_ms_etcd_p50"] = round(percentile(etcd, 50), 3)
    return metrics


def run(config: ReplayConfig | None = None, names: Sequence[str] | None = None) -> Result:
    config = config or ReplayConfig()
    chosen = [r for r in RUNS if names is None or r[0] in names]
    runs: dict[str, PolicyRun] = {}
    with tempfile.TemporaryDirectory(prefix="quiesce-replay-") as tmp:
        for name, policy, by_cost in chosen:
            runs[name] = asyncio.run(replay(policy, config, Path(tmp) / name,
                                            victim_by_cost=by_cost,
                                            failed_request_threshold=FAILED_REQUEST_THRESHOLD))
            print(f"replay {name}: {runs[name].failed} of {runs[name].sent} failed",
                  file=sys.stderr)
            if not runs[name].complete:  # a partial run proves nothing either way
                raise RuntimeError(f"replay {name} is void: {runs[name].sent} of "
                                   f"{runs[name].planned} requests judged; "
                                   f"{runs[name].to_dict()}")
    metrics = _metrics(runs)
    notes = [
        "A request failed when its HTTP status was not 200, any SSE event carried an "
        "error, no finish_reason came, [DONE] did not come, or it got fewer tokens than "
        "its max_tokens (aiperf sends ignore_eos). aiperf_errors: aiperf's own error count "
        "(it counts a 200 stream ending in an error event as a success).",
        "Workers: quiesce serve --engine sim (simulated tokens, real HTTP, admission, "
        "drain, etcd lease); router: bench.replay.router in its own process; "
        "etcd 3.4 (Debian) on loopback; aiperf 0.13.0 in its own environment.",
    ]
    dynamo = discovery.dynamo_samples(DYNAMO_SAMPLES)
    if isinstance(dynamo, str):
        notes.append(f"unregister_to_router_ms_dynamo: not measured: {dynamo}")
    else:
        samples = dynamo["unregister_to_router"]
        metrics["unregister_to_router_ms_dynamo"] = round(max(samples) * 1e3, 3)
        metrics["unregister_to_router_ms_dynamo_p50"] = round(percentile(samples, 50) * 1e3, 3)
    notes.append("2-core VM: timings are upper bounds.")
    return Result(
        name=NAME, metrics=metrics,
        units={key: ("ms" if "_ms_" in key or key.endswith("_ms")
                     else "s" if key.endswith("_s_mean")
                     else "scale-downs" if key.endswith("_missing") else "requests")
               for key in metrics},
        parameters={"phases": [(p.rate_rps, p.duration_s) for p in config.phases],
                    "workers": config.workers,
                    "scale_downs": [list(s) for s in config.scale_downs],
                    "decode_step_s": config.decode_step_s, "seed": config.seed,
                    "trace_options": {key: _jsonable(value)
                                      for key, value in config.trace_options.items()},
                    "failed_request_threshold": FAILED_REQUEST_THRESHOLD,
                    "dynamo_samples": DYNAMO_SAMPLES,
                    "runs": {name: r.to_dict() for name, r in runs.items()}},
        notes=notes)
