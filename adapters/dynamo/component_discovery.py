"""Discovery of a Dynamo worker component: its model card, then its endpoint instances."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from quiesce.budget import Deadline
from quiesce.discovery import DiscoveryUnavailable, describe_failure

from .component import DynamoComponent
from .discovery import DynamoDiscovery


class ComponentDiscovery:
    """:class:`~quiesce.discovery.Discovery` of a Dynamo worker component: its model card
    and its endpoint instances (:class:`~.discovery.DynamoDiscovery`), unregistered in that
    order (the frontend stops routing by the card) and registered in the reverse.

    Before the worker registered its model there is no card: only the instances count.
    A failure leaves the state unknown (``registered`` stays True), with the reason.
    """

    def __init__(self, component: DynamoComponent, instances: DynamoDiscovery,
                 rpc_timeout_s: float = 5.0) -> None:
        self.component = component
        self.instances = instances
        self._rpc_timeout_s = rpc_timeout_s
        self._error: str | None = None

    @property
    def registered(self) -> bool:
        return self._error is not None or self.instances.registered

    @property
    def registration_error(self) -> str | None:
        return self._error or self.instances.registration_error

    def served(self) -> None:
        self._error = None
        self.instances.served()

    async def _bounded(self, what: str, call: Callable[[], Awaitable[None]],
                       deadline: Deadline | None) -> None:
        timeout = self._rpc_timeout_s if deadline is None else min(
            self._rpc_timeout_s, max(deadline.remaining(), 0.001))
        started = time.monotonic()
        try:
            await asyncio.wait_for(call(), timeout)
        except (Exception, asyncio.CancelledError) as exc:
            self._error = f"{what}: {describe_failure(exc)}"
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise DiscoveryUnavailable("dynamo", what, 1, time.monotonic() - started,
                                       self._error) from exc
        self._error = None

    async def unregister(self, deadline: Deadline | None = None) -> None:
        model = self.component.model
        if model is not None and self.instances.registered:
            await self._bounded("unregister the model", model.unregister, deadline)
        await self.instances.unregister(deadline)

    async def register(self, deadline: Deadline | None = None) -> None:
        await self.instances.register(deadline)
        model = self.component.model
        if model is not None:
            await self._bounded("register the model", model.register, deadline)


