"""The simulated engine's probe, and the ``sim`` entry of the adapter registry.

:class:`SimProbe` reads a :class:`~.engine.SimEngine`'s counters directly: O(1), no
await, no mutation, and it notifies the drain on every change (``wait_for_change``).
"""

from __future__ import annotations

from quiesce.errors import ConfigError
from quiesce.probe import PendingWork, Probe, Role

from .engine import SimEngine

SOURCE = "sim.engine"


class SimProbe(Probe):
    """Reads a :class:`SimEngine`'s counters: exact, O(1), and change-notifying."""

    def __init__(self, engine: SimEngine, role: Role | str = Role.AGGREGATED) -> None:
        super().__init__(role, SOURCE)
        self.engine = engine

    def snapshot(self) -> PendingWork:
        engine = self.engine
        if engine.stopped:
            return PendingWork.unknown(self.role, self.source,
                                       f"engine {engine.name} is stopped")
        waiting, running, held, awaiting = engine.counts()
        return PendingWork(role=self.role, source=self.source, waiting=waiting, running=running,
                           kv_sends_held=held, kv_recvs_awaited=awaiting,
                           engine_has_work=engine.has_work,
                           details={"estimated_drain_s": round(engine.estimated_drain_s(), 6)},
                           eta=engine.drain_eta())

    async def pending_work(self) -> PendingWork:
        return self.snapshot()

    async def wait_for_change(self, after: PendingWork, timeout: float) -> None:
        if not self.snapshot().same_work(after):
            return
        await self.engine.wait_for_change(timeout)


def probe_factory(engine: object, *, role: Role | str = Role.AGGREGATED) -> SimProbe:
    """Registry entry point ``sim``: a :class:`SimProbe` for a :class:`SimEngine`."""
    if not isinstance(engine, SimEngine):
        raise ConfigError("engine",
                          f"the sim adapter needs a SimEngine, got {type(engine).__name__}")
    return SimProbe(engine, role)
