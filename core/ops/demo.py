"""``quiesce demo``: the field report's scale-down, replayed under two policies.

Several simulated workers sit behind a dispatcher that learns about an
unregistration only after ``discovery_lag_s``. A two-phase load (8 req/s, then
0.2 req/s) of streaming requests of varied lengths runs against them; a quarter of
the requests are disaggregated (this worker prefills and holds the KV until a
decode worker pulls it). In the middle of phase 1 one worker is scaled down:

- ``fixed-grace``: unregister, sleep 5 s, abort whatever is left — what the field
  report saw (every aborted stream is an HTTP 500; freed KV that a decoder had not
  pulled yet is a corrupted decode);
- ``quiesce``: the budgeted shutdown of :mod:`quiesce.shutdown` — unregister,
  router grace, close admission (late arrivals are retried elsewhere), wait for
  admitted requests and the engine probe, exit;
- ``quiesce-lowest-cost``: the same shutdown, but the victim is the worker with the
  lowest :mod:`drain cost <quiesce.drain_cost>` at that moment (what
  ``--publish-deletion-cost`` makes a ReplicaSet do), where the other two take an
  arbitrary one (worker-0: among equally ready pods, a ReplicaSet's choice carries no
  knowledge of their work). Ties go to the arbitrary choice, so the comparison only
  moves when the cost says something.

``moved`` counts the requests the victim held when the scale-down began (admitted and
in flight, or KV held for a decoder): work that must finish there, or be lost.

Time is simulated and compressed by ``time_scale``; every figure is reported in
simulated seconds. The lower bound is when the last request the victim admitted,
and its KV pull, actually finished (for ``fixed-grace``, which cuts them off, it is
the simulator's own estimate of when they would have finished).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import sys
import time
from typing import TextIO

from quiesce.adapters.sim import KVFate, RequestAborted, SimConfig, SimEngine, SimProbe, SimRequest
from quiesce.admission import AdmissionGate, Outcome
from quiesce.budget import check_seconds
from quiesce.discovery import InMemoryDirectory, InMemoryDiscovery
from quiesce.drain import DrainConfig
from quiesce.drain_cost import drain_cost
from quiesce.errors import ConfigError, WorkerDraining
from quiesce.lifecycle import Lifecycle
from quiesce.probe import Role
from quiesce.shutdown import Shutdown, ShutdownPolicy

POLICIES = ("fixed-grace", "quiesce", "quiesce-lowest-cost")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """The scenario, in simulated seconds. Defaults follow the field report."""

    workers: int = 4
    phase1_rps: float = 8.0
    phase1_s: float = 30.0
    phase2_rps: float = 0.2
    phase2_s: float = 20.0
    scale_down_at_s: float = 12.0
    discovery_lag_s: float = 1.5
    fixed_grace_s: float = 5.0
    router_grace_s: float = 1.0
    shutdown_budget_s: float = 120.0
    disagg_fraction: float = 0.25
    never_pulled: int = 0
    time_scale: float = 0.2
    seed: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) \
                or self.workers < 2:
            raise ConfigError("workers", f"need at least 2 workers, got {self.workers!r}")
        for name in ("phase1_rps", "phase2_rps", "phase1_s", "phase2_s", "discovery_lag_s",
                     "fixed_grace_s", "router_grace_s", "shutdown_budget_s", "time_scale"):
            check_seconds(name, getattr(self, name))
        if self.time_scale <= 0:
            raise ConfigError("time_scale", "must be > 0")
        if not 0 <= self.scale_down_at_s <= self.phase1_s:
            raise ConfigError("scale_down_at_s", f"must lie in phase 1 [0, {self.phase1_s}]")
        if not 0 <= self.disagg_fraction <= 1:
            raise ConfigError("disagg_fraction", "must be between 0 and 1")
        if self.never_pulled < 0:
            raise ConfigError("never_pulled", "must be >= 0")


@dataclasses.dataclass(frozen=True)
class DemoRequest:
    request_id: str
    at_s: float
    prompt_tokens: int
    max_tokens: int
    remote_decode: bool


def make_workload(config: DemoConfig) -> list[DemoRequest]:
    """The same requests for a given seed: Poisson arrivals, log-normal output lengths."""
    rng = random.Random(config.seed)
    out: list[DemoRequest] = []
    phases = ((0.0, config.phase1_s, config.phase1_rps),
              (config.phase1_s, config.phase1_s + config.phase2_s, config.phase2_rps))
    for start, end, rps in phases:
        t = start
        while rps > 0:
            t += rng.expovariate(rps)
            if t >= end:
                break
            disagg = rng.random() < config.disagg_fraction
            out.append(DemoRequest(
                request_id=f"req-{len(out):04d}", at_s=t,
                prompt_tokens=rng.randint(64, 2048),
                max_tokens=1 if disagg else max(8, min(1000, int(rng.lognormvariate(5.0, 1.0)))),
                remote_decode=disagg))
    return out


class WorkerGone(Exception):
    """Connection refused: the worker process has exited (nothing was started; retryable)."""


class DemoWorker:
    """One simulated worker: an engine, an admission gate and a discovery record."""

    def __init__(self, index: int, config: DemoConfig, directory: InMemoryDirectory,
                 never_pulled: set[str]) -> None:
        self.name = name = f"worker-{index}"
        self.engine = SimEngine(SimConfig(time_scale=config.time_scale,
                                          seed=config.seed * 1000 + index), name=name)
        self.gate = AdmissionGate()
        self.discovery = InMemoryDiscovery(name, directory)
        self.never_pulled = never_pulled
        self.gone = False
        self.last_done_at = 0.0

    async def handle(self, request: DemoRequest) -> bool:
        """Serve one request; True if the client got a complete answer."""
        if self.gone:
            raise WorkerGone(self.name)
        with self.gate.admit(request.request_id) as admission:
            sim = SimRequest(request.request_id, request.prompt_tokens, request.max_tokens,
                             remote_decode=request.remote_decode,
                             never_pulled=request.request_id in self.never_pulled)
            try:
                async for _ in self.engine.generate(sim):
                    pass
            except RequestAborted:
                admission.finish(Outcome.LOST)
                self.last_done_at = time.monotonic()
                return False
            admission.finish(Outcome.COMPLETED)
        ok = True
        if request.remote_decode:  # the decode worker must still pull the KV from here
            ok = await self.engine.kv_fate(request.request_id) is KVFate.PULLED
        self.last_done_at = max(self.last_done_at, time.monotonic())
        return ok


class Dispatcher:
    """Round-robin router whose view of the workers lags discovery by ``lag_s`` (wall)."""

    def __init__(self, workers: list[DemoWorker], directory: InMemoryDirectory,
                 lag_s: float) -> None:
        self.workers = {w.name: w for w in workers}
        self.view = [w.name for w in workers]
        self._next = 0
        self.retried = 0
        self._lag_s = lag_s
        directory.watch(self._on_change)

    def _on_change(self, name: str, registered: bool) -> None:
        def apply() -> None:
            if registered and name not in self.view:
                self.view.append(name)
            elif not registered and name in self.view:
                self.view.remove(name)
        asyncio.get_running_loop().call_later(self._lag_s, apply)

    async def send(self, request: DemoRequest) -> bool:
        tried: set[str] = set()
        while True:
            candidates = [n for n in self.view if n not in tried]
            if not candidates:
                return False
            name = candidates[self._next % len(candidates)]
            self._next += 1
            try:
                return await self.workers[name].handle(request)
            except (WorkerDraining, WorkerGone):
                self.retried += 1  # nothing started there: safe to send elsewhere
                tried.add(name)


@dataclasses.dataclass
class PolicyResult:
    sent: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    kv_freed_early: int = 0
    drain_s: float = 0.0
    lower_bound_s: float = 0.0
    exit_code: int | None = None
    victim: str = ""
    moved: int = 0
    costs: tuple[int, ...] = ()
    """Every worker's drain cost when the scale-down began, by worker index."""

    def to_dict(self) -> dict[str, object]:
        return {"sent": self.sent, "completed": self.completed, "failed": self.failed,
                "retried": self.retried, "kv_freed_early": self.kv_freed_early,
                "drain_s": round(self.drain_s, 3), "lower_bound_s": round(self.lower_bound_s, 3),
                "exit_code": self.exit_code, "victim": self.victim, "moved": self.moved,
                "costs": list(self.costs)}


class _Progress:
    """A live status line on a terminal; milestone lines only elsewhere."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.live = bool(stream is not None and stream.isatty())

    def line(self, text: str) -> None:
        if self.stream is None:
            return
        if self.live:
            self.stream.write("\r\x1b[2K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def status(self, text: str) -> None:
        if self.live and self.stream is not None:
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()

    def clear(self) -> None:
        if self.live and self.stream is not None:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()


class _Replay:
    """One replay of the workload with one policy applied to the scaled-down worker."""

    def __init__(self, policy: str, config: DemoConfig, progress: TextIO | None) -> None:
        if policy not in POLICIES:
            raise ConfigError("policy", f"unknown policy {policy!r}; expected one of {POLICIES}")
        self.policy = policy
        self.config = config
        self.scale = config.time_scale
        self.workload = make_workload(config)
        disagg_ids = [r.request_id for r in self.workload if r.remote_decode]
        never = set(random.Random(config.seed + 1).sample(
            disagg_ids, min(config.never_pulled, len(disagg_ids))))
        directory = InMemoryDirectory()
        # Only the scaled-down worker's decode peer fails to pull: elsewhere KV always moves.
        self.workers = [DemoWorker(i, config, directory, never if i == 0 else set())
                        for i in range(config.workers)]
        self.victim = self.workers[0]
        self.dispatcher = Dispatcher(self.workers, directory, config.discovery_lag_s * self.scale)
        self.result = PolicyResult(sent=len(self.workload))
        self.show = _Progress(progress)
        self.t0 = 0.0

    def sim_now(self) -> float:
        return (time.monotonic() - self.t0) / self.scale

    def say(self, text: str) -> None:
        self.show.line(f"  [{self.policy}] t={self.sim_now():5.1f}s  {text}")

    async def run(self) -> PolicyResult:
        for worker in self.workers:
            await worker.engine.start()
            await worker.discovery.register()
        self.t0 = time.monotonic()
        tick = asyncio.create_task(self._ticker())
        try:
            await asyncio.gather(self._scale_down(), *(self._client(r) for r in self.workload))
        finally:
            tick.cancel()
            self.show.clear()
        for worker in self.workers:
            await worker.engine.shutdown()
        self.result.retried = self.dispatcher.retried
        self.result.kv_freed_early = self.victim.engine.kv_freed_early
        return self.result

    async def _client(self, request: DemoRequest) -> None:
        await asyncio.sleep(max(0.0, self.t0 + request.at_s * self.scale - time.monotonic()))
        if await self.dispatcher.send(request):
            self.result.completed += 1
        else:
            self.result.failed += 1

    def _costs(self) -> list[int]:
        """Each worker's drain cost now, from its probe and its gate."""
        return [drain_cost(SimProbe(w.engine).snapshot(), w.gate.inflight).value
                for w in self.workers]

    async def _scale_down(self) -> None:
        await asyncio.sleep(self.config.scale_down_at_s * self.scale)
        costs = self._costs()
        if self.policy == "quiesce-lowest-cost" and costs[0] > min(costs):
            self.victim = self.workers[costs.index(min(costs))]
        victim = self.victim
        self.result.victim, self.result.costs = victim.name, tuple(costs)
        self.result.moved = victim.gate.inflight + victim.engine.counts()[2]
        self.say(f"scaling down {victim.name} ({victim.gate.inflight} admitted, "
                 f"{victim.engine.counts()[2]} KV held; drain costs {costs})")
        started = time.monotonic()
        if self.policy == "fixed-grace":
            await self._fixed_grace(started)
        else:
            await self._quiesce(started)
        victim.gone = True

    async def _fixed_grace(self, started: float) -> None:
        """What the field report saw: unregister, sleep the grace period, abort the rest."""
        engine = self.victim.engine
        await self.victim.discovery.unregister()
        await asyncio.sleep(self.config.fixed_grace_s * self.scale)
        would_finish = (time.monotonic() - started) / self.scale + engine.estimated_drain_s()
        aborted = await engine.abort_all("grace period over")
        await engine.shutdown()
        self.result.drain_s = (time.monotonic() - started) / self.scale
        self.result.lower_bound_s = would_finish
        self.say(f"grace over: aborted {aborted}")

    async def _quiesce(self, started: float) -> None:
        """The budgeted shutdown a real worker runs on SIGTERM."""
        victim, scale = self.victim, self.scale
        lifecycle = Lifecycle(gate=victim.gate, probe=SimProbe(victim.engine, Role.AGGREGATED),
                              discovery=victim.discovery,
                              config=DrainConfig(router_grace_s=self.config.router_grace_s * scale))
        budget_s = self.config.shutdown_budget_s
        shutdown = Shutdown(lifecycle, victim.engine,
                            ShutdownPolicy(total_s=budget_s * scale,
                                           cleanup_reserve_s=min(5.0, budget_s / 4) * scale))
        shutdown.request("scale-down")
        report = await shutdown.run()
        run = lifecycle.current_run
        ended = run.ended_at if run is not None and run.ended_at is not None else time.monotonic()
        finished_at = max(victim.last_done_at, victim.engine.idle_since or ended)
        self.result.drain_s = (ended - started) / scale
        self.result.lower_bound_s = max(0.0, finished_at - started) / scale
        self.result.exit_code = report.exit_code
        self.say(f"shutdown {'clean' if report.drained else 'forced'}: exit code "
                 f"{report.exit_code}, aborted {report.aborted_requests}")

    async def _ticker(self) -> None:
        total = self.config.phase1_s + self.config.phase2_s
        result = self.result
        while True:
            victim = self.victim  # chosen at the scale-down (lowest cost: maybe not worker-0)
            done = result.completed + result.failed
            self.show.status(f"  [{self.policy}] t={self.sim_now():5.1f}/{total:.0f}s  "
                             f"done {done}/{result.sent}  failed {result.failed}  "
                             f"retried {self.dispatcher.retried}  "
                             f"{victim.name}: {victim.gate.inflight} admitted")
            await asyncio.sleep(0.1)


async def run_policy(policy: str, config: DemoConfig,
                     progress: TextIO | None = None) -> PolicyResult:
    """Replay the workload once with ``policy`` applied to the scaled-down worker."""
    return await _Replay(policy, config, progress).run()


def policies_for(config: DemoConfig) -> tuple[str, ...]:
    """Every policy, except the victim choice when KV is never pulled: that scenario is
    about worker-0's decode peer, and any other victim would leave worker-0 holding the
    KV for ever (nothing scales it down)."""
    return POLICIES if config.never_pulled == 0 else POLICIES[:2]


async def run_demo(config: DemoConfig, progress: TextIO | None = None) -> dict[str, PolicyResult]:
    results: dict[str, PolicyResult] = {}
    for policy in policies_for(config):
        results[policy] = await run_policy(policy, config, progress)
    return results


def format_table(results: dict[str, PolicyResult]) -> str:
    header = ("policy", "sent", "completed", "failed", "retried", "victim", "moved", "drain_s",
              "lower_bound_s")
    rows = [header] + [
        (name, str(r.sent), str(r.completed), str(r.failed), str(r.retried), r.victim,
         str(r.moved), f"{r.drain_s:.3f}", f"{r.lower_bound_s:.3f}")
        for name, r in results.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(config: DemoConfig, as_json: bool, quiet: bool) -> int:
    """Run the demo and print the table (or JSON). Exit 0 if quiesce lost nothing."""
    logging.getLogger("quiesce").setLevel(logging.WARNING)
    progress = None if quiet else sys.stderr
    if progress is not None:
        progress.write(f"quiesce demo: {config.workers} workers, {config.phase1_rps} req/s for "
                       f"{config.phase1_s:.0f}s then {config.phase2_rps} req/s for "
                       f"{config.phase2_s:.0f}s; scale-down at {config.scale_down_at_s:.0f}s "
                       f"(simulated time, {1 / config.time_scale:.0f}x compressed)\n")
    results = asyncio.run(run_demo(config, progress))
    if as_json:
        print(json.dumps({"policies": {k: v.to_dict() for k, v in results.items()},
                          "config": dataclasses.asdict(config)}, indent=2))
    else:
        print(format_table(results))
        q, cheap = results["quiesce"], results.get("quiesce-lowest-cost")
        print(f"\nquiesce: {q.failed} failed; drain took {q.drain_s - q.lower_bound_s:+.3f}s "
              "beyond the lower bound (simulated seconds).")
        if cheap is not None:
            print(f"lowest drain cost as the victim: {cheap.victim} drained in "
                  f"{cheap.drain_s:.3f}s with {cheap.moved} request(s) on it, against "
                  f"{q.drain_s:.3f}s and {q.moved} for {q.victim}.")
    lost = sum(r.failed for name, r in results.items() if name != "fixed-grace")
    return 0 if lost == 0 else 1
