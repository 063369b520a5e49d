"""Discovery: how routers find this worker.

:class:`Discovery` is the protocol every backend implements (Dynamo's runtime,
etcd, the in-memory directory here). Both calls are idempotent: unregistering an
unregistered worker, or registering a registered one, succeeds and changes nothing.
An implementation raises on a real failure; the lifecycle records it.

Unregistering is not a barrier: routers learn about it later. That is why the drain
keeps admitting through a short router grace after it (see :mod:`quiesce.lifecycle`).

A remote backend (etcd, Dynamo) can also *not know*: a call that ran out of retries may
or may not have reached the store. Such a backend keeps ``registered`` True (fail
closed: routers may still list the worker) and additionally implements
:class:`ReportsRegistrationError`; :func:`registration_state` folds both into
``(registered or None for unknown, error)`` for status displays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Discovery(Protocol):
    @property
    def registered(self) -> bool: ...

    async def register(self) -> None: ...

    async def unregister(self) -> None: ...


@runtime_checkable
class ReportsRegistrationError(Protocol):
    """Optional extension of :class:`Discovery`: why the registration state is unknown."""

    @property
    def registration_error(self) -> str | None:
        """``None`` while the backend knows its state; else the last error, and the state
        is unknown (``registered`` then stays True: the worker may still be listed)."""
        ...


def registration_state(discovery: Discovery) -> tuple[bool | None, str | None]:
    """``(registered, error)``; ``registered`` is ``None`` (unknown) when the backend
    reports an error. Never raises; a backend without the extension always knows."""
    error = (discovery.registration_error
             if isinstance(discovery, ReportsRegistrationError) else None)
    if error is not None:
        return None, error
    return discovery.registered, None


Watcher = Callable[[str, bool], None]
"""Called with ``(instance_id, registered)`` on every change."""


class InMemoryDirectory:
    """A process-local service directory: a set of instance ids plus change watchers."""

    def __init__(self) -> None:
        self._instances: set[str] = set()
        self._watchers: list[Watcher] = []

    @property
    def instances(self) -> frozenset[str]:
        return frozenset(self._instances)

    def watch(self, watcher: Watcher) -> None:
        self._watchers.append(watcher)

    def _set(self, instance_id: str, registered: bool) -> None:
        if (instance_id in self._instances) == registered:
            return
        if registered:
            self._instances.add(instance_id)
        else:
            self._instances.discard(instance_id)
        for watcher in list(self._watchers):
            watcher(instance_id, registered)


class InMemoryDiscovery:
    """:class:`Discovery` for one instance in an :class:`InMemoryDirectory`."""

    def __init__(self, instance_id: str, directory: InMemoryDirectory | None = None) -> None:
        self.instance_id = instance_id
        self.directory = directory if directory is not None else InMemoryDirectory()

    @property
    def registered(self) -> bool:
        return self.instance_id in self.directory.instances

    async def register(self) -> None:
        self.directory._set(self.instance_id, True)

    async def unregister(self) -> None:
        self.directory._set(self.instance_id, False)
