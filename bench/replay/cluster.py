"""The replay's cluster: a real etcd, reference workers registered in it, and the router.

- etcd: a throw-away etcd on loopback (:class:`~quiesce.adapters.etcd.local.LocalEtcd`,
  ``ci/setup_etcd.sh``).
- workers: ``quiesce serve --engine sim --etcd HOST:PORT --name worker-N`` processes
  (:func:`tests.integration.worker_process.start_worker`), each registering under the
  prefix with a lease; the shutdown policy is their command line (:data:`POLICIES`).
- router: :class:`bench.replay.router.Router`, in this process, following the prefix.

A scale-down (:meth:`Cluster.scale_down`) removes one worker the way the platform does
(:data:`DELIVERIES`) and records what happened: when the worker began to unregister (its
status's ``since`` on entering ``draining``, wall clock), when the router stopped
picking it, its exit code and its own shutdown report. Every process started here is
stopped on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from bench.replay.router import Router
from quiesce.adapters.etcd.local import LocalEtcd
from tests.integration.worker_process import (
    Worker,
    kubelet_delete,
    prestop_command,
    start_worker,
)

log = logging.getLogger("bench.replay.cluster")

PREFIX = "/quiesce/replay"
GRACE_S = 60.0
"""terminationGracePeriodSeconds of every worker's pod: SIGKILL this long after the
deletion began."""
PRESTOP_MARGIN_S = 10.0
"""What ``quiesce prestop`` leaves of the grace period for the SIGTERM shutdown."""
FIXED_GRACE_S = 5.0
"""The field report's policy: unregister, keep serving this long, abort the rest."""
STATUS_POLL_S = 0.02

POLICIES: dict[str, tuple[str, ...]] = {
    # The field report: unregister, keep serving (routers may still send) for a fixed 5 s,
    # then abort whatever is still running and exit. quiesce serve's drain configured to
    # do exactly that: the router grace is the whole drain budget, nothing waits on work.
    "fixed_grace": ("--router-grace", str(FIXED_GRACE_S), "--budget", str(FIXED_GRACE_S + 0.5),
                    "--reserve", "0.5"),
    # quiesce: unregister, a short router grace, wait until every admitted request ended
    # (and the engine says quiescent), within a budget that fits the grace period.
    "quiesce": ("--router-grace", "1", "--budget", str(GRACE_S - PRESTOP_MARGIN_S),
                "--reserve", "5"),
}
PRESTOP_HOOK = {"fixed_grace": False, "quiesce": True}
"""Whether the policy's pod has the preStop hook ``quiesce prestop``."""
DELIVERIES = ("kubelet", "group")
"""``kubelet``: the preStop hook (when the policy has one), SIGTERM to the main process,
SIGKILL at the grace period. ``group``: SIGTERM to the worker's whole process group (an
init shim, a terminal), SIGKILL at the grace period."""


@dataclasses.dataclass
class ScaleDown:
    """One worker removed, and what it did on its way out."""

    victim: str
    delivery: str
    began: float
    """Wall clock when the platform began removing it (preStop or signal)."""
    drain_since: float | None = None
    """Wall clock at which the worker entered ``draining`` (right before unregistering)."""
    router_removed: float | None = None
    """Wall clock at which the router stopped picking it."""
    ended: float | None = None
    """Wall clock at which its process was gone (or SIGKILLed at the grace period)."""
    exit_code: int | None = None
    prestop_code: int | None = None
    report: dict[str, Any] | None = None

    @property
    def unregister_to_router_ms(self) -> float | None:
        if self.drain_since is None or self.router_removed is None:
            return None
        return (self.router_removed - self.drain_since) * 1e3

    def to_dict(self) -> dict[str, object]:
        report = self.report or {}
        return {"victim": self.victim, "delivery": self.delivery,
                "removal_s": (None if self.ended is None
                              else round(self.ended - self.began, 3)),
                "exit_code": self.exit_code, "prestop_code": self.prestop_code,
                "unregister_to_router_ms": (None if self.unregister_to_router_ms is None
                                            else round(self.unregister_to_router_ms, 3)),
                "drained": report.get("drained"), "outcome": report.get("outcome"),
                "lost_requests": report.get("lost_requests"),
                "aborted_requests": report.get("aborted_requests"),
                "drain_s": report.get("elapsed_s"),
                "requests_since_signal": report.get("requests")}


class Cluster:
    """etcd, ``size`` workers under one policy, and the router. Use as a context manager
    (synchronous set-up and teardown) and ``async with`` for the router."""

    def __init__(self, policy: str, size: int, decode_step_s: float) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; one of {sorted(POLICIES)}")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.policy = policy
        self.size = size
        self.decode_step_s = decode_step_s
        self.etcd = LocalEtcd(name="quiesce-replay")
        self.workers: dict[str, Worker] = {}
        self.router: Router | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Cluster:
        try:
            self.etcd.start_sync(timeout_s=15)
            self._stack.callback(self.etcd.close)
            endpoint = f"{self.etcd.host}:{self.etcd.port}"
            for index in range(self.size):
                name = f"worker-{index}"
                self.workers[name] = self._stack.enter_context(start_worker(
                    "--etcd", endpoint, "--etcd-prefix", PREFIX, "--name", name,
                    "--decode-step", str(self.decode_step_s), *POLICIES[self.policy]))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()  # workers first (SIGKILL if still running), then etcd

    @contextlib.asynccontextmanager
    async def routed(self) -> AsyncIterator[Router]:
        """The router, following etcd, once it lists every worker."""
        router = Router(self.etcd.host, self.etcd.port, PREFIX)
        await router.start()
        self.router = router
        try:
            for name in self.workers:
                if not await router.watcher.wait_for(name, True, timeout_s=15):
                    raise RuntimeError(f"the router does not list {name} after 15 s")
            yield router
        finally:
            await router.stop()
            self.router = None

    def serving(self) -> list[str]:
        return [name for name, worker in self.workers.items() if worker.process.poll() is None]

    async def drain_costs(self) -> dict[str, int]:
        """Each serving worker's drain cost (ms) from its status; unreadable: the worst."""
        costs: dict[str, int] = {}
        for name in self.serving():
            try:
                status = await asyncio.to_thread(self.workers[name].status)
                cost = status.get("drain_cost")
                costs[name] = int(cost) if isinstance(cost, (int, float)) else 2**31 - 1
            except (httpx.HTTPError, OSError):
                costs[name] = 2**31 - 1
        return costs

    async def choose_victim(self, by_cost: bool) -> str:
        """The worker a scale-down removes: the first serving one by name (a ReplicaSet
        choosing among equally ready pods), or the one with the lowest drain cost (what
        ``--publish-deletion-cost`` makes it do)."""
        serving = self.serving()
        if not serving:
            raise RuntimeError("no worker left to scale down")
        if not by_cost:
            return serving[0]
        costs = await self.drain_costs()
        return min(serving, key=lambda name: (costs[name], name))

    async def scale_down(self, victim: str, delivery: str) -> ScaleDown:
        """Remove ``victim`` by ``delivery``; returns once its process is gone."""
        if delivery not in DELIVERIES:
            raise ValueError(f"unknown delivery {delivery!r}; one of {DELIVERIES}")
        worker = self.workers[victim]
        record = ScaleDown(victim, delivery, time.time())
        watching = asyncio.create_task(self._watch_drain(worker, record))
        try:
            if delivery == "kubelet":
                hook = (prestop_command(worker, GRACE_S, PRESTOP_MARGIN_S)
                        if PRESTOP_HOOK[self.policy] else None)
                deletion = await kubelet_delete(worker, GRACE_S, hook)
                record.exit_code, record.prestop_code = deletion.exit_code, deletion.prestop_code
                record.report = deletion.report
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.process.pid, signal.SIGTERM)
                record.exit_code, record.report = await asyncio.to_thread(worker.finish,
                                                                          GRACE_S)
        finally:
            record.ended = time.time()
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
        if self.router is not None:
            record.router_removed = self.router.stats.removed_at.get(victim)
        log.info("scale-down of %s (%s): exit %s, %s", victim, delivery, record.exit_code,
                 (record.report or {}).get("outcome"))
        return record

    @staticmethod
    async def _watch_drain(worker: Worker, record: ScaleDown) -> None:
        """Poll the worker's status until it shows the drain began; keep its ``since``."""
        while worker.process.poll() is None:
            try:
                status = await asyncio.to_thread(worker.status)
            except (httpx.HTTPError, OSError):
                return  # the admin API is gone: the worker is exiting
            if status.get("state") != "serving":
                since = status.get("since")
                record.drain_since = float(since) if isinstance(since, (int, float)) else None
                return
            await asyncio.sleep(STATUS_POLL_S)

    async def stop_all(self) -> list[ScaleDown]:
        """SIGTERM every worker still serving (after the load): their exit reports."""
        records = [ScaleDown(name, "end", time.time()) for name in self.serving()]
        for record in records:
            self.workers[record.victim].signal(signal.SIGTERM)
        for record in records:
            record.exit_code, record.report = await asyncio.to_thread(
                self.workers[record.victim].finish, GRACE_S)
        return records
