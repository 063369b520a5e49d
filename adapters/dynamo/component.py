"""What every Dynamo worker component shares: the hooks, the probe, the model card, the control.

A component (:mod:`.vllm_component`, :mod:`.sglang_component`, :mod:`.trtllm_component`)
runs Dynamo's real ``dynamo.<engine>.main.worker(argv)`` in this process, unchanged except
for names it looks up at call time, each replaced before the worker starts. The subclass
lists them (:meth:`DynamoComponent.hooks`, :meth:`DynamoComponent.handlers`);
:meth:`DynamoComponent.install` imports Dynamo's modules, checks that every name exists
and only then replaces any (a missing name is a :class:`~quiesce.errors.ConfigError`
naming it, never a silent no-op). The shared parts:

- **shutdown recorder** — Dynamo's graceful-shutdown helper is never installed: the
  runtime, the live ``shutdown_endpoints`` list, ``shutdown_event`` and the callbacks are
  kept for :attr:`DynamoComponent.control`; the signals belong to the caller's
  :class:`~quiesce.shutdown.Shutdown`.
- **engine** — once Dynamo built it, :meth:`DynamoComponent.attach_engine` builds
  quiesce's own adapter probe over it (:meth:`DynamoComponent.build_probe`). If the
  adapter cannot read that object, or the worker's role is unknown, the probe is UNKNOWN
  with the reason (fail closed), never idle while serving.
- **model registration** — :meth:`DynamoComponent.registration` wraps Dynamo's call that
  registers the model card: once it returned, ``on_ready`` runs (the caller opens
  admission there) and the card can be unregistered (:class:`ModelRegistration`).
- **handlers** — each listed handler class's ``generate`` is admitted through the gate
  (:func:`~.gated.gated`, or :func:`~.gated_push.gated_push` for a push-egress handler);
  a closed gate raises Dynamo's ``WorkerUnavailable`` (HTTP 503, migratable by Dynamo's
  frontend). How each request ended is read from its chunks (the handler's outcome), or,
  for a handler that consumes the engine's results off its stream, from what one of its
  methods returns (:class:`EngineEnd`, wrapped at install).

Until the model is registered the probe answers idle (``dynamo.<engine>: never served``):
in the LLM worker each component runs, Dynamo serves the endpoints only once it called
the hooked registration (or refuses requests at the closed gate), so no request can have
reached the engine. From then on it is the engine's. That holds only for the worker
kinds a component hooks: every other kind (an encode, embedding or realtime worker...)
registers and serves through code no hook reaches, so each component refuses them
(:class:`~quiesce.errors.ConfigError`) as soon as Dynamo parsed its arguments.

:class:`ComponentControl` is the :class:`~quiesce.engine.EngineControl` the shutdown uses:
``abort_all`` aborts what the engine holds (the engine adapter's control) and sets
``shutdown_event`` (Dynamo's handlers then end their streams); ``shutdown`` runs Dynamo's
``pre_shutdown_callback`` and ``cleanup_callback`` if it gave them, sets
``shutdown_event``, and stops the worker — ``runtime.shutdown()`` once it serves (Dynamo's
own teardown then stops the engine), else the worker task is cancelled (its cleanup stops
an engine already started) — and waits for it to end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType
from typing import Any, ClassVar

from quiesce.admission import AdmissionGate, Outcome
from quiesce.engine import EngineControl
from quiesce.errors import ConfigError, WorkerDraining
from quiesce.probe import PendingWork, Probe, QuiescenceProbe, Role

from .gated import EngineEnds, FinishOutcome, gated
from .gated_push import gated_push

log = logging.getLogger("quiesce.adapters.dynamo.component")

GATED_MARK = "__quiesce_gated__"
CALLBACK_TIMEOUT_S = 30.0
"""Dynamo's own cap on each shutdown callback."""
CARD_ENDPOINT = (2, "endpoint")
"""Where ``dynamo.llm.register_model`` takes the endpoint: position, keyword."""
ERRORS_MODULE = "dynamo.llm.exceptions"
LLM_MODULE = "dynamo.llm"


def request_id_of(*args: Any, **kwargs: Any) -> str | None:
    """Dynamo's request id: ``context.id()`` (the runtime passes ``context`` by keyword)."""
    context = kwargs["context"] if "context" in kwargs else args[-1] if args else None
    try:
        return str(context.id())  # type: ignore[union-attr]
    except Exception:
        return None


@dataclasses.dataclass(frozen=True)
class Hook:
    """``module.name`` replaced by ``wrap(original)`` at install."""

    module: str
    name: str
    wrap: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class EngineEnd:
    """``cls.method`` (async) returns what says how the engine ended the request whose
    ``context`` is its last argument; ``outcome(result, context)`` reads it (None: says
    nothing). Recorded for :func:`~.gated.gated` (:class:`~.gated.EngineEnds`)."""

    method: str
    outcome: Callable[[Any, Any], Outcome | None]


@dataclasses.dataclass(frozen=True)
class GatedHandler:
    """``module.cls.generate`` admitted through the gate; ``outcome`` reads its chunks;
    ``push``: the method is Dynamo's push-egress dispatcher (``response_sender``);
    ``engine_end``: a pull handler's method whose result decides the outcome."""

    module: str
    cls: str
    outcome: FinishOutcome
    push: bool = False
    engine_end: EngineEnd | None = None


def _recording(method: Callable[..., Awaitable[Any]], ends: EngineEnds,
               read: Callable[[Any, Any], Outcome | None]) -> Callable[..., Awaitable[Any]]:
    """``method`` (:class:`EngineEnd`) that also records what its result says in ``ends``;
    its result and exceptions are unchanged."""

    @functools.wraps(method)
    async def recorded(*args: Any, **kwargs: Any) -> Any:
        result = await method(*args, **kwargs)
        context = kwargs["context"] if "context" in kwargs else args[-1]
        ended = read(result, context)
        if ended is not None:
            ends.record(context, ended)
        return result

    return recorded


class EngineProbe(Probe):
    """The engine's probe once the worker serves; idle before (module docstring)."""

    def __init__(self, source: str) -> None:
        super().__init__(Role.AGGREGATED, source)
        self.engine_probe: QuiescenceProbe | None = None
        self.problem: str | None = None
        """Why the engine cannot be read (UNKNOWN while serving), if it cannot."""
        self.served = False

    @property
    def role(self) -> Role:
        return self.engine_probe.role if self.engine_probe is not None else self._role

    async def pending_work(self) -> PendingWork:
        if not self.served:
            return PendingWork.idle(self._role, f"{self.source}: never served")
        if self.engine_probe is None:
            return PendingWork.unknown(self._role, self.source,
                                       self.problem or "serving without an engine")
        return await self.engine_probe.pending_work()

    async def wait_for_change(self, after: PendingWork, timeout: float) -> None:
        wait = getattr(self.engine_probe, "wait_for_change", None)
        await (wait(after, timeout) if wait is not None else asyncio.sleep(timeout))


class DynamoComponent:
    """Dynamo's ``dynamo.<name>`` worker with quiesce's admission, probe and shutdown.

    ``on_ready``: awaited once the model is registered, before the endpoints serve.
    Build it, :meth:`install`, then run :meth:`run` as a task. Not thread-safe.
    Subclasses set :attr:`name`, :attr:`requirement` and implement the four hooks.
    """

    name: ClassVar[str]
    """The engine: ``python -m dynamo.<name>``."""
    requirement: ClassVar[str]
    """What must be installed, for the error when Dynamo's modules do not import."""

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
        self.role: Role | None = None
        self.serving = False
        """The model is registered and the endpoints are (about to be) served."""
        self.model: ModelRegistration | None = None
        """The model card Dynamo registered for this worker (once it did)."""
        self._unregister_model: Callable[[Any], Awaitable[None]] | None = None
        self._callbacks: dict[str, Callable[[], Awaitable[object]] | None] = {}
        self.warnings: list[str] = []
        """What the operator must know about this worker (an untested engine accepted):
        logged, and in the ready line and ``GET /engine/status``."""
        self._probe = EngineProbe(f"dynamo.{self.name}")
        self._main: ModuleType | None = None
        self._task: asyncio.Task[None] | None = None

    # -- what each engine's component says ------------------------------------------

    def hooks(self) -> Sequence[Hook]:
        """The module-level names replaced before the worker runs (the first one's module
        is Dynamo's ``main``, whose ``worker`` :meth:`run` calls)."""
        raise NotImplementedError

    def handlers(self) -> Sequence[GatedHandler]:
        """The handler classes whose ``generate`` serves requests."""
        raise NotImplementedError

    def build_probe(self, engine: Any, role: Role) -> QuiescenceProbe:
        """quiesce's adapter probe over the engine Dynamo built; may raise (UNKNOWN then)."""
        raise NotImplementedError

    def engine_control(self) -> EngineControl | None:
        """The engine adapter's control over :attr:`engine`, or None without one."""
        raise NotImplementedError

    # -- the component --------------------------------------------------------------

    @property
    def probe(self) -> QuiescenceProbe:
        return self._probe

    @property
    def control(self) -> ComponentControl:
        return ComponentControl(self)

    def install(self) -> None:
        """Import Dynamo's modules and put quiesce's hooks in place (module docstring).

        Raises :class:`ConfigError` naming what is missing: ai-dynamo or the engine not
        importable, a Dynamo whose layout differs, or hooks installed already.
        """
        hooks, handlers = list(self.hooks()), list(self.handlers())
        names = [h.module for h in hooks] + [h.module for h in handlers] \
            + [ERRORS_MODULE, LLM_MODULE]
        try:
            modules = {name: importlib.import_module(name) for name in dict.fromkeys(names)}
        except ImportError as exc:
            raise ConfigError("dynamo", f"dynamo.{self.name} cannot be imported ({exc}): it "
                              f"needs {self.requirement}") from None
        main = modules[hooks[0].module]
        missing = [f"{h.module}.{h.name}" for h in hooks
                   if not callable(getattr(modules[h.module], h.name, None))]
        if not callable(getattr(main, "worker", None)):
            missing.append(f"{hooks[0].module}.worker")
        classes: dict[GatedHandler, Any] = {}
        for handler in handlers:
            cls: Any = getattr(modules[handler.module], handler.cls, None)
            methods = ["generate"] + ([handler.engine_end.method] if handler.engine_end
                                      else [])
            missing += [f"{handler.module}.{handler.cls}.{method}" for method in methods
                        if not callable(getattr(cls, method, None))]
            classes[handler] = cls
        self._unregister_model = getattr(modules[LLM_MODULE], "unregister_model", None)
        if self._unregister_model is None:
            missing.append(f"{LLM_MODULE}.unregister_model")
        unavailable = getattr(modules[ERRORS_MODULE], "WorkerUnavailable", None)
        if unavailable is None:
            missing.append(f"{ERRORS_MODULE}.WorkerUnavailable")
        if missing:
            raise ConfigError("dynamo", "this ai-dynamo does not have what quiesce hooks into "
                              f"(checked against 1.6.1): {', '.join(missing)}")
        gated_already = [h.cls for h in handlers if getattr(classes[h].generate, GATED_MARK,
                                                            False)]
        if gated_already:
            raise ConfigError("dynamo", f"{', '.join(gated_already)}.generate is gated "
                              "already: install() once per process")

        def refusal(refused: WorkerDraining) -> BaseException:
            return unavailable(f"worker is draining: {refused}")  # type: ignore[no-any-return, misc]

        for hook in hooks:
            module = modules[hook.module]
            setattr(module, hook.name, hook.wrap(getattr(module, hook.name)))
        for handler, cls in classes.items():
            if handler.push:
                cls.generate = gated_push(cls.generate, self.gate, request_id_of,
                                          outcome=handler.outcome, refusal=refusal)
            else:
                ends: EngineEnds | None = None
                if handler.engine_end is not None:
                    ends, name = EngineEnds(), handler.engine_end.method
                    setattr(cls, name, _recording(getattr(cls, name), ends,
                                                  handler.engine_end.outcome))
                cls.generate = gated(cls.generate, self.gate, request_id_of,
                                     outcome=handler.outcome, refusal=refusal, ends=ends)
            setattr(cls.generate, GATED_MARK, True)
        self._main = main

    async def run(self, argv: Sequence[str]) -> None:
        """Dynamo's worker, as ``python -m dynamo.<name> ARGV`` runs it (after :meth:`install`)."""
        if self._main is None:
            raise RuntimeError("install() first")
        self._task = asyncio.current_task()
        try:
            await self._main.worker(list(argv))
        except SystemExit as exc:  # Dynamo's argument parser refused ARGS (it printed why)
            raise ConfigError("args", f"dynamo.{self.name} refused its arguments "
                              f"(exit {exc.code})") from None

    # -- shared hooks ---------------------------------------------------------------

    def record_shutdown(  # noqa: PLR0917 (Dynamo's helper's positional order)
            self, loop: asyncio.AbstractEventLoop, runtime: Any, endpoints: list[Any],
            shutdown_event: asyncio.Event | None = None, grace_period_s: float | None = None,
            drain_callback: Callable[[], Awaitable[object]] | None = None,
            pre_shutdown_callback: Callable[[], Awaitable[object]] | None = None,
            cleanup_callback: Callable[[], Awaitable[object]] | None = None) -> None:
        """In place of ``dynamo.common.utils.graceful_shutdown.install_signal_handlers``
        (same parameters): keeps what the shutdown needs, installs no signal handler."""
        del loop, grace_period_s  # the caller's Shutdown owns the signals and the grace
        self.runtime, self.shutdown_event = runtime, shutdown_event
        if isinstance(endpoints, list):
            self.endpoints = endpoints
        self._callbacks = {"drain_callback": drain_callback,
                           "pre_shutdown": pre_shutdown_callback, "cleanup": cleanup_callback}
        log.info("Dynamo's graceful-shutdown helper replaced: quiesce drains this worker")

    def attach_engine(self, engine: Any, role: Role | None, why: str = "") -> None:
        """The engine Dynamo built: its probe from now on (UNKNOWN with the reason when
        the role is unknown — ``why`` says why — or the adapter cannot read it)."""
        self.engine, self.role = engine, role
        if role is None:
            self._probe.problem = f"the worker's role is unknown ({why})"
            log.error("probe: %s: UNKNOWN while serving", self._probe.problem)
            return
        try:
            self._probe.engine_probe = self.build_probe(engine, role)
        except Exception as exc:
            self._probe.problem = (f"quiesce's {self.name} probe cannot read the engine "
                                   f"Dynamo built ({type(exc).__name__}: {exc})")
            log.error("probe: %s: UNKNOWN while serving", self._probe.problem)
            return
        log.info("probe: %s engine of this Dynamo worker, role %s", self.name, role.value)

    def registration(self, register: Callable[..., Awaitable[Any]], endpoint_at: int,
                     endpoint_keyword: str) -> Callable[..., Awaitable[Any]]:
        """``register`` (Dynamo's call that registers the model card; its endpoint is
        positional argument ``endpoint_at`` or ``endpoint_keyword``) followed by
        ``on_ready``; the card can then be unregistered and registered again."""

        @functools.wraps(register)
        async def registered(*args: Any, **kwargs: Any) -> Any:
            result = await register(*args, **kwargs)
            endpoint = (args[endpoint_at] if len(args) > endpoint_at
                        else kwargs.get(endpoint_keyword))
            self.model = ModelRegistration(functools.partial(register, *args, **kwargs),
                                           endpoint, self._unregister_model)
            self.serving = self._probe.served = True
            if self.on_ready is not None:
                await self.on_ready()
            return result

        return registered

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
    """The model card Dynamo's worker registered, which is what Dynamo's frontend routes
    by: while it stays registered the frontend keeps picking the worker, endpoint instance
    unregistered or not (seen with 1.6.1: picked 5 s after the instances were
    unregistered, until the process exited). ``unregister`` removes it
    (``dynamo.llm.unregister_model``); ``register`` runs Dynamo's own registration call
    again with the arguments it was first called with."""

    def __init__(self, register: Callable[[], Awaitable[Any]], endpoint: Any,
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


class ComponentControl:
    """:class:`~quiesce.engine.EngineControl` of a :class:`DynamoComponent` (module docstring)."""

    def __init__(self, component: DynamoComponent) -> None:
        self.component = component

    async def abort_all(self, reason: str) -> int:
        component = self.component
        count = 0
        control = component.engine_control() if component.engine is not None else None
        if control is not None:
            count = await control.abort_all(reason)
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
