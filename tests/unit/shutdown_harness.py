"""The clock, fake engines and helpers of the budget and shutdown tests
(``test_shutdown_*.py``).

:class:`FakeClock` drives the budget arithmetic; :func:`make_lifecycle` and
:func:`admitted_stream` run the simulated engine behind a lifecycle's gate;
:class:`FailingAbortEngine` and :class:`HangingEngine` are engines whose abort fails or
hangs, and :func:`stuck_lifecycle` has one admitted request that never ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from quiesce import Admission, AdmissionGate, InMemoryDiscovery, StageOutcome
from quiesce.adapters.sim import SimEngine, SimProbe, SimRequest
from quiesce.admission import Outcome
from quiesce.drain import DrainConfig
from quiesce.lifecycle import Lifecycle, State
from quiesce.shutdown import Shutdown, ShutdownReport

FAST_DRAIN = DrainConfig(router_grace_s=0.0, poll_base_s=0.001, poll_cap_s=0.004,
                         probe_timeout_s=0.05)
SLACK_S = 0.3
"""Scheduling slack on top of a budget when checking that run() returned within it."""
OUTER_S = 10.0
"""Outer bound on every await, so a regression fails instead of hanging the suite."""


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_lifecycle(engine: SimEngine, config: DrainConfig = FAST_DRAIN,
                   gate: AdmissionGate | None = None) -> Lifecycle:
    return Lifecycle(gate=gate if gate is not None else AdmissionGate(accepting=False),
                     probe=SimProbe(engine), discovery=InMemoryDiscovery("worker-0"),
                     config=config)


async def admitted_stream(lifecycle: Lifecycle, engine: SimEngine, request: SimRequest,
                          out: list[int]) -> list[int]:
    """What a worker's request handler does: admit through the gate, then stream."""
    with lifecycle.gate.admit(request.request_id) as admission:
        async for token in engine.generate(request):
            out.append(token)
        admission.finish(Outcome.COMPLETED)
    return out


async def until(condition: Callable[[], bool], timeout: float = OUTER_S) -> None:
    async def poll() -> None:
        while not condition():  # noqa: ASYNC110 (the conditions here have no event to wait on)
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout)


def state_of(lifecycle: Lifecycle) -> State:
    """The state, read through a call so that mypy does not narrow it across awaits."""
    return lifecycle.state


def registered(lifecycle: Lifecycle) -> bool:
    return lifecycle.discovery.registered


def armed(shutdown: Shutdown) -> bool:
    return shutdown.requested


def stage_outcomes(report: ShutdownReport) -> list[tuple[str, StageOutcome]]:
    return [(s.stage, s.outcome) for s in report.stages]


CLEAN_STAGES = [
    ("drain", StageOutcome.COMPLETED),
    ("stop", StageOutcome.COMPLETED),
    ("abort", StageOutcome.SKIPPED),
    ("engine_shutdown", StageOutcome.COMPLETED),
    ("close", StageOutcome.SKIPPED),
]
"""The :func:`stage_outcomes` of a shutdown that drained: nothing to abort, no stream to cut."""


class FailingAbortEngine:
    """EngineControl whose abort_all raises; shutdown works."""

    def __init__(self) -> None:
        self.abort_calls = 0
        self.shutdown_calls = 0

    async def abort_all(self, reason: str) -> int:
        self.abort_calls += 1
        raise RuntimeError("abort exploded")

    async def shutdown(self) -> None:
        self.shutdown_calls += 1


class HangingEngine:
    """EngineControl whose abort_all and shutdown never return (until cancelled)."""

    def __init__(self) -> None:
        self.abort_cancelled = False
        self.shutdown_cancelled = False

    async def abort_all(self, reason: str) -> int:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.abort_cancelled = True
            raise
        return 0  # pragma: no cover

    async def shutdown(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.shutdown_cancelled = True
            raise


def stuck_lifecycle() -> tuple[Lifecycle, Admission]:
    """A started-looking lifecycle with one admitted request that never ends."""
    gate = AdmissionGate()
    admission = gate.admit("stuck")
    lifecycle = Lifecycle(gate=gate, probe=SimProbe(SimEngine()), discovery=InMemoryDiscovery("w"),
                          config=FAST_DRAIN)
    return lifecycle, admission
