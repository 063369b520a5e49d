"""Shutdown on one budget: what a worker does between SIGTERM and exit.

The first SIGTERM or SIGINT arms one absolute :class:`~quiesce.budget.Budget`
(``total_s``, e.g. the pod's grace period minus a margin). Then, in order:

1. drain: the lifecycle's drain run (unregister, router grace, close admission,
   admitted → 0, probe quiescent), given ``min(drain_cap_s, time left − reserve)``;
   the probe is read here, before the engine is told anything;
2. stop: enter the terminal ``stopping`` state (admission stays closed);
3. abort: only if the drain did not finish — abort what is left through the engine
   adapter and count it;
4. engine shutdown, inside the cleanup reserve: first the engine's processes get back
   their own signal handlers (:meth:`SignalOwnership.permit_shutdown`), then the
   engine is told to stop;
5. close: wait (inside the reserve) for the streams still admitted to end, then close
   the serving listeners, which cuts any stream left (counted ``lost``);
6. account: how every request admitted since the drain run began ended.

``drained`` in the report, and exit code :data:`EXIT_CLEAN`, only when the drain
finished and no admitted request ended ``lost``. A drain that did not finish is
:data:`EXIT_FORCED`; one that finished with losses (an engine that aborted requests by
itself, a dead engine) is :data:`EXIT_LOST`. A second signal exits at once with
:data:`EXIT_IMMEDIATE`, taking the engine's processes with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from types import FrameType

from quiesce.admission import OutcomeCounts
from quiesce.budget import Budget, Clock, Deadline, check_seconds
from quiesce.drain import StageOutcome, StageReport, wait_admitted_zero
from quiesce.engine import EngineControl
from quiesce.errors import ConfigError
from quiesce.lifecycle import Lifecycle
from quiesce.signal_guard import SignalOwnership, kill_descendants

log = logging.getLogger("quiesce.shutdown")

EXIT_CLEAN = 0
"""Drained: every admitted request and KV transfer finished before exit."""
EXIT_FORCED = 3
"""The drain did not finish within the budget: leftovers were aborted (counted as lost)."""
EXIT_IMMEDIATE = 4
"""A second signal arrived: exited at once without finishing the shutdown."""
EXIT_LOST = 5
"""The drain finished, but admitted requests were lost on the way (count in the report)."""

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclasses.dataclass(frozen=True)
class ShutdownPolicy:
    """The budget of a shutdown. Invalid values raise :class:`ConfigError` naming the field.

    ``total_s``: from the first signal to exit. ``cleanup_reserve_s``: kept back for
    aborting and stopping the engine. ``drain_cap_s``: an optional cap on the drain
    stage (it otherwise gets everything but the reserve).
    """

    total_s: float = 30.0
    cleanup_reserve_s: float = 5.0
    drain_cap_s: float | None = None

    def __post_init__(self) -> None:
        check_seconds("total_s", self.total_s, allow_zero=False)
        check_seconds("cleanup_reserve_s", self.cleanup_reserve_s)
        check_seconds("drain_cap_s", self.drain_cap_s, allow_none=True)
        if self.cleanup_reserve_s >= self.total_s:
            raise ConfigError("cleanup_reserve_s", f"{self.cleanup_reserve_s}s must be smaller "
                              f"than total_s={self.total_s}s")


@dataclasses.dataclass(frozen=True)
class ShutdownReport:
    """How the shutdown went. ``outcome`` is ``drained``, ``forced`` or ``lost`` (see the
    module docstring); ``requests`` counts how the requests admitted since the drain run
    began ended, so ``requests.lost`` is every loss, aborted ones included."""

    signal: str
    stages: tuple[StageReport, ...]
    drained: bool
    aborted_requests: int
    elapsed_s: float
    exit_code: int
    outcome: str = "drained"
    requests: OutcomeCounts = dataclasses.field(default_factory=OutcomeCounts)

    @property
    def lost_requests(self) -> int:
        return self.requests.lost

    def to_dict(self) -> dict[str, object]:
        return {"signal": self.signal, "outcome": self.outcome, "drained": self.drained,
                "lost_requests": self.lost_requests, "aborted_requests": self.aborted_requests,
                "requests": self.requests.to_dict(), "elapsed_s": round(self.elapsed_s, 6),
                "exit_code": self.exit_code, "stages": [s.to_dict() for s in self.stages]}


Close = Callable[[], Awaitable[None]]
"""Closes the serving listeners (stage 5); streams still open are cut."""


class Shutdown:
    """Runs the budgeted shutdown of one worker. See the module docstring for the stages.

    ``signals``: the worker's :class:`SignalOwnership`, if it claimed one: the engine's
    processes get their handlers back only at stage 4, and a forced exit kills them.
    """

    def __init__(self, lifecycle: Lifecycle, engine: EngineControl | None,
                 policy: ShutdownPolicy | None = None, clock: Clock = time.monotonic,
                 signals: SignalOwnership | None = None) -> None:
        self.lifecycle = lifecycle
        self.engine = engine
        self.policy = policy if policy is not None else ShutdownPolicy()
        self.signals = signals
        self._clock = clock
        self._requested: asyncio.Event | None = None
        self._budget: Budget | None = None
        self._signal = ""
        self._signal_seen = False
        self._outcomes_at_request = OutcomeCounts()

    @property
    def requested(self) -> bool:
        return self._budget is not None

    def _event(self) -> asyncio.Event:
        if self._requested is None:
            self._requested = asyncio.Event()
        return self._requested

    def install_signal_handlers(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Handle SIGTERM and SIGINT on ``loop``: the first starts the shutdown."""
        loop = loop if loop is not None else asyncio.get_running_loop()
        self._event()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_first_signal, sig, loop)

    def on_signal(self, sig: signal.Signals,
                  loop: asyncio.AbstractEventLoop | None = None) -> None:
        """A SIGTERM/SIGINT arrived (also one kept from before the handlers were installed):
        start the shutdown; from now on the next signal exits at once."""
        self._on_first_signal(sig, loop if loop is not None else asyncio.get_running_loop())

    def _on_first_signal(self, sig: signal.Signals, loop: asyncio.AbstractEventLoop) -> None:
        # Two signals read in one batch queue two callbacks: the second one is a second signal.
        if self._signal_seen:
            exit_immediately(sig, None)
        self._signal_seen = True
        # From now on any further signal exits at once, even if the loop is busy:
        # a plain handler runs between bytecodes, not when the loop gets to it.
        for other in SIGNALS:
            loop.remove_signal_handler(other)
            signal.signal(other, exit_immediately)
        self.request(sig.name)

    def request(self, reason: str = "request") -> None:
        """Start the shutdown (arm the budget). Later calls change nothing."""
        if self._budget is not None:
            return
        self._budget = Budget(self.policy.total_s, self.policy.cleanup_reserve_s, self._clock)
        self._signal = reason
        self._outcomes_at_request = self.lifecycle.gate.outcomes()
        log.info("shutdown requested by %s: budget %.1fs (cleanup reserve %.1fs)", reason,
                 self.policy.total_s, self.policy.cleanup_reserve_s)
        if self.signals is not None:
            guards = self.signals.report()
            if guards.protected is not True:
                log.warning("signal guard: %s; a signal to the process group or to every "
                            "process reaches them as their own shutdown", guards.summary())
        self._event().set()

    async def wait_requested(self) -> None:
        await self._event().wait()

    async def run(self, close: Close | None = None) -> ShutdownReport:
        """Run every stage within the budget and return the report (with the exit code).

        ``close`` closes the serving listeners (stage 5); without it the caller must
        close them, and streams it cuts then are not in the report.
        """
        if self._budget is None:
            self.request("run")
        budget = self._budget
        assert budget is not None
        stages: list[StageReport] = []
        since = self._outcomes_at_request

        # 1. drain: the probe is read here, before the engine is told to stop
        t = self._clock()
        allowance = budget.allowance(self.policy.drain_cap_s)
        drained = False
        drain_outcome = StageOutcome.FAILED
        try:
            run = await self.lifecycle.drain(budget_s=allowance)
            # an admin drain (preStop) may have left serving earlier than the signal came
            since = min(run.outcomes_at_start, since, key=lambda counts: counts.ended)
            report = await run.wait(timeout=allowance)
            drained = report is not None and report.drained
            if drained:
                drain_outcome = StageOutcome.COMPLETED
                stages.append(StageReport("drain", drain_outcome, self._clock() - t))
            else:
                drain_outcome = (report.outcome if report is not None
                                 else StageOutcome.TIMED_OUT)
                detail = report.outcome.value if report is not None else "still running"
                stages.append(StageReport(
                    "drain", StageOutcome.LOST if drain_outcome is StageOutcome.LOST
                    else StageOutcome.TIMED_OUT, self._clock() - t,
                    f"{detail}: {self.lifecycle.last_error or ''}".strip()))
        except Exception as exc:
            log.error("drain stage failed: %s", exc)
            stages.append(StageReport("drain", StageOutcome.FAILED, self._clock() - t,
                                      f"{type(exc).__name__}: {exc}"))

        # 2. stop: terminal state, admission closed, any drain run cancelled
        t = self._clock()
        await self.lifecycle.stop()
        stages.append(StageReport("stop", StageOutcome.COMPLETED, self._clock() - t))

        # 3. abort leftovers, only when the drain did not finish
        aborted = 0
        if drained:
            stages.append(StageReport("abort", StageOutcome.SKIPPED, 0.0, "drained"))
        else:
            abort_report, aborted = await self._abort(budget)
            stages.append(abort_report)

        # 4. hand the engine's processes their signals back, then stop the engine
        if self.signals is not None:
            self.signals.permit_shutdown()
        # 5. meanwhile, let the streams still admitted end, then close the listeners
        #    (admission is closed and leftovers were aborted: neither waits on the other)
        stages.extend(await asyncio.gather(self._engine_shutdown(budget),
                                           self._close(budget, close)))

        # 6. account for every request admitted since the drain began; a stream still
        #    open now is cut when the process exits: lost
        requests = self.lifecycle.gate.outcomes() - since
        if self.lifecycle.gate.inflight:
            requests = dataclasses.replace(
                requests, lost=requests.lost + self.lifecycle.gate.inflight)
        clean = drained and requests.lost == 0
        if clean:
            outcome, code = "drained", EXIT_CLEAN
        elif drain_outcome in (StageOutcome.LOST, StageOutcome.COMPLETED):
            outcome, code = "lost", EXIT_LOST
        else:
            outcome, code = "forced", EXIT_FORCED
        result = ShutdownReport(self._signal, tuple(stages), clean, aborted, budget.elapsed(),
                                code, outcome, requests)
        log.log(logging.INFO if clean else logging.WARNING,
                "shutdown %s in %.3fs: %d request(s) completed, %d lost (%d aborted), "
                "%d client(s) gone, %d rejected; exit code %d", outcome, result.elapsed_s,
                requests.completed, requests.lost, aborted, requests.client_gone,
                requests.rejected, code)
        return result

    async def _close(self, budget: Budget, close: Close | None) -> StageReport:
        t = self._clock()
        gate = self.lifecycle.gate
        reserve = Deadline.after(
            max(min(budget.cleanup_allowance(), self.policy.cleanup_reserve_s), 0.0), self._clock)
        waited = await wait_admitted_zero(gate, reserve, self._clock)
        cut = gate.inflight
        if close is not None:
            try:
                await asyncio.wait_for(close(), max(budget.cleanup_allowance(), 0.001))
            except asyncio.TimeoutError:
                return StageReport("close", StageOutcome.TIMED_OUT, self._clock() - t,
                                   f"{cut} stream(s) still open")
            except Exception as exc:
                return StageReport("close", StageOutcome.FAILED, self._clock() - t,
                                   f"{type(exc).__name__}: {exc}")
        if waited.outcome is not StageOutcome.COMPLETED:
            return StageReport("close", StageOutcome.TIMED_OUT, self._clock() - t,
                               f"{cut} stream(s) cut when the listeners closed"
                               if close is not None else f"{cut} stream(s) still open")
        return StageReport("close", StageOutcome.COMPLETED if close is not None
                           else StageOutcome.SKIPPED, self._clock() - t,
                           "" if close is not None else "no listeners to close")

    async def _abort(self, budget: Budget) -> tuple[StageReport, int]:
        t = self._clock()
        if self.engine is None:
            return StageReport("abort", StageOutcome.UNSUPPORTED, 0.0, "no engine control"), 0
        try:
            count = await asyncio.wait_for(self.engine.abort_all("shutdown budget exhausted"),
                                           max(budget.cleanup_allowance(), 0.001))
        except asyncio.TimeoutError:
            return StageReport("abort", StageOutcome.TIMED_OUT, self._clock() - t), 0
        except Exception as exc:
            return StageReport("abort", StageOutcome.FAILED, self._clock() - t,
                               f"{type(exc).__name__}: {exc}"), 0
        log.warning("aborted %d request(s) left after the drain budget", count)
        return StageReport("abort", StageOutcome.COMPLETED, self._clock() - t,
                           f"{count} aborted"), count

    async def _engine_shutdown(self, budget: Budget) -> StageReport:
        t = self._clock()
        if self.engine is None:
            return StageReport("engine_shutdown", StageOutcome.SKIPPED, 0.0, "no engine control")
        try:
            await asyncio.wait_for(self.engine.shutdown(), max(budget.cleanup_allowance(), 0.001))
        except asyncio.TimeoutError:
            return StageReport("engine_shutdown", StageOutcome.TIMED_OUT, self._clock() - t)
        except Exception as exc:
            return StageReport("engine_shutdown", StageOutcome.FAILED, self._clock() - t,
                               f"{type(exc).__name__}: {exc}")
        return StageReport("engine_shutdown", StageOutcome.COMPLETED, self._clock() - t)


def exit_immediately(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    os.write(sys.stderr.fileno(),
             f"quiesce: second signal ({name}); exiting now with code {EXIT_IMMEDIATE}, "
             f"killing the engine's processes\n".encode())
    # The engine's processes ignore signals until permitted: take them along.
    kill_descendants()
    os._exit(EXIT_IMMEDIATE)
