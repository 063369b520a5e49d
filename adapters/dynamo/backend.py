"""A quiesce engine served as a Dynamo backend: ``quiesce serve --dynamo`` (ai-dynamo 1.6.1).

:class:`DynamoBackend` puts an engine stream behind Dynamo's real frontend the way
Dynamo's own workers do it:

- a ``DistributedRuntime`` with the discovery backend and request plane asked for
  (Dynamo's own settings and environment: ``DYN_FILE_KV``, ``ETCD_ENDPOINTS``,
  ``DYN_TCP_RPC_HOST``...);
- the model card, registered with Dynamo's ``register_model`` (``ModelInput.Tokens``,
  ``WorkerType.Aggregated``; the completions surface, plus chat when the model
  directory has a chat template): the frontend tokenizes with the directory's
  tokenizer and routes by the card;
- one endpoint (``namespace.component.endpoint``, Dynamo's default
  ``dynamo.backend.generate``) served with ``serve_endpoint(graceful_shutdown=True)``,
  whose handler (:mod:`.token_handler`) is admitted through the gate (:func:`~.gated.gated`:
  outcomes from ``finish_reason``; a closed gate raises Dynamo's ``WorkerUnavailable``).

Discovery is :class:`~.model_card.ModelCardDiscovery`: the card and the endpoint
instance. The first registration of the instance is ``serve_endpoint`` itself, so
``Lifecycle.start()`` (gate open, then register) starts serving only after the gate
opened and the card is listed — Dynamo's own order — and not at all once
:attr:`DynamoBackend.stopping` says the worker is stopping (signalled while the card
registered: the drain then takes the card off, nothing was served). Later
registrations (a resume) use the instance calls of :class:`~.discovery.DynamoDiscovery`.

:meth:`DynamoBackend.install_dynamo_shutdown` installs Dynamo's own graceful-shutdown
helper instead of quiesce's drain (``dynamo.common.utils.graceful_shutdown``, from
ai-dynamo: unregister the instances, sleep the grace, set ``shutdown_event`` — the
handlers then abort what is left — and ``runtime.shutdown()``): the baseline "as shipped".

Failure behaviour: a missing ``dynamo`` package raises
:class:`~quiesce.errors.EngineNotInstalled`, a bad setting :class:`ConfigError` naming
the option, both before anything is served; a runtime that cannot be created raises
:class:`~quiesce.discovery.DiscoveryUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import re
from collections.abc import Callable
from typing import Any

from quiesce.admission import AdmissionGate
from quiesce.budget import Deadline, check_seconds
from quiesce.discovery import DiscoveryUnavailable, describe_failure
from quiesce.engine import EngineControl
from quiesce.errors import ConfigError, EngineNotInstalled, WorkerDraining

from .discovery import DynamoDiscovery
from .gated import finish_outcome, gated
from .model_card import ModelCardDiscovery
from .token_handler import TokenStreamer, has_chat_template, output_token, token_handler

log = logging.getLogger("quiesce.adapters.dynamo.backend")

DISCOVERY_BACKENDS = ("kubernetes", "etcd", "file", "mem")
REQUEST_PLANES = ("tcp", "nats")
"""Dynamo 1.6.1's choices (``--discovery-backend``, ``--request-plane``)."""
DEFAULT_NAMESPACE = "dynamo"
ENDPOINT_NAME = re.compile(r"[A-Za-z0-9_-]+")


def endpoint_path(text: str) -> str:
    """``namespace.component.endpoint`` from that or ``dyn://namespace.component.endpoint``;
    ConfigError naming ``dynamo_endpoint`` otherwise."""
    path = text.removeprefix("dyn://")
    parts = path.split(".")
    if len(parts) != 3 or not all(ENDPOINT_NAME.fullmatch(part) for part in parts):
        raise ConfigError("dynamo_endpoint", f"must be namespace.component.endpoint (letters, "
                          f"digits, '-', '_'), e.g. dynamo.backend.generate; got {text!r}")
    return path


@dataclasses.dataclass(frozen=True)
class DynamoBackendConfig:
    """Where and as what the engine is served. Invalid values raise ConfigError naming
    the ``quiesce serve`` option's field."""

    model_path: str
    """The model directory whose tokenizer and config make the model card."""
    served_model_name: str
    endpoint: str = f"{DEFAULT_NAMESPACE}.backend.generate"
    discovery_backend: str = "etcd"
    request_plane: str = "tcp"
    rpc_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoint", endpoint_path(self.endpoint))
        if self.discovery_backend not in DISCOVERY_BACKENDS:
            raise ConfigError("dynamo_discovery_backend", f"one of {DISCOVERY_BACKENDS}, got "
                              f"{self.discovery_backend!r}")
        if self.request_plane not in REQUEST_PLANES:
            raise ConfigError("dynamo_request_plane", f"one of {REQUEST_PLANES}, got "
                              f"{self.request_plane!r}")
        if not self.served_model_name.strip():
            raise ConfigError("served_model_name", "must not be empty")
        check_seconds("rpc_timeout_s", self.rpc_timeout_s, allow_zero=False)


def _import(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise EngineNotInstalled("dynamo", package, "dynamo") from None


def require_dynamo_shutdown() -> Callable[..., None]:
    """Dynamo's own ``install_signal_handlers`` (ai-dynamo 1.6.1,
    ``dynamo.common.utils.graceful_shutdown``); EngineNotInstalled without ai-dynamo."""
    helper = getattr(_import("dynamo.common.utils.graceful_shutdown", "ai-dynamo"),
                     "install_signal_handlers", None)
    if not callable(helper):
        raise ConfigError("dynamo_shutdown", "this ai-dynamo has no graceful_shutdown."
                          "install_signal_handlers (checked against 1.6.1)")
    return helper  # type: ignore[no-any-return]


class _ServedInstances:
    """The endpoint instance: first registered by ``serve_endpoint``, then by the
    instance calls of :class:`DynamoDiscovery`."""

    def __init__(self, backend: DynamoBackend, instances: DynamoDiscovery) -> None:
        self._backend = backend
        self._instances = instances

    @property
    def registered(self) -> bool:
        return self._instances.registered

    @property
    def registration_error(self) -> str | None:
        return self._instances.registration_error

    def served(self) -> None:
        self._instances.served()

    async def register(self, deadline: Deadline | None = None) -> None:
        if self._backend.serving is None:
            if self._backend.stopping():
                log.warning("the worker is stopping: the model card is registered, its "
                            "endpoint is not served")
                return
            self._backend.serve()
            self._instances.served()
            return
        await self._instances.register(deadline)

    async def unregister(self, deadline: Deadline | None = None) -> None:
        await self._instances.unregister(deadline)


class DynamoBackend:
    """An engine stream served as a Dynamo backend (module docstring).

    ``stream``: the engine's request stream; ``abort(request_id)`` ends one request in
    the engine. Build it, :meth:`connect` inside the event loop, hand :attr:`discovery`
    to the lifecycle, whose ``start()`` registers the card and serves. Not thread-safe.
    Raises ConfigError at construction for a model directory without a usable tokenizer.
    """

    def __init__(self, config: DynamoBackendConfig, gate: AdmissionGate,
                 stream: TokenStreamer, abort: Callable[[str], object]) -> None:
        if not isinstance(gate, AdmissionGate):
            raise ConfigError("gate", f"must be an AdmissionGate, got {type(gate).__name__}")
        self.config = config
        self.gate = gate
        self._stream = stream
        self._abort = abort
        self._token = output_token(config.model_path)
        self._chat = has_chat_template(config.model_path)
        self.shutdown_event = asyncio.Event()
        """Set when the engine's requests are to end (Dynamo's helper, or the abort)."""
        self.runtime: Any = None
        self.endpoint: Any = None
        self.serving: asyncio.Task[None] | None = None
        """``serve_endpoint`` while it runs (it returns after ``runtime.shutdown()``)."""
        self.stopping: Callable[[], bool] = lambda: False
        """Set by the worker: True once it is stopping, when the first registration
        registers the card but never starts ``serve_endpoint``."""
        self._discovery: ModelCardDiscovery | None = None
        self._llm: Any = None
        self._unavailable: Any = None

    @property
    def discovery(self) -> ModelCardDiscovery:
        if self._discovery is None:
            raise RuntimeError("connect() first")
        return self._discovery

    async def connect(self) -> None:
        """Create the runtime and the endpoint (nothing is registered yet)."""
        runtime_module = _import("dynamo.runtime", "ai-dynamo-runtime")
        self._llm = _import("dynamo.llm", "ai-dynamo-runtime")
        self._unavailable = _import("dynamo.llm.exceptions",
                                    "ai-dynamo-runtime").WorkerUnavailable
        try:
            self.runtime = runtime_module.DistributedRuntime(
                asyncio.get_running_loop(), self.config.discovery_backend,
                self.config.request_plane)
            self.endpoint = self.runtime.endpoint(self.config.endpoint)
        except Exception as exc:
            raise DiscoveryUnavailable("dynamo", "create the runtime", 1, 0.0,
                                       describe_failure(exc)) from exc
        instances = DynamoDiscovery((self.endpoint,), registered=False,
                                    rpc_timeout_s=self.config.rpc_timeout_s)
        self._discovery = ModelCardDiscovery(_ServedInstances(self, instances),
                                             lambda: self, self.config.rpc_timeout_s)

    # -- the model card (ModelCard) ---------------------------------------------------

    async def register(self) -> None:
        """Dynamo's ``register_model`` for this endpoint."""
        llm = self._llm
        surfaces = llm.ModelType.Completions
        if self._chat:
            surfaces = llm.ModelType.Chat | surfaces
        await llm.register_model(llm.ModelInput.Tokens, surfaces, self.endpoint,
                                 self.config.model_path, self.config.served_model_name,
                                 worker_type=llm.WorkerType.Aggregated)

    async def unregister(self) -> None:
        """Dynamo's ``unregister_model`` for this endpoint."""
        await self._llm.unregister_model(self.endpoint)

    # -- serving ----------------------------------------------------------------------

    def serve(self) -> None:
        """Start ``serve_endpoint`` (registers the instance); once."""
        if self.serving is not None:
            raise RuntimeError("already serving")

        def refusal(refused: WorkerDraining) -> BaseException:
            return self._unavailable(f"worker is draining: {refused}")  # type: ignore[no-any-return]

        handler = gated(token_handler(self._stream, self._abort, self._token,
                                      self.shutdown_event),
                        self.gate, lambda _request, context: str(context.id()),
                        outcome=finish_outcome, refusal=refusal)
        self.serving = asyncio.ensure_future(
            self.endpoint.serve_endpoint(handler, graceful_shutdown=True))

    def install_dynamo_shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        """SIGTERM/SIGINT to Dynamo's own helper, as ``dynamo.vllm`` installs it (module
        docstring); replaces the loop's handlers of both signals."""
        require_dynamo_shutdown()(loop, self.runtime, [self.endpoint], self.shutdown_event)

    async def close(self, timeout_s: float) -> None:
        """``runtime.shutdown()``, then wait up to ``timeout_s`` for ``serve_endpoint``
        to return (it lets the requests still served end). Never raises for a serve
        that failed (logged)."""
        if self.runtime is not None:
            self.runtime.shutdown()
        task = self.serving
        if task is None:
            return
        await asyncio.wait({task}, timeout=max(timeout_s, 0.0))
        if not task.done():
            log.warning("serve_endpoint did not return within %.1fs", timeout_s)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        elif not task.cancelled() and task.exception() is not None:
            log.warning("serve_endpoint failed: %r", task.exception())

    def control(self, engine: EngineControl) -> EngineControl:
        """The shutdown's engine control: ``abort_all`` also sets ``shutdown_event`` (the
        handlers end what they stream, as Dynamo's do)."""
        return _BackendControl(self, engine)


class _BackendControl:
    def __init__(self, backend: DynamoBackend, engine: EngineControl) -> None:
        self._backend = backend
        self._engine = engine

    async def abort_all(self, reason: str) -> int:
        self._backend.shutdown_event.set()
        return await self._engine.abort_all(reason)

    async def shutdown(self) -> None:
        await self._engine.shutdown()
