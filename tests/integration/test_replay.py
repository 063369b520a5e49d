"""The field report, replayed end to end with real parts and a shorter trace.

Real: NVIDIA's aiperf 0.13.0 (its own environment, ``ci/setup_aiperf.sh``) driving a
seeded two-phase mooncake trace (8 req/s, then 0.2 req/s) through the replay's router,
which follows a real etcd (``ci/setup_etcd.sh``); four ``quiesce serve`` worker processes
registered there with leases; two scale-downs during phase 1 (the kubelet's preStop hook
and SIGTERM to the main process, then SIGTERM to the whole process group). Simulated:
the engine behind each worker (``--engine sim``: tokens on a timer). Every request is
judged from aiperf's raw export by reading its stream to the end
(:mod:`bench.replay.judge`), never by aiperf's own count. ``make bench`` runs the long
version (``bench/results/replay.json``).

Every fifth request of the trace asks for 1,000 tokens (10 s at 0.01 s a token), so each
victim holds a stream that outlives a fixed 5 s grace: the field report's policy must lose
it, and quiesce must not.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from bench.replay import aiperf
from bench.replay.run import PolicyRun, ReplayConfig, replay
from bench.replay.trace import Phase
from tests.integration.real_parts import require_etcd, skip_unless_present

pytestmark = pytest.mark.slow

require_etcd()
skip_unless_present(aiperf.missing())

LONG_TOKENS = 1000
EVERY = 5


@dataclasses.dataclass
class EveryFifthLong:
    """Output lengths: every :data:`EVERY`-th request long, the others short (0.1-0.6 s).
    Five is coprime to the four and three workers of round robin, so long streams land on
    every worker."""

    drawn: int = 0

    def sample(self, rng: random.Random) -> int:
        self.drawn += 1
        return LONG_TOKENS if self.drawn % EVERY == 1 else rng.randint(10, 60)


def config() -> ReplayConfig:
    return ReplayConfig(phases=(Phase(8.0, 12.0), Phase(0.2, 6.0)), workers=4,
                        scale_downs=((4.0, "kubelet"), (8.0, "group")), decode_step_s=0.01,
                        seed=7, trace_options={"output_lengths": EveryFifthLong()})


async def test_quiesce_loses_no_request_in_the_replay(tmp_path: Path) -> None:
    run = await replay("quiesce", config(), tmp_path, failed_request_threshold=0.001)
    explain = f"{run.to_dict()}"
    assert run.complete and run.sent == run.planned >= 80, explain  # every request judged
    assert run.failed == 0 and run.failures == {}, explain
    assert run.aiperf_rc == 0, explain
    assert [r.delivery for r in run.scale_downs] == ["kubelet", "group"]
    for record in run.scale_downs + run.end:
        assert record.exit_code == 0, explain
        assert record.report is not None and record.report["drained"] is True, explain
        assert record.report["lost_requests"] == 0, explain
    assert run.scale_downs[0].prestop_code == 0, explain  # preStop drained the worker
    for record in run.scale_downs:
        assert record.router_removed is not None, explain  # the router saw it go
        assert record.drain_since is not None, explain
    assert run.router["no_worker"] == 0 and run.router["cut"] == 0, explain


async def test_fixed_grace_loses_requests_that_aiperf_counts_as_successes(
        tmp_path: Path) -> None:
    run: PolicyRun = await replay("fixed_grace", config(), tmp_path,
                                  failed_request_threshold=0.001)
    explain = f"{run.to_dict()}"
    assert run.complete and run.sent == run.planned >= 80, explain
    assert run.failed >= 1, explain  # each victim held a 10 s stream past the 5 s grace
    assert "error_event" in run.failures, explain  # 200, then the worker's abort event
    for record in run.scale_downs:
        assert record.report is not None and record.report["drained"] is False, explain
        assert record.exit_code in (3, 5), explain  # forced or lost: never a false 0
    own = run.aiperf_own
    assert own["request_count"] + own["error_request_count"] == run.sent, explain
    assert own["error_request_count"] < run.failed, explain  # aiperf's blind spot
    assert run.aiperf_rc == 0, explain  # so its failed-request threshold never fired
