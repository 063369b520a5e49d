"""A Dynamo ``DistributedRuntime`` kept on loopback, for tests and benchmarks."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from quiesce.errors import EngineNotInstalled

LOOPBACK_ENV = {
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE": "zmq",
}
"""Environment that keeps the runtime's TCP request plane and event plane on loopback.
(Dynamo 1.6.1's ZMQ event publisher still binds 0.0.0.0.)"""


def loopback_runtime(loop: asyncio.AbstractEventLoop, store_dir: str | None = None) -> Any:
    """A ``DistributedRuntime`` with the ``file`` discovery backend and the ``tcp`` request
    plane, every socket on 127.0.0.1 (no etcd, no NATS). ``store_dir`` sets ``DYN_FILE_KV``
    (shared by every process that should see each other). Sets the loopback environment
    variables (:data:`LOOPBACK_ENV`) in this process unless already set."""
    try:
        from dynamo.runtime import (  # type: ignore[import-not-found, unused-ignore]  # noqa: PLC0415
            DistributedRuntime,
        )
    except ImportError:
        raise EngineNotInstalled("dynamo", "ai-dynamo-runtime", "dynamo") from None
    for name, value in LOOPBACK_ENV.items():
        os.environ.setdefault(name, value)
    if store_dir is not None:
        os.environ["DYN_FILE_KV"] = store_dir
    return DistributedRuntime(loop, "file", "tcp")
