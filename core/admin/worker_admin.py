"""The admin side a worker embeds: its admin API server and its deletion-cost publisher.

:class:`WorkerAdmin` bundles what every quiesce worker face runs next to its serving API
(``quiesce serve``, ``vllm serve`` with quiesce's middleware): the admin API of
:mod:`quiesce.admin.server` on its own socket, with the lifecycle's metrics
(:mod:`quiesce.admin.metrics`) and ``signal_guard`` in ``GET /engine/status``, and, when
the worker runs in a pod that asked for it, the publisher of
:mod:`quiesce.admin.pod_deletion_cost`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import prometheus_client

from quiesce.admin.metrics import WorkerMetrics
from quiesce.admin.pod_deletion_cost import DeletionCostPublisher, PodIdentity
from quiesce.admin.server import EmbeddedServer, create_admin_app
from quiesce.lifecycle import Lifecycle
from quiesce.signal_guard import SignalOwnership


@dataclasses.dataclass
class WorkerAdmin:
    """The admin API server and the deletion-cost publisher of one worker."""

    server: EmbeddedServer
    publisher: DeletionCostPublisher | None
    publishing: asyncio.Task[None] | None = None

    @classmethod
    def build(cls, lifecycle: Lifecycle, sock: socket.socket, *, token: str | None,
              signals: SignalOwnership, pod: PodIdentity | None,
              extra: dict[str, object] | None = None,
              registry: prometheus_client.CollectorRegistry | None = None) -> WorkerAdmin:
        """``sock``: bound, listening or not (the server listens when started).
        ``registry``: where the lifecycle's metrics go (None: a private one; vLLM's
        default registry puts them in vLLM's own ``/metrics`` too)."""
        publisher = DeletionCostPublisher(lifecycle, pod) if pod is not None else None

        def worker_status() -> dict[str, object]:  # the CLI polls status every 50 ms
            status: dict[str, object] = {"signal_guard":
                                         signals.report(max_age_s=1.0).to_dict(), **(extra or {})}
            if publisher is not None:
                status["deletion_cost"] = publisher.status()
            return status

        metrics = WorkerMetrics(lifecycle, registry)
        return cls(EmbeddedServer(create_admin_app(lifecycle, token=token, metrics=metrics,
                                                   extra_status=worker_status), sock),
                   publisher)

    def publish(self) -> None:
        """Start publishing the deletion cost (if the pod asked for it)."""
        if self.publisher is not None:
            self.publishing = asyncio.create_task(self.publisher.run(asyncio.Event()),
                                                  name="deletion-cost")

    def leaving(self) -> None:
        """The pod is on its way out: its cost no longer matters. At once, even mid-PATCH:
        the shutdown's budget is running."""
        if self.publishing is not None:
            self.publishing.cancel()
