"""The replay's cluster: a real etcd, reference workers registered in it, and the router.

- etcd: a throw-away etcd on loopback (:class:`~quiesce.adapters.etcd.local.LocalEtcd`,
  ``ci/setup_etcd.sh``).
- workers: ``quiesce serve --engine sim --etcd HOST:PORT --name worker-N`` processes
  (:func:`tests.integration.worker_process.start_worker`), each registering under the
  prefix with a lease; the shutdown policy is their command line (:data:`POLICIES`).
- router: :mod:`bench.replay.router` in its own process (:class:`RouterProcess`),
  following the prefix.

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
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from quiesce.adapters.etcd.local import LocalEtcd
from tests.integration.worker_process import (
    Worker,
    kubelet_delete,
    prestop_command,
    start_worker,
)

log = logging.getLogger("bench.replay.cluster")

PREFIX = "/quiesce/replay"
GRACE_S = 120.0
"""terminationGracePeriodSeconds of every worker's pod: SIGKILL this long after the
deletion began."""
PRESTOP_MARGIN_S = 55.0
"""What ``quiesce prestop`` leaves of the grace period for the SIGTERM shutdown: more
than the worker's budget (deploy/kubernetes/worker.yaml's rule), so a drain the hook
could not finish still gets its whole budget before SIGKILL."""
QUIESCE_BUDGET_S = 50.0
"""The quiesce worker's shutdown budget: ample for the trace's longest stream (30 s)."""
FIXED_GRACE_S = 5.0
"""The field report's policy: unregister, keep serving this long, abort the rest."""
STATUS_POLL_S = 0.02
ROUTER_START_S = 30.0
REPO = Path(__file__).resolve().parents[2]
UNKNOWN_COST = 2**31 - 1
"""An unreadable drain cost: the highest, as the worker itself publishes it."""

POLICIES: dict[str, tuple[str, ...]] = {
    # The field report: unregister, keep serving (routers may still send) for a fixed 5 s,
    # then abort whatever is still running and exit. quiesce serve's drain configured to
    # do exactly that: the router grace is the whole drain budget, nothing waits on work.
    "fixed_grace": ("--router-grace", str(FIXED_GRACE_S), "--budget", str(FIXED_GRACE_S + 0.5),
                    "--reserve", "0.5"),
    # quiesce: unregister, a short router grace, wait until every admitted request ended
    # (and the engine says quiescent), within a budget that fits the grace period.
    "quiesce": ("--router-grace", "1", "--budget", str(QUIESCE_BUDGET_S), "--reserve", "5"),
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
    at_s: float
    """When it began, in seconds into the load."""
    began: float
    """Wall clock when the platform began removing it (preStop or signal)."""
    costs: dict[str, int] | None = None
    """Every serving worker's drain cost (ms) when the victim was chosen by it."""
    drain_since: float | None = None
    """Wall clock at which the worker entered ``draining`` (right before unregistering)."""
    router_removed: float | None = None
    """Wall clock at which the router stopped picking it."""
    unregister_call_ms: float | None = None
    """How long the worker's unregister call took (the etcd delete and lease revoke)."""
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
        return {"victim": self.victim, "delivery": self.delivery, "at_s": round(self.at_s, 3),
                "drain_costs_ms": self.costs,
                "removal_s": (None if self.ended is None
                              else round(self.ended - self.began, 3)),
                "exit_code": self.exit_code, "prestop_code": self.prestop_code,
                "unregister_to_router_ms": (None if self.unregister_to_router_ms is None
                                            else round(self.unregister_to_router_ms, 3)),
                "unregister_call_ms": (None if self.unregister_call_ms is None
                                       else round(self.unregister_call_ms, 3)),
                "drained": report.get("drained"), "outcome": report.get("outcome"),
                "lost_requests": report.get("lost_requests"),
                "aborted_requests": report.get("aborted_requests"),
                "drain_s": report.get("elapsed_s"),
                "requests_since_signal": report.get("requests")}


class RouterProcess:
    """The replay's router (:mod:`bench.replay.router`) as its own process, as routers
    run; :meth:`stats` reads its counters and the moments it dropped each worker."""

    def __init__(self, process: subprocess.Popen[str], port: int) -> None:
        self.process = process
        self.url = f"http://127.0.0.1:{port}"

    @classmethod
    @contextlib.contextmanager
    def start(cls, etcd: str, prefix: str) -> Iterator[RouterProcess]:
        """Start it; on the way out SIGTERM (then SIGKILL after 10 s) its process group."""
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.replay.router", "--etcd", etcd, "--prefix", prefix],
            cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
        ready: list[dict[str, Any]] = []
        seen = threading.Event()

        def read() -> None:  # a thread, so that a full pipe never blocks the router
            assert process.stdout is not None
            for line in process.stdout:
                if '"ready"' in line and not ready:
                    ready.append(json.loads(line))
                    seen.set()
            seen.set()

        threading.Thread(target=read, daemon=True).start()
        try:
            seen.wait(ROUTER_START_S)
            if not ready:
                raise RuntimeError(f"the router did not start within {ROUTER_START_S} s "
                                   f"(exit code {process.poll()})")
            yield cls(process, int(ready[0]["port"]))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    async def stats(self) -> dict[str, Any]:
        """``GET /router/stats``: picks, retried, cut, no_worker, first_request_at,
        removed_at and last_pick_at (wall clock), listed."""
        async with httpx.AsyncClient(timeout=10) as client:
            answer = await client.get(f"{self.url}/router/stats")
            answer.raise_for_status()
            stats: dict[str, Any] = answer.json()
            return stats

    async def until(self, check: Callable[[dict[str, Any]], bool], what: str,
                    timeout_s: float, done: Callable[[], bool] = lambda: False
                    ) -> dict[str, Any]:
        """Poll :meth:`stats` (every 20 ms) until ``check`` holds; RuntimeError after
        ``timeout_s``, or as soon as ``done()`` says waiting is pointless."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = await self.stats()
            if check(stats):
                return stats
            if done() or time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"{what}: not seen within {timeout_s} s (router exit "
                                   f"code {self.process.poll()}); last stats {stats}")
            await asyncio.sleep(STATUS_POLL_S)


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
        self.etcd: LocalEtcd  # started by __enter__
        self.workers: dict[str, Worker] = {}
        self.router: RouterProcess | None = None
        self._removing: set[str] = set()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Cluster:
        try:
            self.etcd = LocalEtcd(name="quiesce-replay")
            self._stack.callback(self.etcd.close)
            self.etcd.start_sync(timeout_s=15)
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
    async def routed(self) -> AsyncIterator[RouterProcess]:
        """The router in its own process, following etcd, once it lists every worker."""
        with RouterProcess.start(f"{self.etcd.host}:{self.etcd.port}", PREFIX) as router:
            self.router = router
            try:
                await router.until(lambda stats: set(self.workers) <= set(stats["listed"]),
                                   "the router lists every worker", ROUTER_START_S)
                yield router
            finally:
                self.router = None

    def alive(self) -> list[str]:
        return [name for name, worker in self.workers.items() if worker.process.poll() is None]

    def serving(self) -> list[str]:
        """Alive and not being scaled down: the candidates of the next scale-down."""
        return [name for name in self.alive() if name not in self._removing]

    async def drain_costs(self) -> dict[str, int]:
        """Each serving worker's drain cost (ms) from its status; unreadable: the worst."""
        costs: dict[str, int] = {}
        for name in self.serving():
            try:
                status = await asyncio.to_thread(self.workers[name].status)
            except (httpx.HTTPError, OSError):
                status = {}
            cost = status.get("drain_cost")  # {"value": ms, "unit": "ms", "source", ...}
            value = cost.get("value") if isinstance(cost, dict) else None
            costs[name] = int(value) if isinstance(value, (int, float)) else UNKNOWN_COST
        log.info("drain costs (ms): %s", costs)
        return costs

    async def choose_victim(self, by_cost: bool) -> tuple[str, dict[str, int] | None]:
        """The worker a scale-down removes (from then on it is no candidate), and the drain
        costs it was chosen by: the first serving one by name (a ReplicaSet choosing among
        equally ready pods; no costs), or the one with the lowest drain cost (what
        ``--publish-deletion-cost`` makes it do)."""
        costs = await self.drain_costs() if by_cost else None
        serving = self.serving()
        if not serving:
            raise RuntimeError("no worker left to scale down")
        victim = (min(serving, key=lambda name: (costs.get(name, UNKNOWN_COST), name))
                  if costs is not None else serving[0])
        self._removing.add(victim)
        return victim, costs

    async def scale_down(self, victim: str, delivery: str, at_s: float,
                         costs: dict[str, int] | None = None) -> ScaleDown:
        """Remove ``victim`` by ``delivery``; returns once its process is gone. ``at_s``
        (seconds into the load) and ``costs`` (the drain costs it was chosen by) are kept
        in the record."""
        if delivery not in DELIVERIES:
            raise ValueError(f"unknown delivery {delivery!r}; one of {DELIVERIES}")
        worker = self.workers[victim]
        self._removing.add(victim)
        record = ScaleDown(victim, delivery, at_s, time.time(), costs=costs)
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
            removed = (await self.router.stats())["removed_at"]
            record.router_removed = removed.get(victim)
        log.info("scale-down of %s (%s): exit %s, %s", victim, delivery, record.exit_code,
                 (record.report or {}).get("outcome"))
        return record

    @staticmethod
    async def _watch_drain(worker: Worker, record: ScaleDown) -> None:
        """Poll the worker's status until it is gone: keep its ``since`` on entering
        ``draining`` (the drain began; the unregister comes next) and, once the drain is
        over, how long its unregister call took (``last_drain``'s first stage)."""
        while worker.process.poll() is None:
            try:
                status = await asyncio.to_thread(worker.status)
            except (httpx.HTTPError, OSError):
                return  # the admin API is gone: the worker is exiting
            since = status.get("since")
            if (record.drain_since is None and status.get("state") == "draining"
                    and isinstance(since, (int, float))):
                record.drain_since = float(since)
            last = status.get("last_drain")
            stages = last.get("stages") if isinstance(last, dict) else None
            for stage in stages if isinstance(stages, list) else ():
                if (stage.get("stage") == "unregister" and record.drain_since is not None
                        and record.unregister_call_ms is None):  # the first drain's
                    record.unregister_call_ms = float(stage["elapsed_s"]) * 1e3
            await asyncio.sleep(STATUS_POLL_S)

    async def stop_all(self) -> list[ScaleDown]:
        """SIGTERM every worker still serving (after the load): their exit reports."""
        records = [ScaleDown(name, "end", -1.0, time.time()) for name in self.alive()]
        for record in records:
            self.workers[record.victim].signal(signal.SIGTERM)
        for record in records:
            record.exit_code, record.report = await asyncio.to_thread(
                self.workers[record.victim].finish, GRACE_S)
        return records
