"""Unit tests of :class:`quiesce.lifecycle.Lifecycle`: the status it reports.

``Status.to_dict()`` while serving and during and after a drain (stage, budget, trend,
last drain), the trend of UNKNOWN pending work, and ``read_status`` never raising.

Fakes (a scripted probe and discovery) and helpers: :mod:`tests.unit.lifecycle_harness`.
"""

from __future__ import annotations

import pytest

from quiesce import Verdict
from quiesce.lifecycle import State
from tests.unit.lifecycle_harness import Mode, Workers, finished

STATUS_KEYS = {"state", "generation", "inflight_requests", "accepting", "discovery_registered",
               "since", "seconds_in_state", "last_error", "pending_work", "drain", "last_drain",
               "requests", "drain_cost", "discovery_error"}


# -- status ------------------------------------------------------------------------------


async def test_status_dict_while_serving(workers: Workers) -> None:
    h = await workers.new("zero")
    with h.gate.admit("r1"):
        status = h.lc.status().to_dict()
    assert set(status) == STATUS_KEYS
    assert status["state"] == "serving"
    assert status["generation"] == 0
    assert status["inflight_requests"] == 1
    assert status["accepting"] is True
    assert status["discovery_registered"] is True
    assert status["since"] == 1_000.0
    assert status["last_error"] is None
    assert status["pending_work"] is None
    assert status["drain"] is None
    assert status["last_drain"] is None


async def test_status_dict_shows_drain_progress(workers: Workers) -> None:
    h = await workers.new("busy")
    h.wall.now = 2_000.0
    run = await h.lc.drain(budget_s=30.0)
    await h.probe.wait_reads(3)

    status = h.lc.status().to_dict()
    assert set(status) == STATUS_KEYS
    assert status["state"] == "draining"
    assert status["generation"] == 1
    assert status["inflight_requests"] == 0
    assert status["accepting"] is False
    assert status["discovery_registered"] is False
    assert status["since"] == 2_000.0
    assert status["last_error"] is None
    pending = status["pending_work"]
    assert isinstance(pending, dict)
    assert pending["verdict"] == "busy" and pending["total"] == 3
    drain = status["drain"]
    assert isinstance(drain, dict)
    assert drain["generation"] == run.generation
    assert drain["stage"] == "engine"
    elapsed, budget_left = drain["elapsed_s"], drain["budget_left_s"]
    assert isinstance(elapsed, float) and elapsed >= 0
    assert drain["budget_s"] == 30.0
    assert isinstance(budget_left, float) and 0 <= budget_left <= 30.0
    trend = drain["trend"]
    assert isinstance(trend, list) and len(trend) >= 2
    assert all(n == 3 for _, n in trend)
    times = [t for t, _ in trend]
    assert times == sorted(times)

    h.wall.now = 3_000.0
    h.probe.mode = "zero"
    assert (await finished(run)).drained
    done = h.lc.status().to_dict()
    assert done["state"] == "drained" and done["since"] == 3_000.0
    assert done["generation"] == 2
    assert done["drain"] is None
    last = done["last_drain"]
    assert isinstance(last, dict) and last["drained"] is True and last["outcome"] == "completed"
    pending = done["pending_work"]
    assert isinstance(pending, dict) and pending["verdict"] == "quiescent"


async def test_status_with_unknown_pending_work_shows_its_trend_as_none(
        workers: Workers) -> None:
    h = await workers.new("unknown")
    run = await h.lc.drain()
    await h.probe.wait_reads(2)
    drain = h.lc.status().to_dict()["drain"]
    assert isinstance(drain, dict) and drain["budget_s"] is None and drain["budget_left_s"] is None
    trend = drain["trend"]
    assert isinstance(trend, list) and trend and all(n is None for _, n in trend)
    assert not run.task.done()


@pytest.mark.parametrize("mode", ["raise", "hang"])
async def test_read_status_never_raises(workers: Workers, mode: Mode) -> None:
    h = await workers.new(mode)
    status = await h.lc.read_status(probe_timeout=0.01)
    assert status.state is State.SERVING
    assert status.pending_work is not None
    assert status.pending_work.verdict is Verdict.UNKNOWN
    assert status.to_dict()["pending_work"] is not None
