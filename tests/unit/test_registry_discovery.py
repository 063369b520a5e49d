"""Adapter registry (explicit and entry points) and the in-memory discovery."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from quiesce import AdapterNotFound, ConfigError, InMemoryDirectory, InMemoryDiscovery, Role
from quiesce.adapters.sim import SimEngine, SimProbe
from quiesce.registry import (
    available_adapters,
    get_factory,
    probe_for,
    register_adapter,
    unregister_adapter,
)
from tests.unit.test_probe import FakeProbe


@pytest.fixture
def custom() -> Iterator[str]:
    name = "test-custom"
    yield name
    unregister_adapter(name)


def test_sim_adapter_comes_from_the_entry_point() -> None:
    assert "sim" in available_adapters()
    factory = get_factory("sim")
    assert factory.__module__ == "quiesce.adapters.sim.probe"


async def test_probe_for_builds_the_sim_probe_in_the_requested_role() -> None:
    engine = SimEngine()
    probe = probe_for("sim", engine, role="prefill")
    assert isinstance(probe, SimProbe)
    assert probe.role is Role.PREFILL
    assert await probe.is_quiescent()


def test_probe_for_rejects_the_wrong_engine_and_role() -> None:
    with pytest.raises(ConfigError) as info:
        probe_for("sim", object())
    assert info.value.field == "engine"
    with pytest.raises(ConfigError) as info:
        probe_for("sim", SimEngine(), role="leader")
    assert info.value.field == "role"


def test_unknown_adapter_lists_the_available_ones() -> None:
    with pytest.raises(AdapterNotFound) as info:
        probe_for("no-such-engine", object())
    assert "sim" in str(info.value)


def test_register_adapter_and_duplicate_protection(custom: str) -> None:
    def factory(engine: object, *, role: Role) -> FakeProbe:
        return FakeProbe(role)

    def other(engine: object, *, role: Role) -> FakeProbe:
        return FakeProbe(role, source="other")

    register_adapter(custom, factory)
    register_adapter(custom, factory)  # same factory again: fine
    assert custom in available_adapters()
    assert probe_for(custom, None, role=Role.DECODE).role is Role.DECODE
    with pytest.raises(ConfigError):
        register_adapter(custom, other)
    register_adapter(custom, other, replace=True)
    assert probe_for(custom, None).source == "other"


@pytest.mark.parametrize("name,factory", [("", lambda e, role: None), ("x", "not callable")])
def test_register_adapter_rejects_bad_input(name: str, factory: object) -> None:
    with pytest.raises(ConfigError):
        register_adapter(name, factory)  # type: ignore[arg-type]
    assert name not in available_adapters() or name == "sim"


async def test_in_memory_discovery_is_idempotent_and_notifies_changes() -> None:
    directory = InMemoryDirectory()
    events: list[tuple[str, bool]] = []
    directory.watch(lambda name, registered: events.append((name, registered)))
    a = InMemoryDiscovery("a", directory)
    assert not a.registered
    await a.register()
    await a.register()
    assert a.registered
    assert directory.instances == {"a"}
    await a.unregister()
    await a.unregister()
    assert not a.registered
    assert events == [("a", True), ("a", False)]
