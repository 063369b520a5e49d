"""Adapter registry: find the probe factory for an engine by name.

Factories come from two places: :func:`register_adapter` calls, and the entry-point
group ``quiesce.adapters`` of installed distributions (loaded lazily, on the first
lookup of a name that is not registered yet). A worker backend then asks::

    probe = probe_for("vllm", engine, role="prefill")

A factory is called as ``factory(engine, role=Role, **options)`` and returns a
:class:`~quiesce.probe.QuiescenceProbe`. Importing a factory never imports its engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from quiesce.errors import AdapterNotFound, ConfigError
from quiesce.probe import QuiescenceProbe, Role

ENTRY_POINT_GROUP = "quiesce.adapters"

ProbeFactory = Callable[..., QuiescenceProbe]

log = logging.getLogger("quiesce.registry")
_factories: dict[str, ProbeFactory] = {}


def register_adapter(name: str, factory: ProbeFactory, *, replace: bool = False) -> None:
    """Register ``factory`` under ``name``; a second registration needs ``replace=True``."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError("name", f"an adapter name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise ConfigError("factory", f"must be callable, got {factory!r}")
    if name in _factories and not replace and _factories[name] is not factory:
        raise ConfigError("name", f"adapter {name!r} is already registered; pass replace=True")
    _factories[name] = factory


def unregister_adapter(name: str) -> None:
    """Forget ``name`` (no error if it was not registered)."""
    _factories.pop(name, None)


def _entry_point_names() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_adapters() -> list[str]:
    """Every adapter name that :func:`probe_for` can resolve, sorted."""
    return sorted(set(_factories) | set(_entry_point_names()))


def get_factory(name: str) -> ProbeFactory:
    """The factory registered or advertised under ``name``; :class:`AdapterNotFound` if none."""
    if name in _factories:
        return _factories[name]
    entry = _entry_point_names().get(name)
    if entry is None:
        raise AdapterNotFound(
            f"no quiesce adapter named {name!r}; available: {', '.join(available_adapters())}")
    factory: ProbeFactory = entry.load()
    register_adapter(name, factory, replace=True)
    log.debug("loaded adapter %r from entry point %s", name, entry.value)
    return factory


def probe_for(name: str, engine: object, *, role: Role | str = Role.AGGREGATED,
              **options: Any) -> QuiescenceProbe:
    """Build the probe of adapter ``name`` for ``engine`` in ``role``."""
    return get_factory(name)(engine, role=Role.parse(role), **options)
