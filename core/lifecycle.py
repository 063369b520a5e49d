"""The worker lifecycle: serving → draining → drained, resume, and terminal stopping.

States and transitions::

    serving ──drain──▶ draining ──(quiescent, same generation)──▶ drained
       ▲                  │  ▲                                        │
       └─────resume───────┘  └──────(resume failed: re-drain)─────────┘
    any ──stop──▶ stopping (terminal)

Every transition bumps the **generation**. A drain run remembers the generation it
was started in and may publish ``drained`` only if that generation is still
current, so a stale run can never mark a resumed worker drained.

A drain run, in order (one :class:`~quiesce.budget.Deadline` bounds it all):

1. unregister from discovery;
2. router grace: keep admitting for ``router_grace_s``, since routers that already
   picked this worker are still sending, then (``router_quiet_s``) until no request has
   come for that long (skipped if the worker was not registered);
3. close admission (late arrivals get the typed, retryable ``WorkerDraining``);
4. wait until nothing is admitted (woken by the gate);
5. wait until the probe is quiescent (woken by the probe, or short-backoff polling);
6. publish ``drained`` if the generation is unchanged and no admitted request ended
   ``lost`` since the worker left serving (counted across retried runs; otherwise the
   run ends ``lost``, with the count).

The run is a detached task: whoever started it may go away without leaving the
worker stuck in ``draining``. ``resume()`` cancels and joins it, opens admission,
then re-registers; if registration fails, or discovery does not confirm it (and any
unregister still running) within ``registration_timeout_s``, it closes admission
again, starts a fresh drain (so the state converges to ``drained`` only through a
verified path) and raises :class:`~quiesce.errors.ResumeFailed`.

All state changes happen in synchronous sections on the event loop; ``drain`` and
``resume`` are serialized by one lock so a registration can never race an
unregistration. ``stop`` does not wait for that lock: it must always be prompt.
"""

from __future__ import annotations

import asyncio
import logging
import time

from quiesce.admission import AdmissionGate, OutcomeCounts
from quiesce.budget import Clock, Deadline, check_seconds
from quiesce.discovery import Discovery, registration_state
from quiesce.drain import (
    DrainConfig,
    DrainReport,
    StageOutcome,
    StageReport,
    wait_admitted_zero,
    wait_quiescent,
    wait_router_quiet,
)
from quiesce.drain_cost import drain_cost
from quiesce.errors import InvalidTransition, ResumeFailed
from quiesce.lifecycle_state import (
    DrainRun,
    EventKind,
    LifecycleEvent,
    Listener,
    State,
    Status,
)
from quiesce.probe import DEFAULT_PROBE_TIMEOUT_S, PendingWork, QuiescenceProbe, observe

__all__ = ["DrainRun", "EventKind", "Lifecycle", "LifecycleEvent", "Listener", "State", "Status"]

log = logging.getLogger("quiesce.lifecycle")

class Lifecycle:
    """Owns the worker's state, its admission gate and its discovery registration."""

    def __init__(self, *, gate: AdmissionGate, probe: QuiescenceProbe, discovery: Discovery,
                 config: DrainConfig | None = None, clock: Clock = time.monotonic,
                 wall_clock: Clock = time.time) -> None:
        self.gate = gate
        self.probe = probe
        self.discovery = discovery
        self.config = config if config is not None else DrainConfig()
        self._clock = clock
        self._wall = wall_clock
        self._state = State.SERVING
        self._generation = 0
        self._since_wall = wall_clock()
        self._since = clock()
        self._last_error: str | None = None
        self._run: DrainRun | None = None
        self._last_report: DrainReport | None = None
        self._lock = asyncio.Lock()
        self._listeners: list[Listener] = []
        self._unregistering: set[asyncio.Task[None]] = set()
        self._left_serving = OutcomeCounts()
        """The gate's outcome totals when the worker last left serving: every drain run
        since counts its losses from here."""

    # -- listeners ----------------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` on every event (metrics, logs). It must be quick and not block;
        an exception it raises is logged and otherwise ignored."""
        self._listeners.append(listener)

    def _emit(self, kind: EventKind, report: DrainReport | None = None,
              pending_work: PendingWork | None = None) -> None:
        if not self._listeners:
            return
        event = LifecycleEvent(kind, self._state, self._generation, report, pending_work)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                log.exception("lifecycle listener %r failed", listener)

    # -- reading ------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def current_run(self) -> DrainRun | None:
        return self._run

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def status(self, pending_work: PendingWork | None = None) -> Status:
        """A consistent snapshot of the lifecycle (plus ``pending_work`` if the caller read it)."""
        run = self._run
        drain: dict[str, object] | None = None
        if run is not None and not run.task.done():
            elapsed = self._clock() - run.started_at
            drain = {
                "generation": run.generation,
                "stage": run.stage,
                "elapsed_s": round(elapsed, 6),
                "budget_s": run.budget_s,
                "budget_left_s": (None if run.budget_s is None
                                  else round(max(0.0, run.budget_s - elapsed), 6)),
                "trend": [[round(t, 3), n] for t, n in run.trend],
            }
        if pending_work is None and run is not None:
            pending_work = run.last_pending_work
        requests: dict[str, object] = {
            "admitted_total": self.gate.admitted_total,
            "refused_total": self.gate.refused_total,
            "ended_total": self.gate.outcomes().to_dict(),
            "ended_since_drain": (self.outcomes_since(run).to_dict()
                                  if run is not None else None),
        }
        registered, discovery_error = registration_state(self.discovery)
        return Status(
            state=self._state,
            generation=self._generation,
            inflight_requests=self.gate.inflight,
            accepting=self.gate.accepting,
            discovery_registered=registered,
            discovery_error=discovery_error,
            since=self._since_wall,
            seconds_in_state=self._clock() - self._since,
            last_error=self._last_error,
            pending_work=pending_work,
            drain=drain,
            last_drain=self._last_report,
            requests=requests,
            drain_cost=drain_cost(pending_work, self.gate.inflight),
        )

    def outcomes_since(self, run: DrainRun) -> OutcomeCounts:
        """How the admitted requests that ended since ``run`` began ended (up to now)."""
        return self.gate.outcomes() - run.outcomes_at_start

    async def read_status(self, probe_timeout: float = DEFAULT_PROBE_TIMEOUT_S) -> Status:
        """:meth:`status` with a fresh probe reading (never raises; failures show as unknown).

        While stopping, the engine is being shut down and may no longer answer: the probe
        is not read, and the status shows the last reading the drain took.
        """
        if self._state is State.STOPPING:
            return self.status()
        snapshot = await observe(self.probe, probe_timeout)
        self._emit(EventKind.PROBE_READ, pending_work=snapshot)
        return self.status(snapshot)

    # -- transitions --------------------------------------------------------------

    def _transition(self, state: State, why: str) -> None:
        previous = self._state
        self._state = state
        self._generation += 1
        self._since = self._clock()
        self._since_wall = self._wall()
        log.info("lifecycle %s -> %s (generation %d): %s", previous.value, state.value,
                 self._generation, why)
        self._emit(EventKind.TRANSITION)

    async def start(self) -> None:
        """Register with discovery and open admission: the worker is serving."""
        if self._state is State.STOPPING:
            raise InvalidTransition("start", self._state.value, "the worker is shutting down")
        self.gate.open()
        await self.discovery.register()

    async def drain(self, budget_s: float | None = None) -> DrainRun:
        """Start a drain run (detached) and return its handle.

        Idempotent: while a run is in progress, or once drained, returns the current
        run (its budget is kept). After a run that ended without ``drained`` (its budget
        ran out) a new call starts a fresh run. Raises :class:`InvalidTransition` while stopping and
        :class:`~quiesce.errors.ConfigError` for a bad budget, changing nothing.
        """
        check_seconds("budget_s", budget_s, allow_none=True)
        async with self._lock:
            if self._state is State.STOPPING:
                raise InvalidTransition("drain", self._state.value,
                                        "worker shutdown is already in progress")
            run = self._run
            if self._state is State.DRAINED and run is not None:
                return run
            if self._state is State.DRAINING and run is not None and not run.task.done():
                return run
            # serving, or draining after a run that ended without drained: a fresh run.
            # Losses count from when the worker left serving, across retried runs, so a
            # run that failed with a loss cannot be followed by one that hides it.
            if self._state is State.SERVING:
                why, self._left_serving = "drain requested", self.gate.outcomes()
            else:
                why = "drain retried"
            return self._start_run(budget_s if budget_s is not None else self.config.budget_s,
                                   why)

    def _start_run(self, budget_s: float | None, why: str) -> DrainRun:
        self._transition(State.DRAINING, why)
        self._last_error = None
        generation = self._generation
        deadline = Deadline.after(budget_s, self._clock)
        run = DrainRun(generation=generation, budget_s=budget_s, started_at=self._clock(),
                       outcomes_at_start=self._left_serving)
        run.task = asyncio.get_running_loop().create_task(
            self._drain_run(run, deadline), name=f"quiesce-drain-{generation}")
        # A run cancelled before its first step never reaches its own except clause.
        run.task.add_done_callback(lambda _: self._cancelled_run(run))
        self._run = run
        return run

    def _finish_run(self, run: DrainRun, drained: bool) -> DrainReport:
        """Record the end of ``run``: its report, ``last_drain``, the event, the error."""
        run.ended_at = self._clock()
        report = DrainReport(run.generation, tuple(run.stages), run.ended_at - run.started_at,
                             drained, run.last_pending_work, self.outcomes_since(run))
        run.report = report
        if self._run is run:
            self._last_report = report
        self._emit(EventKind.DRAIN_FINISHED, report=report)
        if report.outcome is StageOutcome.CANCELLED:
            log.info("drain generation %d cancelled in stage %s", run.generation, run.stage)
        elif not drained and self._generation == run.generation:
            self._last_error = "; ".join(
                f"{s.stage} {s.outcome.value}: {s.detail}" for s in run.stages
                if s.outcome not in (StageOutcome.COMPLETED, StageOutcome.SKIPPED))
            log.warning("drain generation %d ended without drained: %s", run.generation,
                        self._last_error)
        return report

    def _cancelled_run(self, run: DrainRun) -> None:
        if run.report is None:
            run.stages.append(StageReport(run.stage, StageOutcome.CANCELLED, 0.0,
                                          "drain run cancelled (resume or stop)"))
            self._finish_run(run, drained=False)

    async def _drain_run(self, run: DrainRun, deadline: Deadline) -> DrainReport:
        start = self._clock()
        stages = run.stages

        def stage(name: str) -> float:
            run.stage = name
            return self._clock()

        def finish(drained: bool) -> DrainReport:
            return self._finish_run(run, drained)

        try:
            # 1. unregister, so that routers stop picking this worker
            t = stage("unregister")
            was_registered = self.discovery.registered
            stages.append(await self._unregister(deadline, t))

            # 2. router grace: routers that already picked us are still sending
            t = stage("router_grace")
            grace = min(self.config.router_grace_s, deadline.remaining())
            if was_registered and (grace > 0 or self.config.router_quiet_s > 0):
                await asyncio.sleep(grace)
                quiet = await wait_router_quiet(self.gate, self.config.router_quiet_s,
                                                deadline, self._clock)
                stages.append(StageReport(
                    "router_grace", StageOutcome.COMPLETED, self._clock() - t,
                    f"then {quiet:.2f}s until {self.config.router_quiet_s:g}s without a "
                    "new request" if self.config.router_quiet_s > 0 else ""))
            else:
                stages.append(StageReport("router_grace", StageOutcome.SKIPPED, 0.0,
                                          "was not registered" if not was_registered
                                          else "no grace configured or no budget left"))

            # 3. close admission; from here on the in-flight count can only fall
            t = stage("close_admission")
            self.gate.close("draining")
            stages.append(StageReport("close_admission", StageOutcome.COMPLETED,
                                      self._clock() - t))

            # 4. admitted requests to zero
            stage("inflight")
            report = await wait_admitted_zero(self.gate, deadline, self._clock)
            stages.append(report)
            if report.outcome is not StageOutcome.COMPLETED:
                return finish(False)

            # 5. the engine's own signal to known-zero
            stage("engine")

            def progress(snapshot: PendingWork) -> None:
                run.last_pending_work = snapshot
                self._emit(EventKind.PROBE_READ, pending_work=snapshot)
                run.trend.append((self._clock() - start, snapshot.total))

            report, _ = await wait_quiescent(self.probe, deadline, self.config, progress,
                                             self._clock)
            stages.append(report)
            if report.outcome is not StageOutcome.COMPLETED:
                return finish(False)

            # 6. publish, only for our own generation (a resume may have superseded us)
            t = stage("publish")
            if self._generation != run.generation or self._state is not State.DRAINING:
                stages.append(StageReport("publish", StageOutcome.CANCELLED, 0.0,
                                          f"generation {run.generation} is stale"))
                return finish(False)
            if self.gate.inflight or self.gate.accepting:  # cannot happen: closed above
                stages.append(StageReport("publish", StageOutcome.FAILED, 0.0,
                                          "admission reopened within the same generation"))
                return finish(False)
            # every admitted request has ended (admitted == 0 above): a loss is final
            lost = self.outcomes_since(run).lost
            if lost:
                stages.append(StageReport("publish", StageOutcome.LOST, self._clock() - t,
                                          f"{lost} admitted request(s) lost during the drain"))
                return finish(False)
            self._transition(State.DRAINED, "admitted requests and engine work are zero")
            stages.append(StageReport("publish", StageOutcome.COMPLETED, self._clock() - t))
            return finish(True)
        except asyncio.CancelledError:
            self._cancelled_run(run)
            raise

    async def _unregister(self, deadline: Deadline, started: float) -> StageReport:
        # The unregistration runs as its own task and is never cancelled: even with no
        # budget left, or if this run is cancelled, routers must stop picking us.
        task = asyncio.get_running_loop().create_task(self.discovery.unregister())
        self._unregistering.add(task)
        task.add_done_callback(self._unregistering.discard)
        done, _ = await asyncio.wait({task}, timeout=deadline.remaining()
                                     if deadline.bounded else None)
        if not done:
            return StageReport("unregister", StageOutcome.TIMED_OUT, self._clock() - started,
                               "discovery did not confirm in time; still unregistering")
        try:
            task.result()
        except Exception as exc:
            # Keep draining: a worker that closes admission is safe even if routers
            # still list it (they get a retryable WorkerDraining).
            log.error("unregister failed, draining anyway: %s", exc)
            return StageReport("unregister", StageOutcome.FAILED, self._clock() - started,
                               f"{type(exc).__name__}: {exc}")
        return StageReport("unregister", StageOutcome.COMPLETED, self._clock() - started)

    async def _cancel_run(self) -> None:
        run = self._run
        if run is not None and not run.task.done():
            run.task.cancel()
            await asyncio.wait({run.task})

    async def resume(self) -> None:
        """Return to serving: cancel and join the drain run, open admission, re-register.

        Idempotent while serving. Raises :class:`InvalidTransition` while stopping and
        :class:`ResumeFailed` if registration fails or does not finish within
        ``config.registration_timeout_s`` (admission is closed again and a fresh drain
        started, so the worker never serves unregistered by accident).
        """
        async with self._lock:
            if self._state is State.STOPPING:
                raise InvalidTransition("resume", self._state.value,
                                        "worker shutdown is already in progress")
            if self._state is State.SERVING:
                return
            await self._cancel_run()
            if self._stopping():  # stop() ran while we joined the run
                raise InvalidTransition("resume", self._state.value,
                                        "worker shutdown started during resume")
            self._transition(State.SERVING, "resume requested")
            generation = self._generation
            self._last_error = None
            resumed_at = self.gate.outcomes()
            self.gate.open()  # admit before routers can see us again
            try:
                await self._register_bounded(
                    Deadline.after(self.config.registration_timeout_s, self._clock))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._generation != generation:  # stop() ran meanwhile; it closed the gate
                    raise ResumeFailed(f"registration failed during shutdown: {exc}") from exc
                self.gate.close("draining")
                message = (f"resume failed: discovery registration raised "
                           f"{type(exc).__name__}: {exc}")
                log.error("%s; closing admission and draining again", message)
                self._left_serving = resumed_at  # the brief serving window counts too
                self._start_run(self.config.budget_s, "resume rolled back")
                self._last_error = message
                raise ResumeFailed(message) from exc
            if self._generation != generation:  # stop() ran while we registered
                raise InvalidTransition("resume", self._state.value,
                                        "worker shutdown started during resume")

    async def _register_bounded(self, deadline: Deadline) -> None:
        """Register once any unregister still running has returned, within ``deadline``.

        Raises TimeoutError naming what discovery did not finish. A registration cut off
        here may still have reached discovery: the drain that the rollback starts
        unregisters first.
        """
        if self._unregistering:  # a late unregister must not undo this registration
            _, pending = await asyncio.wait(set(self._unregistering),
                                            timeout=deadline.remaining())
            if pending:
                raise TimeoutError(f"an earlier unregister still runs after "
                                   f"{self.config.registration_timeout_s:g}s")
        try:
            await asyncio.wait_for(self.discovery.register(), deadline.remaining())
        except asyncio.TimeoutError:  # not yet the builtin on Python 3.10
            raise TimeoutError(f"discovery did not confirm within "
                               f"{self.config.registration_timeout_s:g}s") from None

    def _stopping(self) -> bool:
        return self._state is State.STOPPING

    async def stop(self) -> None:
        """Enter the terminal ``stopping`` state: close admission and cancel any drain run.

        Idempotent. Does not unregister or wait for requests; the shutdown does that
        before calling it (see :mod:`quiesce.shutdown`).
        """
        if self._state is State.STOPPING:
            return
        self.gate.close("stopping")
        self._transition(State.STOPPING, "shutdown")
        await self._cancel_run()
