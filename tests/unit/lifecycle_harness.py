"""The fakes and helpers of the :class:`quiesce.lifecycle.Lifecycle` unit tests
(``test_lifecycle_*.py``; their ``workers`` fixture is in ``conftest.py``).

The engine is replaced by :class:`ScriptedProbe`, a fake whose answers each test sets,
and discovery by :class:`ScriptedDiscovery`, an ``InMemoryDiscovery`` whose calls can
fail or block. Nothing asserts how long something took: every wait is on an event or
bounded by ``asyncio.wait_for`` (:data:`WAIT_S`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Literal

from quiesce import AdmissionGate, DrainConfig, InMemoryDiscovery, PendingWork, Role
from quiesce.drain import DrainReport
from quiesce.lifecycle import DrainRun, Lifecycle

WAIT_S = 5.0
"""Upper bound of every wait in these tests; a healthy run needs milliseconds."""

FAST = DrainConfig(router_grace_s=0.01, probe_timeout_s=0.05, poll_base_s=0.001,
                   poll_cap_s=0.004)

Mode = Literal["zero", "busy", "unknown", "raise", "hang"]


class ScriptedProbe:
    """A fake standing in for an engine probe (the real engines are covered by their
    adapters' tests).

    ``mode`` decides every answer: ``zero`` (known idle), ``busy`` (waiting=1,
    running=2), ``unknown`` (an UNKNOWN snapshot with a reason), ``raise`` (the read
    raises) or ``hang`` (the read never answers, so ``observe`` times it out).
    :meth:`block` makes reads wait for :meth:`unblock` before answering; a
    ``stubborn`` block also swallows cancellation (a probe that breaks its contract).
    """

    def __init__(self, mode: Mode = "zero", role: Role = Role.AGGREGATED) -> None:
        self._role = role
        self.mode: Mode = mode
        self.reads = 0
        self.cancels_ignored = 0
        self.blocked = asyncio.Event()
        self._release: asyncio.Event | None = None
        self._stubborn = False
        self._read = asyncio.Event()

    @property
    def role(self) -> Role:
        return self._role

    @property
    def source(self) -> str:
        return "scripted"

    def block(self, *, stubborn: bool = False) -> None:
        self._release = asyncio.Event()
        self._stubborn = stubborn

    def unblock(self) -> None:
        if self._release is not None:
            self._release.set()

    async def pending_work(self) -> PendingWork:
        self.reads += 1
        self._read.set()
        release = self._release
        if release is not None and not release.is_set():
            self.blocked.set()
            while not release.is_set():
                try:
                    await asyncio.shield(release.wait())
                except asyncio.CancelledError:
                    if not self._stubborn:
                        raise
                    self.cancels_ignored += 1
        if self.mode == "zero":
            return PendingWork.idle(self.role, self.source)
        if self.mode == "busy":
            return PendingWork(self.role, self.source, waiting=1, running=2, kv_sends_held=0,
                               kv_recvs_awaited=0)
        if self.mode == "unknown":
            return PendingWork.unknown(self.role, self.source, "metrics endpoint unavailable")
        if self.mode == "raise":
            raise RuntimeError("engine RPC failed")
        await asyncio.Event().wait()  # hang: never answers
        raise AssertionError("unreachable")

    async def is_quiescent(self) -> bool:
        return (await self.pending_work()).is_quiescent

    async def wait_reads(self, count: int) -> None:
        """Return once ``count`` reads have started in total."""

        async def reads() -> None:
            while self.reads < count:
                self._read.clear()
                await self._read.wait()

        await asyncio.wait_for(reads(), WAIT_S)


class ScriptedDiscovery(InMemoryDiscovery):
    """An in-memory discovery whose register/unregister can fail or block on an event."""

    def __init__(self) -> None:
        super().__init__("worker-0")
        self.fail_register: Exception | None = None
        self.fail_unregister: Exception | None = None
        self.register_gate: asyncio.Event | None = None
        self.unregister_gate: asyncio.Event | None = None
        self.register_entered = asyncio.Event()
        self.unregister_entered = asyncio.Event()
        self.register_calls = 0
        self.unregister_calls = 0

    async def register(self) -> None:
        self.register_calls += 1
        self.register_entered.set()
        if self.register_gate is not None:
            await self.register_gate.wait()
        if self.fail_register is not None:
            raise self.fail_register
        await super().register()

    async def unregister(self) -> None:
        self.unregister_calls += 1
        self.unregister_entered.set()
        if self.unregister_gate is not None:
            await self.unregister_gate.wait()
        if self.fail_unregister is not None:
            raise self.fail_unregister
        await super().unregister()


class WallClock:
    """A settable wall clock, so that ``since`` can be compared exactly."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Harness:
    lc: Lifecycle
    probe: ScriptedProbe
    discovery: ScriptedDiscovery
    gate: AdmissionGate
    wall: WallClock


class Workers:
    """Builds lifecycles for a test and stops every one of them afterwards."""

    def __init__(self) -> None:
        self.made: list[Harness] = []

    async def new(self, mode: Mode = "zero", *, config: DrainConfig = FAST,
                  start: bool = True) -> Harness:
        probe = ScriptedProbe(mode)
        discovery = ScriptedDiscovery()
        gate = AdmissionGate()
        wall = WallClock()
        lc = Lifecycle(gate=gate, probe=probe, discovery=discovery, config=config,
                       wall_clock=wall)
        if start:
            await lc.start()
        harness = Harness(lc, probe, discovery, gate, wall)
        self.made.append(harness)
        return harness

    async def close(self) -> None:
        for h in self.made:
            h.probe.unblock()
            for gate in (h.discovery.register_gate, h.discovery.unregister_gate):
                if gate is not None:
                    gate.set()
            await asyncio.wait_for(h.lc.stop(), WAIT_S)


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Wait (bounded) until ``predicate`` holds, checking once per millisecond."""

    async def poll() -> None:
        for _ in range(int(WAIT_S * 10_000)):
            if predicate():
                return
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), WAIT_S)
    assert predicate(), f"timed out waiting for {what}"


async def finished(run: DrainRun) -> DrainReport:
    """The run's report once it ended (fails if it does not end within WAIT_S)."""
    report = await run.wait(WAIT_S)
    assert report is not None, f"drain run ended cancelled or not within {WAIT_S}s"
    return report


def at_stage(lc: Lifecycle, stage: str, action: Callable[[], None]) -> None:
    """Call ``action`` on the first loop iteration in which the current run is in ``stage``.

    Checked once per iteration from a callback that re-queues itself, so it runs before
    any timer that the run armed in that stage (e.g. the end of the router grace).
    """
    loop = asyncio.get_running_loop()

    def check(tries: int) -> None:
        run = lc.current_run
        if run is not None and run.stage == stage:
            action()
        elif tries:
            loop.call_soon(check, tries - 1)

    loop.call_soon(check, 100_000)
