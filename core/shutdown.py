"""Shutdown on one budget: what a worker does between SIGTERM and exit.

The first SIGTERM or SIGINT arms one absolute :class:`~quiesce.budget.Budget`
(``total_s``, e.g. the pod's grace period minus a margin). Then, in order:

1. drain: the lifecycle's drain run (unregister, router grace, close admission,
   admitted → 0, probe quiescent), given ``min(drain_cap_s, time left − reserve)``;
   the probe is read here, before the engine is told anything;
2. stop: enter the terminal ``stopping`` state (admission stays closed);
3. abort: only if the drain did not finish — abort what is left through the engine
   adapter and count it;
4. engine shutdown: inside the cleanup reserve.

A second signal exits at once with :data:`EXIT_IMMEDIATE`. The exit code tells a
clean drain (:data:`EXIT_CLEAN`) from a forced one (:data:`EXIT_FORCED`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from types import FrameType

from quiesce.budget import Budget, Clock, check_seconds
from quiesce.drain import StageOutcome, StageReport
from quiesce.engine import EngineControl
from quiesce.errors import ConfigError
from quiesce.lifecycle import Lifecycle

log = logging.getLogger("quiesce.shutdown")

EXIT_CLEAN = 0
"""Drained: every admitted request and KV transfer finished before exit."""
EXIT_FORCED = 3
"""The budget ran out: leftovers were aborted (their count is in the report)."""
EXIT_IMMEDIATE = 4
"""A second signal arrived: exited at once without finishing the shutdown."""

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
    signal: str
    stages: tuple[StageReport, ...]
    drained: bool
    aborted_requests: int
    elapsed_s: float
    exit_code: int

    def to_dict(self) -> dict[str, object]:
        return {"signal": self.signal, "drained": self.drained,
                "aborted_requests": self.aborted_requests, "elapsed_s": round(self.elapsed_s, 6),
                "exit_code": self.exit_code, "stages": [s.to_dict() for s in self.stages]}


class Shutdown:
    """Runs the budgeted shutdown of one worker. See the module docstring for the stages."""

    def __init__(self, lifecycle: Lifecycle, engine: EngineControl | None,
                 policy: ShutdownPolicy | None = None, clock: Clock = time.monotonic) -> None:
        self.lifecycle = lifecycle
        self.engine = engine
        self.policy = policy if policy is not None else ShutdownPolicy()
        self._clock = clock
        self._requested: asyncio.Event | None = None
        self._budget: Budget | None = None
        self._signal = ""
        self._signal_seen = False

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

    def _on_first_signal(self, sig: signal.Signals, loop: asyncio.AbstractEventLoop) -> None:
        # Two signals read in one batch queue two callbacks: the second one is a second signal.
        if self._signal_seen:
            _exit_immediately(sig, None)
        self._signal_seen = True
        # From now on any further signal exits at once, even if the loop is busy:
        # a plain handler runs between bytecodes, not when the loop gets to it.
        for other in SIGNALS:
            loop.remove_signal_handler(other)
            signal.signal(other, _exit_immediately)
        self.request(sig.name)

    def request(self, reason: str = "request") -> None:
        """Start the shutdown (arm the budget). Later calls change nothing."""
        if self._budget is not None:
            return
        self._budget = Budget(self.policy.total_s, self.policy.cleanup_reserve_s, self._clock)
        self._signal = reason
        log.info("shutdown requested by %s: budget %.1fs (cleanup reserve %.1fs)", reason,
                 self.policy.total_s, self.policy.cleanup_reserve_s)
        self._event().set()

    async def wait_requested(self) -> None:
        await self._event().wait()

    async def run(self) -> ShutdownReport:
        """Run every stage within the budget and return the report (with the exit code)."""
        if self._budget is None:
            self.request("run")
        budget = self._budget
        assert budget is not None
        stages: list[StageReport] = []

        # 1. drain: the probe is read here, before the engine is told to stop
        t = self._clock()
        allowance = budget.allowance(self.policy.drain_cap_s)
        drained = False
        try:
            run = await self.lifecycle.drain(budget_s=allowance)
            report = await run.wait(timeout=allowance)
            drained = report is not None and report.drained
            if drained:
                stages.append(StageReport("drain", StageOutcome.COMPLETED, self._clock() - t))
            else:
                detail = report.outcome.value if report is not None else "still running"
                stages.append(StageReport("drain", StageOutcome.TIMED_OUT, self._clock() - t,
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

        # 4. stop the engine inside what is left
        stages.append(await self._engine_shutdown(budget))

        code = EXIT_CLEAN if drained else EXIT_FORCED
        result = ShutdownReport(self._signal, tuple(stages), drained, aborted, budget.elapsed(),
                                code)
        log.log(logging.INFO if drained else logging.WARNING,
                "shutdown %s in %.3fs: aborted %d request(s), exit code %d",
                "clean" if drained else "forced", result.elapsed_s, aborted, code)
        return result

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


def _exit_immediately(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    os.write(sys.stderr.fileno(),
             f"quiesce: second signal ({name}); exiting now with code {EXIT_IMMEDIATE}\n".encode())
    os._exit(EXIT_IMMEDIATE)
