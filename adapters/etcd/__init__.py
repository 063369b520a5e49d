"""etcd discovery: the worker's key under a lease that a background task keeps alive.

Layout. One key per worker, ``<prefix>/<worker>`` (default prefix ``/quiesce/instances``),
whose value is JSON ``{"worker", "address", "role", "generation", "lease"}``; the key is
attached to a lease of ``ttl_s`` seconds. ``generation`` counts this object's successful
registrations (1, 2, ...), so a router can tell a re-registration from the old entry. A
router watches the prefix (:class:`EtcdWatcher` does) and sees a DELETE when the worker
unregisters, or when its lease expires because the worker died.

Client: ``aetcd`` 1.0.0 (asyncio over ``grpc.aio``; ``pip install 'quiesce[etcd]'``),
imported lazily; without it the constructor raises
:class:`~quiesce.errors.EngineNotInstalled`. One endpoint (``host``/``port``), no TLS or
auth. The gRPC channel is created with a short reconnect backoff (0.1 s to 1 s) so that a
restarted etcd is reached again within about a second.

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
from dataclasses import dataclass
from typing import Any

from quiesce.budget import Deadline, check_seconds
from quiesce.discovery import (
    BACKOFF_FIRST_S,
    DiscoveryUnavailable,
    Watcher,
    describe_failure,
    retry_within,
)
from quiesce.errors import ConfigError, EngineNotInstalled

__all__ = ["DiscoveryUnavailable", "EtcdConfig", "EtcdDiscovery", "EtcdWatcher"]

log = logging.getLogger("quiesce.adapters.etcd")

ROLES = ("aggregated", "prefill", "decode")
CLEANUP_BACKOFF_MAX_S = 1.0
GRPC_OPTIONS = {
    # Reach a restarted etcd within about a second (gRPC's default backoff grows to 120 s).
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
}



def _aetcd() -> Any:
    try:
        import aetcd  # type: ignore[import-untyped, unused-ignore]  # noqa: PLC0415
    except ImportError:
        raise EngineNotInstalled("etcd", "aetcd", "etcd") from None
    return aetcd


@dataclass(frozen=True)
class EtcdConfig:
    """Where and how to register. Validated at construction (``ConfigError``)."""

    worker: str
    """This worker's name: the last part of its key; no ``/``."""
    address: str
    """Where routers reach the worker (e.g. ``http://10.0.0.7:8000``)."""
    role: str = "aggregated"
    host: str = "127.0.0.1"
    port: int = 2379
    prefix: str = "/quiesce/instances"
    ttl_s: int = 10
    """Lease TTL in whole seconds (etcd's unit). etcd raises values below its minimum
    (about 2 s with default timing) to that minimum."""
    keepalive_s: float | None = None
    """Keep-alive period; default ``ttl_s / 3``; must be below ``ttl_s``."""
    rpc_timeout_s: float = 1.0
    """Bound of one RPC attempt."""
    retry_budget_s: float = 5.0
    """Bound of one ``register``/``unregister`` call (the caller's deadline may cut it)."""

    def __post_init__(self) -> None:
        if not isinstance(self.worker, str) or not self.worker or "/" in self.worker:
            raise ConfigError("worker", f"must be a non-empty name without '/', got "
                                        f"{self.worker!r}")
        if not isinstance(self.address, str) or not self.address:
            raise ConfigError("address", f"must be a non-empty string, got {self.address!r}")
        if self.role not in ROLES:
            raise ConfigError("role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError("host", f"must be a non-empty host name, got {self.host!r}")
        if (isinstance(self.port, bool) or not isinstance(self.port, int)
                or not 0 < self.port < 65536):
            raise ConfigError("port", f"must be an integer in 1..65535, got {self.port!r}")
        if not isinstance(self.prefix, str) or not self.prefix.startswith("/") \
                or self.prefix.endswith("/"):
            raise ConfigError("prefix", f"must start and not end with '/', got {self.prefix!r}")
        if isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, int) or self.ttl_s < 1:
            raise ConfigError("ttl_s", f"must be a whole number of seconds >= 1, got "
                                       f"{self.ttl_s!r}")
        check_seconds("keepalive_s", self.keepalive_s, allow_none=True, allow_zero=False)
        if self.keepalive_s is not None and self.keepalive_s >= self.ttl_s:
            raise ConfigError("keepalive_s", f"must be below ttl_s ({self.ttl_s} s), got "
                                             f"{self.keepalive_s!r}")
        check_seconds("rpc_timeout_s", self.rpc_timeout_s, allow_zero=False)
        check_seconds("retry_budget_s", self.retry_budget_s, allow_zero=False)

    @property
    def key(self) -> bytes:
        return f"{self.prefix}/{self.worker}".encode()

    @property
    def keepalive_period_s(self) -> float:
        return self.keepalive_s if self.keepalive_s is not None else self.ttl_s / 3


def grpc_host(host: str) -> str:
    """``host`` as gRPC's target wants it: an IPv6 address in brackets (aetcd joins
    ``host:port`` as given)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return True
    aetcd = _aetcd()
    return isinstance(exc, (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError,
                            aetcd.InternalError))


def _lease_not_found(exc: BaseException) -> bool:
    return "lease not found" in str(exc)


class EtcdDiscovery:
    """:class:`~quiesce.discovery.Discovery` in etcd (see the module docstring)."""

    def __init__(self, config: EtcdConfig) -> None:
        if not isinstance(config, EtcdConfig):
            raise ConfigError("config", f"must be an EtcdConfig, got {type(config).__name__}")
        self.config = config
        self._aetcd = _aetcd()
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
                                              self.config.rpc_timeout_s, retryable=_retryable)
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
                                   self.config.rpc_timeout_s, retryable=_retryable)
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
                                       self.config.rpc_timeout_s, retryable=_retryable)
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


class EtcdWatcher:
    """Follows ``<prefix>/`` the way a router does: a name → value map and change callbacks.

    ``start()`` reads the prefix once and watches from the next revision; a watch that
    breaks (etcd down) is re-established with the doubling backoff (at most 1 s), and the
    map re-read, calling the callbacks for what changed meanwhile. ``wait_for`` blocks,
    woken by events, until a name is (or is not) listed, or its timeout passes.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 2379,
                 prefix: str = "/quiesce/instances") -> None:
        if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/"):
            raise ConfigError("prefix", f"must start and not end with '/', got {prefix!r}")
        self._aetcd = _aetcd()
        self._client = self._aetcd.Client(grpc_host(host), port, options=dict(GRPC_OPTIONS))
        self._prefix = (prefix + "/").encode()
        self.instances: dict[str, dict[str, Any]] = {}
        self._watchers: list[Watcher] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self.reconnects = 0

    def watch(self, watcher: Watcher) -> None:
        """Call ``watcher(name, registered)`` on every change (on the event loop)."""
        self._watchers.append(watcher)

    def _set(self, name: str, value: dict[str, Any] | None) -> None:
        was = name in self.instances
        if value is None:
            self.instances.pop(name, None)
        else:
            self.instances[name] = value
        if was != (value is not None):
            for watcher in list(self._watchers):
                watcher(name, value is not None)
        self._changed.set()

    def _name(self, key: bytes) -> str:
        return key[len(self._prefix):].decode()

    async def _snapshot(self) -> int:
        got = await self._client.get_prefix(self._prefix)
        seen: dict[str, dict[str, Any]] = {}
        for kv in got:
            try:
                seen[self._name(kv.key)] = json.loads(kv.value)
            except ValueError:
                seen[self._name(kv.key)] = {"invalid": kv.value.decode(errors="replace")}
        for name in set(self.instances) - set(seen):
            self._set(name, None)
        for name, value in seen.items():
            self._set(name, value)
        return int(got.header.revision)

    async def start(self, timeout_s: float = 5.0) -> None:
        """Read the prefix and start watching; raises DiscoveryUnavailable after
        ``timeout_s`` if etcd cannot be read."""
        check_seconds("timeout_s", timeout_s, allow_zero=False)
        revision = await retry_within("etcd", "watch", self._snapshot,
                                      Deadline.after(timeout_s), timeout_s,
                                      retryable=_retryable)
        watch = await self._client.watch_prefix(self._prefix, start_revision=revision + 1)
        self._task = asyncio.get_running_loop().create_task(self._follow(watch, revision))
        self._ready.set()

    async def _follow(self, watch: Any, revision: int) -> None:
        kinds = self._aetcd.EventKind
        delay = BACKOFF_FIRST_S
        while True:
            try:
                async for event in watch:
                    name = self._name(event.kv.key)
                    revision = max(revision, int(event.kv.mod_revision))
                    if event.kind == kinds.DELETE:
                        self._set(name, None)
                    else:
                        try:
                            self._set(name, json.loads(event.kv.value))
                        except ValueError:
                            self._set(name, {"invalid": event.kv.value.decode(
                                errors="replace")})
                    delay = BACKOFF_FIRST_S
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("etcd watch broke: %s", describe_failure(exc))
            # re-establish: re-read the map, then watch from the revision read
            while True:
                await asyncio.sleep(delay)
                delay = min(delay * 2, CLEANUP_BACKOFF_MAX_S)
                try:
                    revision = await asyncio.wait_for(self._snapshot(), 1.0)
                    watch = await asyncio.wait_for(
                        self._client.watch_prefix(self._prefix, start_revision=revision + 1),
                        1.0)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.debug("etcd re-watch failed: %s", describe_failure(exc))
                    continue
                self.reconnects += 1
                break

    async def wait_for(self, name: str, registered: bool, timeout_s: float) -> bool:
        """Until ``name`` is listed (``registered``) or not; False after ``timeout_s``."""
        check_seconds("timeout_s", timeout_s)
        deadline = Deadline.after(timeout_s)
        while (name in self.instances) != registered:
            left = deadline.remaining()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except (TimeoutError, asyncio.TimeoutError):
                return (name in self.instances) == registered
        return True

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})
        await self._client.close()
