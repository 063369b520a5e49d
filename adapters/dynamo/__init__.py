"""NVIDIA Dynamo: discovery over the runtime's endpoint instances, admission for its
handlers, a drain on SIGTERM, and quiesce inside Dynamo's own worker components.

For a worker that serves Dynamo endpoints with ``ai-dynamo-runtime``
(``pip install 'quiesce[dynamo]'``; checked against 1.6.1):

- :class:`DynamoDiscovery` (:mod:`.discovery`) — :class:`~quiesce.discovery.Discovery`
  over served ``dynamo.runtime.Endpoint`` objects (unregister / register each instance,
  bounded retries, unknown state on failure).
- :func:`gated` (:mod:`.gated`) — wraps an endpoint handler so that each request is
  admitted through an :class:`~quiesce.admission.AdmissionGate` and released with the
  outcome its stream shows (:func:`finish_outcome` reads Dynamo's ``finish_reason``).
- :func:`graceful_shutdown_with_drain` / :func:`install_signal_handlers`
  (:mod:`.shutdown`) — a drop-in for Dynamo's graceful-shutdown helper that drains
  instead of sleeping a fixed grace period.
- :mod:`.components` — hooks into Dynamo's own worker components (``dynamo.vllm``,
  ``dynamo.sglang``, ``dynamo.trtllm``), used by ``quiesce dynamo COMPONENT -- ...``
  (:mod:`quiesce.serve.dynamo_worker`).

Nothing here imports ``dynamo`` at import time: :func:`loopback_runtime` and the
component hooks import it when called (without it:
:class:`~quiesce.errors.EngineNotInstalled`), so discovery and the shutdown work with any
object that has the two endpoint methods.
"""

from quiesce.discovery import DiscoveryUnavailable

from .discovery import DynamoDiscovery, DynamoEndpoint
from .gated import finish_outcome, gated
from .runtime import LOOPBACK_ENV, loopback_runtime
from .shutdown import (
    DEFAULT_CALLBACK_TIMEOUT_S,
    DEFAULT_ROUTER_GRACE_S,
    ShutdownReport,
    graceful_shutdown_with_drain,
    install_signal_handlers,
)

__all__ = ["DEFAULT_CALLBACK_TIMEOUT_S", "DEFAULT_ROUTER_GRACE_S", "LOOPBACK_ENV",
           "DiscoveryUnavailable", "DynamoDiscovery", "DynamoEndpoint", "ShutdownReport",
           "finish_outcome", "gated", "graceful_shutdown_with_drain",
           "install_signal_handlers", "loopback_runtime"]
