"""Where and how a worker registers in etcd: :class:`EtcdConfig`, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from quiesce.budget import check_seconds
from quiesce.errors import ConfigError

ROLES = ("aggregated", "prefill", "decode")


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
