"""NVIDIA Dynamo: discovery over the runtime's endpoint instances, and a drain on SIGTERM.

Three pieces, for a worker that serves Dynamo endpoints with ``ai-dynamo-runtime``
(``pip install 'quiesce[dynamo]'``; checked against 1.6.1):

- :class:`DynamoDiscovery` — :class:`~quiesce.discovery.Discovery` over one or more served
  ``dynamo.runtime.Endpoint`` objects: ``unregister()`` calls each one's
  ``unregister_endpoint_instance()`` (routers and ``Client.instance_ids()`` drop the
  instance; about a millisecond with the ``file`` backend on loopback) and ``register()``
  its ``register_endpoint_instance()``. Each call is tried with a per-attempt timeout
  (``rpc_timeout_s``) and retried after a doubling backoff (20 ms .. 0.5 s) within
  ``retry_budget_s`` or the caller's :class:`~quiesce.budget.Deadline`, whichever is
  earlier. A "not found" answer to an unregister counts as done (already gone). When the
  budget runs out it raises :class:`DiscoveryUnavailable`; the state is then *unknown*:
  ``registered`` stays True (fail closed) and ``registration_error`` holds the reason
  (:func:`quiesce.discovery.registration_state`). The runtime's own lease (etcd) or file
  TTL still removes the instance if the process dies.
- :func:`gated` — wraps an endpoint handler so that each request is admitted through an
  :class:`~quiesce.admission.AdmissionGate` (a closed gate raises the typed, retryable
  :class:`~quiesce.errors.WorkerDraining` before any work) and released when its stream
  ends, whatever way it ends.
- :func:`graceful_shutdown_with_drain` / :func:`install_signal_handlers` — a drop-in for
  the graceful-shutdown helper of Dynamo's components (same positional parameters:
  ``runtime, endpoints, shutdown_event, grace_period_s, drain_callback,
  pre_shutdown_callback, cleanup_callback``) that *drains instead of sleeping a fixed
  grace period*: unregister; a short router grace (``grace_period_s``, default
  0.5 s, while routers that already picked this worker still send); close the gate; wait,
  woken by the gate, until nothing is admitted; wait until the probe (if given) is
  quiescent; the legacy ``drain_callback``; ``pre_shutdown_callback``; only then
  ``shutdown_event.set()`` (the event Dynamo's backends treat as "abort what is left");
  ``cleanup_callback``; ``runtime.shutdown()``. One budget (``budget_s``, measured from the
  call) bounds unregister to engine; each callback gets ``callback_timeout_s`` (default
  30 s, Dynamo's cap) and never past the budget plus that cap. What is still admitted when
  the budget runs out is left to ``shutdown_event`` (the abort), and the report says so.

Nothing here imports ``dynamo`` except :func:`loopback_runtime` (lazily; without it:
:class:`~quiesce.errors.EngineNotInstalled`), so the discovery and the shutdown work with
any object that has the two endpoint methods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, cast

from quiesce.admission import AdmissionGate, Outcome, OutcomeCounts
from quiesce.budget import Deadline, check_seconds
from quiesce.discovery import DiscoveryUnavailable, describe_failure, retry_within
from quiesce.drain import (
    DrainConfig,
    StageOutcome,
    StageReport,
    wait_admitted_zero,
    wait_quiescent,
)
from quiesce.errors import ConfigError, EngineNotInstalled
from quiesce.probe import QuiescenceProbe

__all__ = ["DiscoveryUnavailable", "DynamoDiscovery", "ShutdownReport", "gated",
           "graceful_shutdown_with_drain", "install_signal_handlers", "loopback_runtime"]

log = logging.getLogger("quiesce.adapters.dynamo")

DEFAULT_ROUTER_GRACE_S = 0.5
DEFAULT_CALLBACK_TIMEOUT_S = 30.0
LOOPBACK_ENV = {
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE": "zmq",
}
"""Environment that keeps the runtime's TCP request plane and event plane on loopback."""



class DynamoEndpoint(Protocol):
    """The two methods of ``dynamo.runtime.Endpoint`` that discovery uses."""

    async def unregister_endpoint_instance(self) -> None: ...

    async def register_endpoint_instance(self) -> None: ...


def _already_gone(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "could not find key" in text or "not found" in text


class DynamoDiscovery:
    """:class:`~quiesce.discovery.Discovery` over served Dynamo endpoint instances.

    ``registered`` is the state at construction: True when ``serve_endpoint`` already
    registered the instances (its default), False to let ``Lifecycle.start()`` register.
    Bad input raises :class:`ConfigError` and changes nothing.
    """

    def __init__(self, endpoints: DynamoEndpoint | Sequence[DynamoEndpoint], *,
                 registered: bool = True, rpc_timeout_s: float = 2.0,
                 retry_budget_s: float = 5.0) -> None:
        items = (cast("list[DynamoEndpoint]", list(endpoints))
                 if isinstance(endpoints, (list, tuple)) else [cast("DynamoEndpoint", endpoints)])
        if not items:
            raise ConfigError("endpoints", "needs at least one endpoint")
        for item in items:
            if not (callable(getattr(item, "unregister_endpoint_instance", None))
                    and callable(getattr(item, "register_endpoint_instance", None))):
                raise ConfigError("endpoints", f"{type(item).__name__} has no "
                                  "register/unregister_endpoint_instance: pass "
                                  "dynamo.runtime.Endpoint objects")
        if not isinstance(registered, bool):
            raise ConfigError("registered", f"must be a bool, got {registered!r}")
        check_seconds("rpc_timeout_s", rpc_timeout_s, allow_zero=False)
        check_seconds("retry_budget_s", retry_budget_s, allow_zero=False)
        self._endpoints: list[DynamoEndpoint] = items
        self._state: bool | None = registered
        self._error: str | None = None
        self._rpc_timeout_s = rpc_timeout_s
        self._retry_budget_s = retry_budget_s
        self._lock = asyncio.Lock()

    @property
    def registered(self) -> bool:
        return self._state is not False

    @property
    def registration_error(self) -> str | None:
        return self._error if self._state is None else None

    def _deadline(self, deadline: Deadline | None) -> Deadline:
        own = Deadline.after(self._retry_budget_s)
        return own if deadline is None or deadline.at > own.at else deadline

    async def register(self, deadline: Deadline | None = None) -> None:
        """Register every endpoint instance. Idempotent while registered. Raises
        :class:`DiscoveryUnavailable` (state unknown) when the budget runs out."""
        async with self._lock:
            if self._state is True:
                return
            limit = self._deadline(deadline)
            try:
                for endpoint in self._endpoints:
                    await retry_within("dynamo", "register",
                                       endpoint.register_endpoint_instance, limit,
                                       self._rpc_timeout_s)
            except BaseException as exc:
                self._state, self._error = None, describe_failure(exc)
                raise
            self._state, self._error = True, None

    async def unregister(self, deadline: Deadline | None = None) -> None:
        """Unregister every endpoint instance. Idempotent when unregistered. Raises
        :class:`DiscoveryUnavailable` (state unknown) when the budget runs out."""
        async with self._lock:
            if self._state is False:
                return
            limit = self._deadline(deadline)

            async def unregister_one(endpoint: DynamoEndpoint) -> None:
                try:
                    await endpoint.unregister_endpoint_instance()
                except Exception as exc:
                    if not _already_gone(exc):
                        raise

            try:
                for endpoint in self._endpoints:
                    await retry_within("dynamo", "unregister",
                                       functools.partial(unregister_one, endpoint), limit,
                                       self._rpc_timeout_s)
            except BaseException as exc:
                self._state, self._error = None, describe_failure(exc)
                raise
            self._state, self._error = False, None


Handler = Callable[..., AsyncIterator[Any]]


def gated(handler: Handler, gate: AdmissionGate,
          request_id: Callable[..., str | None] | None = None) -> Handler:
    """``handler`` with each request admitted through ``gate``.

    A closed gate raises :class:`~quiesce.errors.WorkerDraining` before the handler
    runs (the Dynamo client gets an error it may retry elsewhere). A stream that ends
    normally counts ``completed``; an exception or a cancellation counts as the gate's
    usual outcome for it (:meth:`~quiesce.admission.Admission.end_by`).
    """
    if not callable(handler):
        raise ConfigError("handler", "must be an async generator function")
    if not isinstance(gate, AdmissionGate):
        raise ConfigError("gate", f"must be an AdmissionGate, got {type(gate).__name__}")

    async def admitted(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        rid = request_id(*args, **kwargs) if request_id is not None else None
        with gate.admit(rid) as admission:
            async for item in handler(*args, **kwargs):
                yield item
            admission.finish(Outcome.COMPLETED)

    admitted.__name__ = getattr(handler, "__name__", "handler")
    admitted.__doc__ = handler.__doc__
    return admitted


@dataclasses.dataclass(frozen=True)
class ShutdownReport:
    """What :func:`graceful_shutdown_with_drain` did, stage by stage."""

    stages: tuple[StageReport, ...]
    drained: bool
    """Nothing was admitted (and the probe, if any, was quiescent) before the abort
    signal (``shutdown_event``) was set, and no admitted request ended ``lost`` since
    the drain began."""
    left_inflight: int
    """Requests still admitted when ``shutdown_event`` was set (left to the abort)."""
    ended: OutcomeCounts = dataclasses.field(default_factory=OutcomeCounts)
    """How the admitted requests that ended since the drain began ended (up to the
    abort signal)."""

    def to_dict(self) -> dict[str, object]:
        return {"drained": self.drained, "left_inflight": self.left_inflight,
                "lost_requests": self.ended.lost, "requests": self.ended.to_dict(),
                "stages": [s.to_dict() for s in self.stages]}


async def _bounded_callback(name: str, callback: Callable[[], Awaitable[object]] | None,
                            timeout_s: float, clock: Callable[[], float]) -> StageReport:
    if callback is None:
        return StageReport(name, StageOutcome.SKIPPED, 0.0, "no callback")
    started = clock()
    try:
        await asyncio.wait_for(callback(), timeout_s)
    except (TimeoutError, asyncio.TimeoutError):
        return StageReport(name, StageOutcome.TIMED_OUT, clock() - started,
                           f"did not return within {timeout_s:g}s")
    except Exception as exc:
        log.exception("%s callback failed", name)
        return StageReport(name, StageOutcome.FAILED, clock() - started, describe_failure(exc))
    return StageReport(name, StageOutcome.COMPLETED, clock() - started)


async def _drain(discovery: DynamoDiscovery, gate: AdmissionGate, *,
                 probe: QuiescenceProbe | None, grace: float, deadline: Deadline,
                 drain_config: DrainConfig, stages: list[StageReport],
                 clock: Callable[[], float]) -> bool:
    """Stages 1-5 of :func:`graceful_shutdown_with_drain`; True when drained."""
    # 1. unregister: routers stop picking this worker
    started = clock()
    was_registered = discovery.registered
    try:
        await discovery.unregister(deadline)
        stages.append(StageReport("unregister", StageOutcome.COMPLETED, clock() - started))
    except Exception as exc:
        log.error("unregister failed, draining anyway: %s", exc)
        stages.append(StageReport("unregister", StageOutcome.FAILED, clock() - started,
                                  describe_failure(exc)))

    # 2. router grace: routers that already picked us are still sending
    started = clock()
    wait = min(grace, deadline.remaining())
    if was_registered and wait > 0:
        await asyncio.sleep(wait)
        stages.append(StageReport("router_grace", StageOutcome.COMPLETED, clock() - started))
    else:
        stages.append(StageReport("router_grace", StageOutcome.SKIPPED, 0.0,
                                  "was not registered" if not was_registered
                                  else "no grace configured or no budget left"))

    # 3-5. close admission, wait for admitted requests, then for the engine
    gate.close("draining")
    stages.append(StageReport("close_admission", StageOutcome.COMPLETED, 0.0))
    report = await wait_admitted_zero(gate, deadline, clock)
    stages.append(report)
    if report.outcome is not StageOutcome.COMPLETED:
        return False
    if probe is None:
        stages.append(StageReport("engine", StageOutcome.SKIPPED, 0.0, "no probe"))
        return True
    report, _ = await wait_quiescent(probe, deadline, drain_config, None, clock)
    stages.append(report)
    return report.outcome is StageOutcome.COMPLETED


async def graceful_shutdown_with_drain(  # noqa: PLR0917 (Dynamo's positional order)
        runtime: Any, endpoints: Sequence[DynamoEndpoint] | DynamoDiscovery,
        shutdown_event: asyncio.Event | None = None, grace_period_s: float | None = None,
        drain_callback: Callable[[], Awaitable[object]] | None = None,
        pre_shutdown_callback: Callable[[], Awaitable[object]] | None = None,
        cleanup_callback: Callable[[], Awaitable[object]] | None = None, *,
        gate: AdmissionGate, probe: QuiescenceProbe | None = None, budget_s: float = 30.0,
        callback_timeout_s: float = DEFAULT_CALLBACK_TIMEOUT_S,
        config: DrainConfig | None = None,
        clock: Callable[[], float] = time.monotonic) -> ShutdownReport:
    """Unregister, drain, then shut the runtime down (see the module docstring).

    ``endpoints``: the served endpoints, or the worker's :class:`DynamoDiscovery`.
    ``grace_period_s``: the router grace (default 0.5 s; Dynamo's helper sleeps 5 s and
    then aborts); never longer than the budget. Raises :class:`ConfigError` for bad
    arguments before doing anything; otherwise never raises: each stage's outcome is in
    the report, and ``runtime.shutdown()`` is always called.
    """
    check_seconds("grace_period_s", grace_period_s, allow_none=True)
    check_seconds("budget_s", budget_s, allow_zero=False)
    check_seconds("callback_timeout_s", callback_timeout_s, allow_zero=False)
    if not isinstance(gate, AdmissionGate):
        raise ConfigError("gate", f"must be an AdmissionGate, got {type(gate).__name__}")
    discovery = (endpoints if isinstance(endpoints, DynamoDiscovery)
                 else DynamoDiscovery(list(endpoints), registered=True))
    grace = DEFAULT_ROUTER_GRACE_S if grace_period_s is None else grace_period_s
    drain_config = config if config is not None else DrainConfig(router_grace_s=grace)
    deadline = Deadline.after(budget_s, clock)
    stages: list[StageReport] = []
    drained = False
    at_start = gate.outcomes()
    try:
        drained = await _drain(discovery, gate, probe=probe, grace=grace, deadline=deadline,
                               drain_config=drain_config, stages=stages, clock=clock)
        # 6-7. the legacy hooks, each capped
        stages.append(await _bounded_callback("drain_callback", drain_callback,
                                              callback_timeout_s, clock))
        stages.append(await _bounded_callback("pre_shutdown", pre_shutdown_callback,
                                              callback_timeout_s, clock))
    finally:
        # 8. only now: what is still admitted is aborted by the backend's handlers
        left, ended = gate.inflight, gate.outcomes() - at_start
        gate.close("stopping")
        if shutdown_event is not None:
            shutdown_event.set()
        # 9-10. cleanup, then the runtime's own (graceful) shutdown
        stages.append(await _bounded_callback("cleanup", cleanup_callback,
                                              callback_timeout_s, clock))
        started = clock()
        try:
            runtime.shutdown()
            stages.append(StageReport("runtime_shutdown", StageOutcome.COMPLETED,
                                      clock() - started))
        except Exception as exc:
            log.exception("runtime.shutdown() failed")
            stages.append(StageReport("runtime_shutdown", StageOutcome.FAILED,
                                      clock() - started, describe_failure(exc)))
    # drained is a claim about every request admitted: none may have been lost on the way
    result = ShutdownReport(tuple(stages), drained and left == 0 and ended.lost == 0, left,
                            ended)
    log.info("dynamo worker shutdown: %s", result.to_dict())
    return result


def install_signal_handlers(loop: asyncio.AbstractEventLoop, runtime: Any,
                            endpoints: Sequence[DynamoEndpoint] | DynamoDiscovery,
                            shutdown_event: asyncio.Event | None = None,
                            on_done: Callable[[ShutdownReport], None] | None = None,
                            **kwargs: Any) -> Callable[[], asyncio.Task[ShutdownReport] | None]:
    """Run :func:`graceful_shutdown_with_drain` on the first SIGTERM or SIGINT.

    ``kwargs`` go to it (``gate`` is required). A repeated signal while it runs is
    logged and ignored: the drain already holds one budget. Returns a function that
    gives the shutdown task once it started (else ``None``).
    """
    if "gate" not in kwargs:
        raise ConfigError("gate", "install_signal_handlers needs gate=AdmissionGate")
    task: asyncio.Task[ShutdownReport] | None = None

    def report_to(callback: Callable[[ShutdownReport], None]
                  ) -> Callable[[asyncio.Task[ShutdownReport]], None]:
        def done(finished: asyncio.Task[ShutdownReport]) -> None:
            if not finished.cancelled() and finished.exception() is None:
                callback(finished.result())
        return done

    def on_signal(signum: int) -> None:
        nonlocal task
        if task is not None:
            log.warning("signal %s again: the drain is already running", signum)
            return
        log.info("signal %s: unregistering and draining", signum)
        task = loop.create_task(graceful_shutdown_with_drain(
            runtime, endpoints, shutdown_event, **kwargs), name="quiesce-dynamo-shutdown")
        if on_done is not None:
            task.add_done_callback(report_to(on_done))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    return lambda: task


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
