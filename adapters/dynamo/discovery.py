"""Discovery over Dynamo's served endpoint instances (:class:`DynamoDiscovery`).

``unregister()`` calls each endpoint's ``unregister_endpoint_instance()`` (routers and
``Client.instance_ids()`` drop the instance; about a millisecond with the ``file``
backend on loopback) and ``register()`` its ``register_endpoint_instance()``. Each call
is tried with a per-attempt timeout (``rpc_timeout_s``) and retried after a doubling
backoff (20 ms .. 0.5 s) within ``retry_budget_s`` or the caller's
:class:`~quiesce.budget.Deadline`, whichever is earlier. A "not found" answer to an
unregister counts as done (already gone, or never served). When the budget runs out it
raises :class:`~quiesce.discovery.DiscoveryUnavailable`; the state is then *unknown*:
``registered`` stays True (fail closed) and ``registration_error`` holds the reason
(:func:`quiesce.discovery.registration_state`). The runtime's own lease (etcd) or file
TTL still removes the instance if the process dies.

The endpoints are read when each call runs, not when the object is built: Dynamo's
components install their signal handlers with an empty ``shutdown_endpoints`` list and
fill it in place once the engine is up, so a signal during model load finds nothing to
unregister (and is not an error), and one after start finds every endpoint.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Protocol

from quiesce.budget import Deadline, check_seconds
from quiesce.discovery import describe_failure, retry_within
from quiesce.errors import ConfigError


class DynamoEndpoint(Protocol):
    """The two methods of ``dynamo.runtime.Endpoint`` that discovery uses."""

    async def unregister_endpoint_instance(self) -> None: ...

    async def register_endpoint_instance(self) -> None: ...


def _already_gone(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "could not find key" in text or "not found" in text


def _check_endpoints(items: Sequence[object]) -> list[DynamoEndpoint]:
    for item in items:
        if not (callable(getattr(item, "unregister_endpoint_instance", None))
                and callable(getattr(item, "register_endpoint_instance", None))):
            raise ConfigError("endpoints", f"{type(item).__name__} has no "
                              "register/unregister_endpoint_instance: pass "
                              "dynamo.runtime.Endpoint objects")
    return list(items)  # type: ignore[arg-type]  # checked above


class DynamoDiscovery:
    """:class:`~quiesce.discovery.Discovery` over served Dynamo endpoint instances.

    ``endpoints``: one endpoint, a tuple (fixed), or a list, which is read at each call
    (the component may fill it later; see the module docstring). ``registered`` is the
    state at construction: True when ``serve_endpoint`` registers the instances (its
    default), False to let ``Lifecycle.start()`` register them. Bad input raises
    :class:`ConfigError` and changes nothing.
    """

    def __init__(self, endpoints: DynamoEndpoint | Sequence[DynamoEndpoint], *,
                 registered: bool = True, rpc_timeout_s: float = 2.0,
                 retry_budget_s: float = 5.0) -> None:
        if isinstance(endpoints, list):
            self._live: list[DynamoEndpoint] | None = endpoints
            fixed: list[DynamoEndpoint] = []
            _check_endpoints(endpoints)
        else:
            self._live = None
            fixed = _check_endpoints(list(endpoints) if isinstance(endpoints, tuple)
                                     else [endpoints])
            if not fixed:
                raise ConfigError("endpoints", "needs at least one endpoint")
        if not isinstance(registered, bool):
            raise ConfigError("registered", f"must be a bool, got {registered!r}")
        check_seconds("rpc_timeout_s", rpc_timeout_s, allow_zero=False)
        check_seconds("retry_budget_s", retry_budget_s, allow_zero=False)
        self._fixed = fixed
        self._state: bool | None = registered
        self._error: str | None = None
        self._rpc_timeout_s = rpc_timeout_s
        self._retry_budget_s = retry_budget_s
        self._lock = asyncio.Lock()

    @property
    def endpoints(self) -> list[DynamoEndpoint]:
        """The endpoints as they are now (distinct objects, in order)."""
        items = _check_endpoints(self._live) if self._live is not None else self._fixed
        return list({id(item): item for item in items}.values())

    @property
    def registered(self) -> bool:
        return self._state is not False

    @property
    def registration_error(self) -> str | None:
        return self._error if self._state is None else None

    def served(self) -> None:
        """The component's ``serve_endpoint`` registered the instances itself."""
        self._state, self._error = True, None

    def _deadline(self, deadline: Deadline | None) -> Deadline:
        own = Deadline.after(self._retry_budget_s)
        return own if deadline is None or deadline.at > own.at else deadline

    async def register(self, deadline: Deadline | None = None) -> None:
        """Register every endpoint instance. Idempotent while registered. Raises
        :class:`DiscoveryUnavailable` (state unknown) when the budget runs out."""
        async with self._lock:
            if self._state is True:
                return
            limit = self._deadline(deadline)
            try:
                for endpoint in self.endpoints:
                    await retry_within("dynamo", "register",
                                       endpoint.register_endpoint_instance, limit,
                                       self._rpc_timeout_s)
            except BaseException as exc:
                self._state, self._error = None, describe_failure(exc)
                raise
            self._state, self._error = True, None

    async def unregister(self, deadline: Deadline | None = None) -> None:
        """Unregister every endpoint instance (none yet: nothing to do). Idempotent when
        unregistered. Raises :class:`DiscoveryUnavailable` (state unknown) when the budget
        runs out."""
        async with self._lock:
            if self._state is False:
                return
            limit = self._deadline(deadline)

            async def unregister_one(endpoint: DynamoEndpoint) -> None:
                try:
                    await endpoint.unregister_endpoint_instance()
                except Exception as exc:
                    if not _already_gone(exc):
                        raise

            try:
                for endpoint in self.endpoints:
                    await retry_within("dynamo", "unregister",
                                       functools.partial(unregister_one, endpoint), limit,
                                       self._rpc_timeout_s)
            except BaseException as exc:
                self._state, self._error = None, describe_failure(exc)
                raise
            self._state, self._error = False, None
