"""The worker's side of etcd discovery: its key under a lease that a background task keeps
alive (:class:`EtcdDiscovery`).

Layout. One key per worker, ``<prefix>/<worker>`` (default prefix ``/quiesce/instances``),
whose value is JSON ``{"worker", "address", "role", "generation", "lease"}``; the key is
attached to a lease of ``ttl_s`` seconds. ``generation`` counts this object's successful
registrations (1, 2, ...), so a router can tell a re-registration from the old entry. A
router watches the prefix (:class:`~.watcher.EtcdWatcher` does) and sees a DELETE when the worker
unregisters, or when its lease expires because the worker died.

Every RPC attempt is bounded by ``rpc_timeout_s`` and every call by a retry budget
(``retry_budget_s``, or the caller's :class:`~quiesce.budget.Deadline` if earlier): failed
attempts are retried after a doubling backoff (20 ms, 40 ms, ... at most 0.5 s) until the
budget is spent. Connection failures, timeouts and etcd internal errors are retried;
anything else (bad argument, authentication) fails at once.

Methods, what they cost, and what happens on failure:

- ``EtcdDiscovery(config)``: no I/O. Bad configuration raises
  :class:`~quiesce.errors.ConfigError` naming the field.
- ``register()``: a no-op while registered and kept alive. Otherwise two RPCs (lease grant,
  put; ~1 ms on loopback), then starts the keep-alive task. On failure within the budget
  it raises :class:`DiscoveryUnavailable`; the state becomes *unknown* (a put may have
  landed), ``registration_error`` holds the reason, and no lease is kept alive, so any
  partial registration disappears by itself within ``ttl_s``.
- keep-alive (background): one LeaseKeepAlive RPC every ``keepalive_s`` (default
  ``ttl_s / 3``). If etcd does not answer, the state becomes unknown with the error and the
  task retries with the doubling backoff (never slower than ``keepalive_s``); when etcd is
  back (e.g. restarted with its data), the lease is refreshed, the key is checked and put
  again if missing, and the state is registered again. If the lease is gone (expired while
  keep-alives were not getting through), the task re-registers under a new lease, counts it
  in ``reregistrations`` and bumps ``generation``.
- ``unregister()``: stops the keep-alive, deletes the key (what watchers see: a DELETE,
  ~1 ms later on loopback), then revokes the lease; two RPCs. A no-op when not registered.
  If the delete does not get through within the budget it raises
  :class:`DiscoveryUnavailable`; the state is unknown with the error, and a background
  cleanup keeps retrying the delete and revoke (backoff up to 1 s) until it succeeds,
  ``register()`` is called, or ``close()``. Even without it the key disappears within
  ``ttl_s`` of etcd being reachable again, since nothing keeps its lease alive. A revoke
  that fails after the delete succeeded is only logged: the key is gone and the lease,
  no longer kept alive, expires.
- ``registered``: True while registered *or unknown* (fail closed: routers may still list
  the worker); False only once etcd confirmed the key is gone (or it was never put).
- ``registration_error``: ``None`` while the state is known, else the last error (see
  :func:`quiesce.discovery.registration_state`).
- ``close()``: stops the background tasks and closes the channel; it does not unregister
  (the lease then expires within ``ttl_s``).

``register`` and ``unregister`` are serialized by a lock. A ``register`` cancelled from
outside (e.g. a caller's timeout) leaves the state unknown.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from quiesce.budget import Deadline
from quiesce.discovery import (
    BACKOFF_FIRST_S,
    DiscoveryUnavailable,
    describe_failure,
    retry_within,
)
from quiesce.errors import ConfigError

from .client import CLEANUP_BACKOFF_MAX_S, GRPC_OPTIONS, grpc_host, load_aetcd, retryable
from .config import EtcdConfig

log = logging.getLogger("quiesce.adapters.etcd")


def _lease_not_found(exc: BaseException) -> bool:
    return "lease not found" in str(exc)


class EtcdDiscovery:
    """:class:`~quiesce.discovery.Discovery` in etcd (see the module docstring)."""

    def __init__(self, config: EtcdConfig) -> None:
        if not isinstance(config, EtcdConfig):
            raise ConfigError("config", f"must be an EtcdConfig, got {type(config).__name__}")
        self.config = config
        self._aetcd = load_aetcd()
        self._client: Any = None
        self._state: bool | None = False  # None: unknown
        self._error: str | None = None
        self._lease_id: int | None = None
        self._generation = 0
        self._keeper: asyncio.Task[None] | None = None
        self._cleanup: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.reregistrations = 0
        """How often the keep-alive found the lease gone and registered again."""
        self.keepalives = 0
        """Keep-alives etcd confirmed (the lease was alive)."""
        self.keepalive_failures = 0
        """Keep-alive attempts that etcd did not answer."""

    # -- reading --------------------------------------------------------------------

    @property
    def registered(self) -> bool:
        return self._state is not False

    @property
    def registration_error(self) -> str | None:
        return self._error if self._state is None else None

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    # -- the etcd calls ---------------------------------------------------------------

    def _etcd(self) -> Any:
        if self._client is None:
            self._client = self._aetcd.Client(grpc_host(self.config.host), self.config.port,
                                              options=dict(GRPC_OPTIONS))
        return self._client

    def _value(self, lease_id: int) -> bytes:
        return json.dumps({"worker": self.config.worker, "address": self.config.address,
                           "role": self.config.role, "generation": self._generation + 1,
                           "lease": lease_id}, separators=(",", ":")).encode()

    async def _grant_and_put(self) -> int:
        """Grant a lease and put the key under it (each attempt bounded by the caller)."""
        client = self._etcd()
        lease = await client.lease(self.config.ttl_s)
        await client.put(self.config.key, self._value(lease.id), lease=lease.id)
        self._generation += 1
        return int(lease.id)

    async def _refresh(self, lease_id: int) -> int:
        """One keep-alive; the remaining TTL (0 or less: the lease is gone)."""
        reply = await self._etcd().refresh_lease(lease_id)
        return 0 if reply is None else int(reply.TTL)

    async def _key_is_ours(self, lease_id: int) -> bool:
        got = await self._etcd().get(self.config.key)
        return got is not None and int(got.lease) == lease_id

    async def _delete(self) -> None:
        await self._etcd().delete(self.config.key)

    async def _revoke(self, lease_id: int) -> None:
        try:
            await self._etcd().revoke_lease(lease_id)
        except Exception as exc:
            if not _lease_not_found(exc):
                raise

    # -- register / unregister --------------------------------------------------------

    def _deadline(self, deadline: Deadline | None) -> Deadline:
        own = Deadline.after(self.config.retry_budget_s)
        return own if deadline is None or deadline.at > own.at else deadline

    async def register(self, deadline: Deadline | None = None) -> None:
        """Put the key under a fresh lease and keep it alive. Idempotent while registered.

        Raises :class:`DiscoveryUnavailable` when etcd does not confirm within the budget
        (``retry_budget_s`` or ``deadline``, whichever is earlier); the state is then
        unknown and nothing is kept alive.
        """
        async with self._lock:
            if self._state is True and self._keeper is not None and not self._keeper.done():
                return
            await self._stop(self._cleanup)
            await self._stop(self._keeper)
            try:
                lease_id = await retry_within("etcd", "register", self._grant_and_put,
                                              self._deadline(deadline),
                                              self.config.rpc_timeout_s, retryable=retryable)
            except BaseException as exc:
                self._state, self._error = None, describe_failure(exc)
                raise
            old, self._lease_id = self._lease_id, lease_id
            self._state, self._error = True, None
            self._keeper = asyncio.get_running_loop().create_task(
                self._keep_alive(), name=f"quiesce-etcd-keepalive-{self.config.worker}")
            if old is not None and old != lease_id:
                self._spawn_revoke(old)  # tidy: nothing is attached to it any more

    async def unregister(self, deadline: Deadline | None = None) -> None:
        """Delete the key, then revoke the lease. Idempotent when not registered.

        Raises :class:`DiscoveryUnavailable` when etcd does not confirm the delete within
        the budget; the state is unknown, and a background cleanup keeps retrying.
        """
        async with self._lock:
            await self._stop(self._keeper)
            self._keeper = None
            if self._state is False:
                return
            await self._stop(self._cleanup)
            limit = self._deadline(deadline)
            try:
                await retry_within("etcd", "unregister (delete)", self._delete, limit,
                                   self.config.rpc_timeout_s, retryable=retryable)
            except DiscoveryUnavailable as exc:
                self._state, self._error = None, str(exc)
                log.error("%s; retrying in the background, the lease expires in %d s "
                          "otherwise", exc, self.config.ttl_s)
                self._cleanup = asyncio.get_running_loop().create_task(
                    self._cleanup_later(), name=f"quiesce-etcd-cleanup-{self.config.worker}")
                raise
            self._state, self._error = False, None
            lease_id, self._lease_id = self._lease_id, None
            if lease_id is not None:
                try:
                    await retry_within("etcd", "unregister (revoke)",
                                       lambda: self._revoke(lease_id), limit,
                                       self.config.rpc_timeout_s, retryable=retryable)
                except DiscoveryUnavailable as exc:
                    log.warning("%s; the key is gone and the lease expires in %d s", exc,
                                self.config.ttl_s)

    async def close(self) -> None:
        """Stop the background tasks and close the channel. Does not unregister."""
        await self._stop(self._keeper)
        await self._stop(self._cleanup)
        self._keeper = self._cleanup = None
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    # -- background tasks -------------------------------------------------------------

    @staticmethod
    async def _stop(task: asyncio.Task[None] | None) -> None:
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})

    def _spawn_revoke(self, lease_id: int) -> None:
        async def revoke() -> None:
            try:
                await asyncio.wait_for(self._revoke(lease_id), self.config.rpc_timeout_s)
            except Exception as exc:  # it expires by itself
                log.debug("revoking the old lease %x failed: %s", lease_id, describe_failure(exc))
        asyncio.get_running_loop().create_task(revoke())

    def _unknown(self, why: str) -> None:
        if self._state is not None:
            log.warning("etcd registration of %s is unknown: %s", self.config.worker, why)
        self._state, self._error = None, why

    async def _keep_alive(self) -> None:
        period = self.config.keepalive_period_s
        rpc = self.config.rpc_timeout_s
        delay = period
        while True:
            await asyncio.sleep(delay)
            lease_id = self._lease_id
            if lease_id is None:
                return
            try:
                ttl = await asyncio.wait_for(self._refresh(lease_id), rpc)
                if ttl <= 0:
                    log.warning("etcd lease %x of %s expired; registering again", lease_id,
                                self.config.worker)
                    self._unknown(f"lease {lease_id:x} expired; registering again")
                    new = await asyncio.wait_for(self._grant_and_put(), rpc)
                    self._lease_id = new
                    self.reregistrations += 1
                else:
                    self.keepalives += 1
                if ttl > 0 and self._state is not True and not await asyncio.wait_for(
                        self._key_is_ours(lease_id), rpc):
                    # back after an outage, and the key was lost meanwhile: put it again
                    await asyncio.wait_for(
                        self._etcd().put(self.config.key, self._value(lease_id),
                                         lease=lease_id), rpc)
                    self._generation += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.keepalive_failures += 1
                self._unknown(f"keep-alive failed: {describe_failure(exc)}")
                delay = BACKOFF_FIRST_S if delay >= period else min(delay * 2, period)
                continue
            if self._state is not True:
                log.info("etcd registration of %s confirmed again", self.config.worker)
            self._state, self._error = True, None
            delay = period

    async def _cleanup_later(self) -> None:
        delay = BACKOFF_FIRST_S
        while self._state is None:
            await asyncio.sleep(delay)
            try:
                await asyncio.wait_for(self._delete(), self.config.rpc_timeout_s)
            except Exception as exc:
                self._error = f"unregister not confirmed, still retrying: {describe_failure(exc)}"
                delay = min(delay * 2, CLEANUP_BACKOFF_MAX_S)
                continue
            self._state, self._error = False, None
            lease_id, self._lease_id = self._lease_id, None
            log.info("etcd key of %s deleted after the outage", self.config.worker)
            if lease_id is not None:
                try:
                    await asyncio.wait_for(self._revoke(lease_id), self.config.rpc_timeout_s)
                except Exception as exc:
                    log.debug("revoke after the outage failed: %s", describe_failure(exc))
