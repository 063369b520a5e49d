"""quiesce inside Dynamo's own worker components: ``dynamo.vllm`` (ai-dynamo 1.6.1).

:class:`VllmComponent` runs Dynamo's real ``dynamo.vllm.main.worker(argv)`` in this
process, unchanged except for four names it looks up at call time, each replaced before
the worker starts (all checked against ai-dynamo 1.6.1's ``dynamo/vllm/main.py``,
``worker_factory.py`` and ``handlers.py``; a missing name is a
:class:`~quiesce.errors.ConfigError` at start, never a silent no-op):

- ``main.install_signal_handlers`` — Dynamo's graceful-shutdown helper (unregister, sleep
  5 s, abort). Replaced by a recorder: the runtime, the live ``shutdown_endpoints`` list,
  ``shutdown_event`` and the callbacks are kept for :attr:`VllmComponent.control`; the
  signals belong to the caller's :class:`~quiesce.shutdown.Shutdown`.
- ``main.setup_vllm_engine`` — wrapped: once vLLM's ``AsyncLLM`` exists the probe reads it
  (:class:`~quiesce.adapters.vllm.VllmProbe`: EngineCore's own counts through quiesce's
  plugin, held KV sends on a prefill worker included).
- ``main.register_vllm_model`` — wrapped: when the model is registered, right before the
  endpoints are served, ``on_ready`` runs (the caller opens admission there).
- ``handlers.DecodeWorkerHandler.generate`` and ``PrefillWorkerHandler.generate`` — every
  request admitted through the gate (:func:`~.gated.gated`, outcomes from Dynamo's
  ``finish_reason``); a closed gate raises Dynamo's ``WorkerUnavailable`` (HTTP 503), the
  typed refusal Dynamo's frontend knows.

Until the model is registered the probe answers idle (``dynamo.vllm: never served``):
Dynamo serves the endpoints only after that, so no request can have reached the engine.
From then on it is the engine's (UNKNOWN if there is none).

:attr:`VllmComponent.control` is the :class:`~quiesce.engine.EngineControl` the shutdown
uses: ``abort_all`` aborts what vLLM holds and sets ``shutdown_event`` (Dynamo's handlers
then end their streams); ``shutdown`` runs Dynamo's ``pre_shutdown_callback``, sets
``shutdown_event``, and stops the worker — ``runtime.shutdown()`` once it serves (Dynamo's
graceful endpoint shutdown, then its own cleanup stops the engine), else the worker task
is cancelled (its cleanup stops an engine already started) — and waits for it to end.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType
from typing import Any

from quiesce.admission import AdmissionGate
from quiesce.budget import Deadline
from quiesce.discovery import DiscoveryUnavailable, describe_failure
from quiesce.errors import ConfigError, WorkerDraining
from quiesce.probe import PendingWork, Probe, QuiescenceProbe, Role

from .discovery import DynamoDiscovery
from .gated import finish_outcome, gated

log = logging.getLogger("quiesce.adapters.dynamo.components")

MAIN_NAMES = ("worker", "install_signal_handlers", "setup_vllm_engine", "register_vllm_model")
HANDLER_CLASSES = ("DecodeWorkerHandler", "PrefillWorkerHandler")
GATED_MARK = "__quiesce_gated__"
CALLBACK_TIMEOUT_S = 30.0
"""Dynamo's own cap on each shutdown callback."""


def _role_of(config: Any) -> Role:
    mode = str(getattr(getattr(config, "disaggregation_mode", None), "name", "")).lower()
    return {"prefill": Role.PREFILL, "decode": Role.DECODE}.get(mode, Role.AGGREGATED)


def _request_id(*args: Any, **kwargs: Any) -> str | None:
    """Dynamo's request id: ``context.id()`` (the runtime passes ``context`` by keyword)."""
    context = kwargs["context"] if "context" in kwargs else args[-1] if args else None
    try:
        return str(context.id())  # type: ignore[union-attr]
    except Exception:
        return None


class _EngineProbe(Probe):
    """The engine's probe once the worker serves; idle before (module docstring)."""

    def __init__(self) -> None:
        super().__init__(Role.AGGREGATED, "dynamo.vllm")
        self.engine_probe: QuiescenceProbe | None = None
        self.served = False

    @property
    def role(self) -> Role:
        return self.engine_probe.role if self.engine_probe is not None else self._role

    async def pending_work(self) -> PendingWork:
        if not self.served:
            return PendingWork.idle(self._role, "dynamo.vllm: never served")
        if self.engine_probe is None:
            return PendingWork.unknown(self._role, "dynamo.vllm", "serving without an engine")
        return await self.engine_probe.pending_work()

    async def wait_for_change(self, after: PendingWork, timeout: float) -> None:
        wait = getattr(self.engine_probe, "wait_for_change", None)
        await (wait(after, timeout) if wait is not None else asyncio.sleep(timeout))


class VllmComponent:
    """Dynamo's ``dynamo.vllm`` worker with quiesce's admission, probe and shutdown.

    ``on_ready``: awaited once the model is registered, before the endpoints serve.
    Build it, :meth:`install`, then run :meth:`run` as a task. Not thread-safe.
    """

    def __init__(self, gate: AdmissionGate,
                 on_ready: Callable[[], Awaitable[None]] | None = None) -> None:
        if not isinstance(gate, AdmissionGate):
            raise ConfigError("gate", f"must be an AdmissionGate, got {type(gate).__name__}")
        self.gate = gate
        self.on_ready = on_ready
        self.endpoints: list[Any] = []
        """Dynamo's ``shutdown_endpoints``, filled in place by its worker."""
        self.runtime: Any = None
        self.shutdown_event: asyncio.Event | None = None
        self.engine: Any = None
        self.serving = False
        """The model is registered and the endpoints are (about to be) served."""
        self.model: ModelRegistration | None = None
        """The model card Dynamo registered for this worker (once it did)."""
        self._unregister_model: Callable[[Any], Awaitable[None]] | None = None
        self._callbacks: dict[str, Callable[[], Awaitable[object]] | None] = {}
        self._probe = _EngineProbe()
        self._main: ModuleType | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def probe(self) -> QuiescenceProbe:
        return self._probe

    @property
    def control(self) -> VllmComponentControl:
        return VllmComponentControl(self)

    def install(self) -> None:
        """Import ``dynamo.vllm`` and put quiesce's hooks in place (module docstring).

        Raises :class:`ConfigError` naming what is missing: ai-dynamo or vLLM not
        importable, or a Dynamo whose layout differs.
        """
        try:
            main = importlib.import_module("dynamo.vllm.main")
            handlers = importlib.import_module("dynamo.vllm.handlers")
            errors = importlib.import_module("dynamo.llm.exceptions")
        except ImportError as exc:
            raise ConfigError("dynamo", f"dynamo.vllm cannot be imported ({exc}): it needs "
                              "ai-dynamo 1.6.1 and the vLLM it pins (0.31); "
                              "ci/setup_dynamo.sh shows how to install them") from None
        missing = [name for name in MAIN_NAMES if not callable(getattr(main, name, None))]
        missing += [f"handlers.{name}.generate" for name in HANDLER_CLASSES
                    if not callable(getattr(getattr(handlers, name, None), "generate", None))]
        llm = importlib.import_module("dynamo.llm")
        self._unregister_model = getattr(llm, "unregister_model", None)
        if self._unregister_model is None:
            missing.append("dynamo.llm.unregister_model")
        unavailable = getattr(errors, "WorkerUnavailable", None)
        if unavailable is None:
            missing.append("dynamo.llm.exceptions.WorkerUnavailable")
        if missing:
            raise ConfigError("dynamo", "this ai-dynamo does not have what quiesce hooks into "
                              f"(checked against 1.6.1): {', '.join(missing)}")
        main.install_signal_handlers = self._record_shutdown  # type: ignore[attr-defined]
        main.setup_vllm_engine = self._wrap_setup(main.setup_vllm_engine)  # type: ignore[attr-defined]
        main.register_vllm_model = self._wrap_register(main.register_vllm_model)  # type: ignore[attr-defined]

        def refusal(refused: WorkerDraining) -> BaseException:
            return unavailable(f"worker is draining: {refused}")  # type: ignore[no-any-return, misc]

        for name in HANDLER_CLASSES:
            cls = getattr(handlers, name)
            if getattr(cls.generate, GATED_MARK, False):
                raise ConfigError("dynamo", f"{name}.generate is gated already: install() "
                                  "once per process")
            cls.generate = gated(cls.generate, self.gate, _request_id,
                                 outcome=finish_outcome, refusal=refusal)
            setattr(cls.generate, GATED_MARK, True)
        self._main = main

    async def run(self, argv: Sequence[str]) -> None:
        """Dynamo's worker, as ``python -m dynamo.vllm ARGV`` runs it (after :meth:`install`)."""
        if self._main is None:
            raise RuntimeError("install() first")
        self._task = asyncio.current_task()
        try:
            await self._main.worker(list(argv))
        except SystemExit as exc:  # Dynamo's argument parser refused ARGS (it printed why)
            raise ConfigError("args", f"dynamo.vllm refused its arguments (exit {exc.code})"
                              ) from None

    # -- the hooks ------------------------------------------------------------------

    def _record_shutdown(  # noqa: PLR0917 (Dynamo's helper's positional order)
            self, loop: asyncio.AbstractEventLoop, runtime: Any,
                         endpoints: list[Any], shutdown_event: asyncio.Event | None = None,
                         grace_period_s: float | None = None,
                         drain_callback: Callable[[], Awaitable[object]] | None = None,
                         pre_shutdown_callback: Callable[[], Awaitable[object]] | None = None,
                         cleanup_callback: Callable[[], Awaitable[object]] | None = None
                         ) -> None:
        del loop, grace_period_s  # the caller's Shutdown owns the signals and the grace
        self.runtime, self.shutdown_event = runtime, shutdown_event
        if isinstance(endpoints, list):
            self.endpoints = endpoints
        self._callbacks = {"drain_callback": drain_callback,
                           "pre_shutdown": pre_shutdown_callback, "cleanup": cleanup_callback}
        log.info("Dynamo's graceful-shutdown helper replaced: quiesce drains this worker")

    def _wrap_setup(self, setup: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(setup)
        def setup_vllm_engine(config: Any, *args: Any, **kwargs: Any) -> Any:
            result = setup(config, *args, **kwargs)
            from quiesce.adapters.vllm import VllmProbe  # noqa: PLC0415 (needs vLLM)

            self.engine = result[0]
            role = _role_of(config)
            self._probe.engine_probe = VllmProbe(self.engine, role)
            log.info("probe: vLLM engine of this Dynamo worker, role %s", role.value)
            return result

        return setup_vllm_engine

    def _wrap_register(self, register: Callable[..., Awaitable[None]]
                       ) -> Callable[..., Awaitable[None]]:
        @functools.wraps(register)
        async def register_vllm_model(*args: Any, **kwargs: Any) -> None:
            await register(*args, **kwargs)
            endpoint = args[2] if len(args) > 2 else kwargs.get("generate_endpoint")
            self.model = ModelRegistration(functools.partial(register, *args, **kwargs),
                                           endpoint, self._unregister_model)
            self.serving = self._probe.served = True
            if self.on_ready is not None:
                await self.on_ready()

        return register_vllm_model

    async def run_callback(self, name: str, timeout_s: float) -> None:
        """Dynamo's ``drain_callback``/``pre_shutdown``/``cleanup`` if it gave one, capped;
        a failure is logged (Dynamo's helper does the same)."""
        callback = self._callbacks.get(name)
        if callback is None:
            return
        try:
            await asyncio.wait_for(callback(), timeout_s)
        except Exception as exc:  # includes the timeout
            log.warning("Dynamo's %s callback failed: %r", name, exc)


class ModelRegistration:
    """The model card Dynamo's worker registered (``register_vllm_model``), which is what
    Dynamo's frontend routes by: while it stays registered the frontend keeps picking the
    worker, endpoint instance unregistered or not (seen with 1.6.1: picked 5 s after the
    instances were unregistered, until the process exited). ``unregister`` removes it
    (``dynamo.llm.unregister_model``); ``register`` runs Dynamo's own registration again
    with the arguments it was first called with."""

    def __init__(self, register: Callable[[], Awaitable[None]], endpoint: Any,
                 unregister: Callable[[Any], Awaitable[None]] | None) -> None:
        self._register = register
        self._unregister = unregister
        self.endpoint = endpoint

    async def unregister(self) -> None:
        if self._unregister is None or self.endpoint is None:
            raise RuntimeError("Dynamo's model registration cannot be undone here")
        await self._unregister(self.endpoint)

    async def register(self) -> None:
        await self._register()


class ComponentDiscovery:
    """:class:`~quiesce.discovery.Discovery` of a Dynamo worker component: its model card
    and its endpoint instances (:class:`~.discovery.DynamoDiscovery`), unregistered in that
    order (the frontend stops routing by the card) and registered in the reverse.

    Before the worker registered its model there is no card: only the instances count.
    A failure leaves the state unknown (``registered`` stays True), with the reason.
    """

    def __init__(self, component: VllmComponent, instances: DynamoDiscovery,
                 rpc_timeout_s: float = 5.0) -> None:
        self.component = component
        self.instances = instances
        self._rpc_timeout_s = rpc_timeout_s
        self._error: str | None = None

    @property
    def registered(self) -> bool:
        return self._error is not None or self.instances.registered

    @property
    def registration_error(self) -> str | None:
        return self._error or self.instances.registration_error

    def served(self) -> None:
        self._error = None
        self.instances.served()

    async def _bounded(self, what: str, call: Callable[[], Awaitable[None]],
                       deadline: Deadline | None) -> None:
        timeout = self._rpc_timeout_s if deadline is None else min(
            self._rpc_timeout_s, max(deadline.remaining(), 0.001))
        started = time.monotonic()
        try:
            await asyncio.wait_for(call(), timeout)
        except (Exception, asyncio.CancelledError) as exc:
            self._error = f"{what}: {describe_failure(exc)}"
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise DiscoveryUnavailable("dynamo", what, 1, time.monotonic() - started,
                                       self._error) from exc
        self._error = None

    async def unregister(self, deadline: Deadline | None = None) -> None:
        model = self.component.model
        if model is not None and self.instances.registered:
            await self._bounded("unregister the model", model.unregister, deadline)
        await self.instances.unregister(deadline)

    async def register(self, deadline: Deadline | None = None) -> None:
        await self.instances.register(deadline)
        model = self.component.model
        if model is not None:
            await self._bounded("register the model", model.register, deadline)


class VllmComponentControl:
    """:class:`~quiesce.engine.EngineControl` of a :class:`VllmComponent` (module docstring)."""

    def __init__(self, component: VllmComponent) -> None:
        self.component = component

    async def abort_all(self, reason: str) -> int:
        component = self.component
        count = 0
        if component.engine is not None:
            from quiesce.adapters.vllm import VllmEngineControl  # noqa: PLC0415 (needs vLLM)

            count = await VllmEngineControl(component.engine).abort_all(reason)
        if component.shutdown_event is not None:
            component.shutdown_event.set()  # Dynamo's handlers end what they still stream
        return max(count, component.gate.inflight)

    async def shutdown(self) -> None:
        component = self.component
        await component.run_callback("pre_shutdown", CALLBACK_TIMEOUT_S)
        if component.shutdown_event is not None:
            component.shutdown_event.set()
        await component.run_callback("cleanup", CALLBACK_TIMEOUT_S)
        task = component._task
        if component.serving and component.runtime is not None:
            component.runtime.shutdown()  # serve_endpoint returns; Dynamo stops the engine
        elif task is not None and not task.done():
            task.cancel()  # not serving yet: its cleanup stops an engine already built
        if task is not None:
            await asyncio.wait({task})
        if component.runtime is not None and not component.serving:
            component.runtime.shutdown()
