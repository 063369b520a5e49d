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

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar, runtime_checkable

from quiesce.budget import Deadline
from quiesce.errors import QuiesceError

log = logging.getLogger("quiesce.discovery")
T = TypeVar("T")


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


class DiscoveryUnavailable(QuiesceError):
    """A discovery backend did not confirm an operation within its budget; the
    registration state is unknown. ``attempts`` says how often it was tried."""

    def __init__(self, backend: str, operation: str, attempts: int, elapsed_s: float,
                 cause: str) -> None:
        super().__init__(f"{backend} {operation} not confirmed after {attempts} attempt(s) "
                         f"in {elapsed_s:.3f}s: {cause}")
        self.backend = backend
        self.operation = operation
        self.attempts = attempts


BACKOFF_FIRST_S = 0.02
BACKOFF_MAX_S = 0.5


def describe_failure(exc: BaseException) -> str:
    """One line for an attempt's failure (a timeout says so)."""
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "call timed out"
    return f"{type(exc).__name__}: {exc}"


async def retry_within(backend: str, operation: str, attempt: Callable[[], Awaitable[T]],
                       deadline: Deadline, rpc_timeout_s: float, *,
                       retryable: Callable[[BaseException], bool] = lambda _: True) -> T:
    """Run ``attempt()`` until it succeeds or ``deadline`` passes, for a remote backend.

    Each attempt is bounded by ``rpc_timeout_s`` and the time left; between attempts a
    backoff doubles from :data:`BACKOFF_FIRST_S` to :data:`BACKOFF_MAX_S` (never past
    the deadline). Raises :class:`DiscoveryUnavailable` when the budget is spent, or at
    once (chained) for an error ``retryable`` refuses.
    """
    started = time.monotonic()
    delay = BACKOFF_FIRST_S
    attempts = 0
    last = "no attempt fitted in the budget"
    while (left := deadline.remaining()) > 0:
        attempts += 1
        try:
            return await asyncio.wait_for(attempt(), min(rpc_timeout_s, left))
        except Exception as exc:
            last = describe_failure(exc)
            if not retryable(exc):
                raise DiscoveryUnavailable(backend, operation, attempts,
                                           time.monotonic() - started, last) from exc
            log.debug("%s %s attempt %d failed: %s", backend, operation, attempts, last)
        left = deadline.remaining()
        if left <= 0:
            break
        await asyncio.sleep(min(delay, left))
        delay = min(delay * 2, BACKOFF_MAX_S)
    raise DiscoveryUnavailable(backend, operation, attempts, time.monotonic() - started, last)


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
