"""Discovery of a Dynamo worker by its model card and its endpoint instances.

Dynamo 1.6.1's frontend routes by the model card a worker registered
(``dynamo.llm.register_model``), not by its endpoint instances alone: with only the
instances unregistered it kept picking the worker (docs/dynamo.md). So a worker is out
of discovery only once both are gone. :class:`ModelCardDiscovery` is that pair as one
:class:`~quiesce.discovery.Discovery`:

- ``unregister()``: the card first (the frontend stops picking the worker), then the
  instances;
- ``register()``: the card first, then the instances — Dynamo's own start order (a card
  without an instance draws no request; the instance then does).

The card is whatever ``card()`` returns when a call runs (``None``: no card yet, only the
instances count), so any worker that registers a model uses it: ``quiesce dynamo``'s
components (:mod:`.components`) and ``quiesce serve --dynamo`` (:mod:`.backend`).

Failure behaviour: each card call is bounded by ``rpc_timeout_s`` (and the caller's
deadline); a failure or timeout raises :class:`~quiesce.discovery.DiscoveryUnavailable`
and leaves the state unknown (``registered`` stays True, ``registration_error`` says
why), as the instances' own :class:`~.discovery.DynamoDiscovery` does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from quiesce.budget import Deadline, check_seconds
from quiesce.discovery import DiscoveryUnavailable, describe_failure


class ModelCard(Protocol):
    """A model registration that can be undone and redone (Dynamo's model card)."""

    async def register(self) -> None: ...

    async def unregister(self) -> None: ...


class Instances(Protocol):
    """The endpoint instances' discovery (:class:`~.discovery.DynamoDiscovery` or a
    wrapper of it)."""

    @property
    def registered(self) -> bool: ...

    @property
    def registration_error(self) -> str | None: ...

    def served(self) -> None: ...

    async def register(self, deadline: Deadline | None = None) -> None: ...

    async def unregister(self, deadline: Deadline | None = None) -> None: ...


class ModelCardDiscovery:
    """:class:`~quiesce.discovery.Discovery` over a model card and its endpoint
    instances (module docstring). ``card``: the card as it is now, or None.

    The card starts unlisted; :meth:`served` records a worker that registered both
    itself. Not thread-safe (one event loop).
    """

    def __init__(self, instances: Instances, card: Callable[[], ModelCard | None],
                 rpc_timeout_s: float = 5.0) -> None:
        check_seconds("rpc_timeout_s", rpc_timeout_s, allow_zero=False)
        self.instances = instances
        self._card = card
        self._rpc_timeout_s = rpc_timeout_s
        self._listed: bool | None = False
        """Whether the card is registered; None: unknown (a call failed)."""
        self._error: str | None = None

    @property
    def registered(self) -> bool:
        return self._listed is not False or self.instances.registered

    @property
    def registration_error(self) -> str | None:
        return self._error or self.instances.registration_error

    def served(self, *, card: bool) -> None:
        """The worker registered its instances itself (``serve_endpoint``), and its card
        too when ``card``."""
        self.instances.served()
        if card:
            self._listed, self._error = True, None

    async def _bounded(self, what: str, call: Callable[[], Awaitable[None]],
                       deadline: Deadline | None) -> None:
        timeout = self._rpc_timeout_s if deadline is None else min(
            self._rpc_timeout_s, max(deadline.remaining(), 0.001))
        started = time.monotonic()
        try:
            await asyncio.wait_for(call(), timeout)
        except (Exception, asyncio.CancelledError) as exc:
            self._listed, self._error = None, f"{what}: {describe_failure(exc)}"
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise DiscoveryUnavailable("dynamo", what, 1, time.monotonic() - started,
                                       self._error) from exc
        self._error = None

    async def register(self, deadline: Deadline | None = None) -> None:
        """The card (unless listed), then the instances. Idempotent."""
        card = self._card()
        if card is not None and self._listed is not True:
            await self._bounded("register the model", card.register, deadline)
            self._listed = True
        await self.instances.register(deadline)

    async def unregister(self, deadline: Deadline | None = None) -> None:
        """The card (unless known to be unlisted), then the instances. Idempotent."""
        card = self._card()
        if card is not None and self._listed is not False:
            await self._bounded("unregister the model", card.unregister, deadline)
            self._listed = False
        await self.instances.unregister(deadline)
