"""The replay's victim choice, against stand-in worker handles (no processes, no etcd).

The replay itself (``tests/integration/test_replay.py``, ``bench/replay``) runs real
workers; this checks the choice rule on the status shape the real worker serves
(``drain_cost`` is ``{"value": ms, "unit": "ms", "source", "reason"}``, as
``GET /engine/status`` answers it), so that a lowest-cost replay cannot silently fall
back to the first worker by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from bench.replay.cluster import UNKNOWN_COST, Cluster


@dataclass
class Process:
    code: int | None = None

    def poll(self) -> int | None:
        return self.code


@dataclass
class StandInWorker:
    """What the cluster reads of a worker: its process and its status."""

    cost: Any
    process: Process

    def status(self) -> dict[str, object]:
        if self.cost == "unreachable":
            raise httpx.ConnectError("refused")
        return {"state": "serving", "drain_cost": self.cost}


def cluster(costs: dict[str, Any]) -> Cluster:
    made = Cluster("quiesce", len(costs), 0.1)  # nothing starts before __enter__
    made.workers = {name: StandInWorker(cost, Process())  # type: ignore[misc]
                    for name, cost in costs.items()}
    return made


def cost(ms: int) -> dict[str, object]:
    return {"value": ms, "unit": "ms", "source": "eta", "reason": None}


async def test_the_lowest_drain_cost_is_the_victim_and_never_chosen_twice() -> None:
    made = cluster({"worker-0": cost(9000), "worker-1": cost(1200), "worker-2": cost(4000)})
    victim, costs = await made.choose_victim(by_cost=True)
    assert victim == "worker-1"
    assert costs == {"worker-0": 9000, "worker-1": 1200, "worker-2": 4000}
    second, _ = await made.choose_victim(by_cost=True)  # worker-1 is still draining
    assert second == "worker-2"


async def test_an_unreadable_or_unknown_cost_is_the_highest() -> None:
    made = cluster({"worker-0": "unreachable", "worker-1": {"value": None, "unit": "ms"},
                    "worker-2": cost(30000)})
    victim, costs = await made.choose_victim(by_cost=True)
    assert victim == "worker-2"
    assert costs is not None and costs["worker-0"] == costs["worker-1"] == UNKNOWN_COST


async def test_without_costs_the_first_serving_worker_by_name_goes() -> None:
    made = cluster({"worker-0": cost(9000), "worker-1": cost(1)})
    made.workers["worker-0"].process.code = 0  # type: ignore[attr-defined]  # exited
    assert await made.choose_victim(by_cost=False) == ("worker-1", None)
    with pytest.raises(RuntimeError, match="no worker left"):
        await made.choose_victim(by_cost=False)


def test_bad_cluster_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        Cluster("sleep-5", 2, 0.1)
    with pytest.raises(ValueError, match="size"):
        Cluster("quiesce", 0, 0.1)
