"""The "unknown + error" extension of the Discovery protocol (core/discovery.py)."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from quiesce import AdmissionGate
from quiesce.adapters.sim import SimEngine, SimProbe
from quiesce.admin.metrics import WorkerMetrics
from quiesce.discovery import (
    Discovery,
    InMemoryDiscovery,
    ReportsRegistrationError,
    registration_state,
)
from quiesce.lifecycle import Lifecycle
from quiesce.ops.status_format import format_status


class FlakyBackend:
    """A discovery backend that can lose track of its state."""

    def __init__(self) -> None:
        self._registered = False
        self.error: str | None = None

    @property
    def registered(self) -> bool:
        return self._registered or self.error is not None

    @property
    def registration_error(self) -> str | None:
        return self.error

    async def register(self) -> None:
        self._registered = True

    async def unregister(self) -> None:
        self._registered = False


async def test_in_memory_discovery_always_knows_its_state() -> None:
    discovery = InMemoryDiscovery("a")
    assert not isinstance(discovery, ReportsRegistrationError)
    assert registration_state(discovery) == (False, None)
    await discovery.register()
    assert registration_state(discovery) == (True, None)


async def test_a_backend_with_an_error_reports_unknown_with_the_error() -> None:
    backend = FlakyBackend()
    assert isinstance(backend, Discovery) and isinstance(backend, ReportsRegistrationError)
    await backend.register()
    assert registration_state(backend) == (True, None)
    backend.error = "etcd unreachable"
    assert registration_state(backend) == (None, "etcd unreachable")
    await backend.unregister()
    assert backend.registered  # fail closed while unknown
    backend.error = None
    assert registration_state(backend) == (False, None)


async def test_status_metrics_and_the_cli_say_unknown_with_the_error() -> None:
    backend = FlakyBackend()
    lifecycle = Lifecycle(gate=AdmissionGate(), probe=SimProbe(SimEngine()), discovery=backend)
    await backend.register()
    backend.error = "etcd unreachable: 3 attempts in 0.4 s"
    status = lifecycle.status().to_dict()
    assert status["discovery_registered"] is None
    assert status["discovery_error"] == "etcd unreachable: 3 attempts in 0.4 s"
    assert "registration: unknown (etcd unreachable: 3 attempts in 0.4 s)" in " ".join(
        format_status(status).split())
    samples = {s.name: s.value for family in text_string_to_metric_families(
        WorkerMetrics(lifecycle).render()[0].decode()) for s in family.samples}
    assert math.isnan(samples["quiesce_discovery_registered"])
    backend.error = None
    assert lifecycle.status().to_dict()["discovery_registered"] is True
