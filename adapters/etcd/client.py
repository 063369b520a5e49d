"""The etcd client both sides use: ``aetcd`` imported lazily, the gRPC channel's options,
and which failures a bounded retry tries again.

Client: ``aetcd`` 1.0.0 (asyncio over ``grpc.aio``; ``pip install 'quiesce[etcd]'``),
imported lazily; without it the constructor raises
:class:`~quiesce.errors.EngineNotInstalled`. One endpoint (``host``/``port``), no TLS or
auth. The gRPC channel is created with a short reconnect backoff (0.1 s to 1 s) so that a
restarted etcd is reached again within about a second.
"""

from __future__ import annotations

import asyncio
from typing import Any

from quiesce.errors import EngineNotInstalled

CLEANUP_BACKOFF_MAX_S = 1.0
"""The slowest retry of a background cleanup or of a broken watch."""
GRPC_OPTIONS = {
    # Reach a restarted etcd within about a second (gRPC's default backoff grows to 120 s).
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
}


def load_aetcd() -> Any:
    """The ``aetcd`` module; :class:`~quiesce.errors.EngineNotInstalled` without it."""
    try:
        import aetcd  # type: ignore[import-untyped, unused-ignore]  # noqa: PLC0415
    except ImportError:
        raise EngineNotInstalled("etcd", "aetcd", "etcd") from None
    return aetcd


def grpc_host(host: str) -> str:
    """``host`` as gRPC's target wants it: an IPv6 address in brackets (aetcd joins
    ``host:port`` as given)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def retryable(exc: BaseException) -> bool:
    """Whether a failed etcd call is worth another attempt (connection, timeout, etcd
    internal error)."""
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return True
    aetcd = load_aetcd()
    return isinstance(exc, (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError,
                            aetcd.InternalError))
