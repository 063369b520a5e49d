"""Publish the worker's drain cost on its own pod, so a ReplicaSet scales down the
cheapest worker to drain.

Kubernetes removes the pods with the lowest ``controller.kubernetes.io/pod-deletion-cost``
annotation first when a ReplicaSet (a Deployment) scales down. Without it, the choice
goes by readiness, phase and age, and routinely drains the busiest worker while an
idle one stays. :class:`DeletionCostPublisher` keeps the annotation at the worker's
:mod:`drain cost <quiesce.drain_cost>`.

Pieces, in the order a worker uses them:

- :meth:`PodIdentity.from_environment` (at start-up, before the engine loads): the
  in-cluster API address (``KUBERNETES_SERVICE_HOST``/``_PORT``), the service
  account's token, CA and namespace files, and the pod's name (``POD_NAME`` from the
  downward API, else the hostname, which is the pod's name unless ``hostname`` is set
  in the spec). Anything missing raises :class:`~quiesce.errors.ConfigError` naming it.
- :meth:`DeletionCostPublisher.run` (a task for the worker's life): every
  ``interval_s`` reads the lifecycle's status (one probe read, bounded by the probe
  timeout) and patches the annotation **only when the cost moved enough**
  (:meth:`DeletionCostPublisher.should_publish`: the first time; to or from zero;
  or by at least ``min_change`` and ``min_change_ratio`` of the published value), so a
  busy worker causes at most one PATCH per ``interval_s`` and usually far fewer.
- :meth:`DeletionCostPublisher.status` (for ``GET /engine/status``): the cost, what
  was published and when, patch and failure counts, the last error.

**Fails soft.** An API error (403 from missing RBAC, 404, a timeout, the API server
down) is logged once per distinct error, shown in the status, and retried with a
doubling interval up to ``max_backoff_s``; it never raises into the worker, never
blocks serving or draining. The publisher stops when the worker's shutdown begins:
the pod is being deleted, the annotation no longer matters.

Needs the RBAC in ``deploy/kubernetes/worker.yaml`` (``patch`` on pods in the worker's
namespace). Each PATCH re-reads the token file (projected service
account tokens rotate).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx

from quiesce.budget import check_seconds
from quiesce.drain_cost import DrainCost
from quiesce.errors import ConfigError
from quiesce.lifecycle import Lifecycle

log = logging.getLogger("quiesce.admin.pod_deletion_cost")

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PATCH_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class PodIdentity:
    """Where the pod lives and how to reach the API server as its service account."""

    api_url: str
    namespace: str
    pod_name: str
    token_file: Path
    ca_file: Path | None
    """``None``: verify with the system's CAs (only a stand-in API server over plain
    HTTP in tests goes without TLS)."""

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None,
                         account_dir: Path = SERVICE_ACCOUNT_DIR) -> PodIdentity:
        """The in-cluster identity; raises ConfigError naming what is missing."""
        env = os.environ if environ is None else environ
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ConfigError("publish_deletion_cost", "not running in a Kubernetes pod: "
                              "KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set")
        token, ca, ns = (account_dir / "token", account_dir / "ca.crt",
                         account_dir / "namespace")
        for path in (token, ca):
            if not path.is_file():
                raise ConfigError("publish_deletion_cost", f"{path} is missing: mount the "
                                  f"service account token (automountServiceAccountToken)")
        namespace = env.get("POD_NAMESPACE") or (ns.read_text().strip() if ns.is_file() else "")
        pod_name = env.get("POD_NAME") or socket.gethostname()
        if not namespace:
            raise ConfigError("publish_deletion_cost", f"no namespace: set POD_NAMESPACE or "
                              f"mount {ns}")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", namespace, pod_name, token, ca)

    @property
    def pod_path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{self.pod_name}"


@dataclasses.dataclass(frozen=True)
class PublishPolicy:
    """How often and how eagerly the annotation follows the cost."""

    interval_s: float = 5.0
    """Between two reads of the cost; also the shortest time between two PATCHes."""
    min_change: int = 1000
    """A move smaller than this (in the cost's unit, milliseconds) is not published,
    except to or from 0."""
    min_change_ratio: float = 0.2
    """... nor one smaller than this share of the published value."""
    max_backoff_s: float = 60.0
    """After failures the interval doubles up to this."""

    def __post_init__(self) -> None:
        check_seconds("interval_s", self.interval_s, allow_zero=False)
        check_seconds("max_backoff_s", self.max_backoff_s, allow_zero=False)
        if isinstance(self.min_change, bool) or not isinstance(self.min_change, int) \
                or self.min_change < 1:
            raise ConfigError("min_change", f"must be an integer >= 1, got {self.min_change!r}")
        if not 0 <= self.min_change_ratio < 1:
            raise ConfigError("min_change_ratio", f"must be in [0, 1), got "
                              f"{self.min_change_ratio!r}")
        if self.max_backoff_s < self.interval_s:
            raise ConfigError("max_backoff_s", f"must be >= interval_s ({self.interval_s})")


Transport = Callable[[PodIdentity], httpx.AsyncClient]
"""Builds the HTTP client for one PATCH (tests hand in a stand-in server's)."""


def _client(pod: PodIdentity) -> httpx.AsyncClient:
    verify: str | bool = str(pod.ca_file) if pod.ca_file is not None else True
    return httpx.AsyncClient(base_url=pod.api_url, verify=verify, timeout=PATCH_TIMEOUT_S)


class DeletionCostPublisher:
    """Keeps ``pod-deletion-cost`` on the worker's pod at its drain cost (fails soft)."""

    def __init__(self, lifecycle: Lifecycle, pod: PodIdentity,
                 policy: PublishPolicy | None = None, *,
                 transport: Transport = _client) -> None:
        self.lifecycle = lifecycle
        self.pod = pod
        self.policy = policy or PublishPolicy()
        self._transport = transport
        self.cost: DrainCost | None = None
        self.published: int | None = None
        self.published_at: float | None = None
        self.patches = 0
        self.failures = 0
        self.last_error: str | None = None
        self._consecutive_failures = 0

    def should_publish(self, cost: int) -> bool:
        """Whether ``cost`` moved enough from what the pod carries to be worth a PATCH."""
        old = self.published
        if old is None or self.last_error is not None:  # never published, or retrying
            return True
        if cost == old:
            return False
        if cost == 0 or old == 0:
            return True
        change = abs(cost - old)
        return change >= self.policy.min_change and change >= self.policy.min_change_ratio * old

    async def publish_once(self) -> bool:
        """Read the cost, PATCH it when it moved enough. True when a PATCH succeeded."""
        cost = (await self.lifecycle.read_status()).drain_cost
        if cost is None:  # pragma: no cover - the lifecycle always computes one
            return False
        self.cost = cost
        if not self.should_publish(cost.value):
            return False
        try:
            await self._patch(cost.value)
        except (httpx.HTTPError, OSError, _ApiRefused) as exc:
            self._failed(f"{type(exc).__name__}: {exc}" if not isinstance(exc, _ApiRefused)
                         else str(exc))
            return False
        self.patches += 1
        self._consecutive_failures = 0
        if self.last_error is not None:
            log.info("pod-deletion-cost: the API server accepts patches again")
        self.last_error = None
        self.published, self.published_at = cost.value, time.time()
        log.debug("pod-deletion-cost of %s set to %d (%s)", self.pod.pod_name, cost.value,
                  cost.source)
        return True

    async def _patch(self, value: int) -> None:
        token = self.pod.token_file.read_text().strip()
        body = {"metadata": {"annotations": {ANNOTATION: str(value)}}}
        async with self._transport(self.pod) as client:
            response = await client.patch(
                self.pod.pod_path, json=body,
                headers={"Authorization": f"Bearer {token}",
                         "Content-Type": "application/merge-patch+json"})
        if response.status_code >= 300:
            raise _ApiRefused(response)

    def _failed(self, error: str) -> None:
        self.failures += 1
        self._consecutive_failures += 1
        if error != self.last_error:
            log.warning("pod-deletion-cost not published for pod %s/%s (serving and "
                        "draining go on; retrying): %s", self.pod.namespace,
                        self.pod.pod_name, error)
        self.last_error = error

    def next_wait_s(self) -> float:
        """The interval, doubled per consecutive failure up to ``max_backoff_s``."""
        policy = self.policy
        doubling = float(1 << min(self._consecutive_failures, 16))
        return min(policy.max_backoff_s, policy.interval_s * doubling)

    async def run(self, stop: asyncio.Event) -> None:
        """Publish until ``stop`` is set. Never raises (but for cancellation)."""
        while not stop.is_set():
            try:
                await self.publish_once()
            except Exception as exc:  # fail soft: never take the worker down
                self._failed(f"{type(exc).__name__}: {exc}")
            try:
                await asyncio.wait_for(stop.wait(), self.next_wait_s())
            except asyncio.TimeoutError:
                continue

    def status(self) -> dict[str, object]:
        return {
            "annotation": ANNOTATION,
            "pod": f"{self.pod.namespace}/{self.pod.pod_name}",
            "cost": self.cost.to_dict() if self.cost else None,
            "published": self.published,
            "published_at": self.published_at,
            "patches": self.patches,
            "failures": self.failures,
            "last_error": self.last_error,
        }


class _ApiRefused(Exception):
    """The API server answered the PATCH with an error status."""

    def __init__(self, response: httpx.Response) -> None:
        try:
            message = str(response.json().get("message", ""))
        except ValueError:
            message = response.text[:200]
        super().__init__(f"PATCH {response.request.url.path} answered "
                         f"{response.status_code}: {message}")
