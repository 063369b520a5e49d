"""A drop-in for Dynamo's graceful-shutdown helper that drains instead of sleeping.

:func:`graceful_shutdown_with_drain` takes the same positional parameters as
``dynamo.common.utils.graceful_shutdown.graceful_shutdown_with_discovery`` 1.6.1
(``runtime, endpoints, shutdown_event, grace_period_s, drain_callback,
pre_shutdown_callback, cleanup_callback``); :func:`install_signal_handlers` the first four
of Dynamo's (``loop, runtime, endpoints, shutdown_event``), the rest by keyword. In order:

1. unregister (:class:`~.discovery.DynamoDiscovery`; the endpoints as they are when the
   signal comes: none yet during model load is not an error);
2. a short router grace (``grace_period_s``, default 0.5 s, while routers that already
   picked this worker still send; skipped when nothing was registered);
3. close the gate;
4. wait, woken by the gate, until nothing is admitted;
5. wait until the probe (if given) is quiescent;
6. the legacy ``drain_callback``, then ``pre_shutdown_callback``;
7. only then ``shutdown_event.set()`` (the event Dynamo's handlers treat as "abort what
   is left");
8. ``cleanup_callback``, then ``runtime.shutdown()`` — always, whatever failed before
   (a worker whose runtime is never shut down hangs until SIGKILL).

One budget (``budget_s``, measured from the call) bounds stages 1-5; each callback gets
``callback_timeout_s`` (default 30 s, Dynamo's cap). What is still admitted when the
budget runs out is left to ``shutdown_event`` (the abort), and the report says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from quiesce.admission import AdmissionGate, OutcomeCounts
from quiesce.budget import Deadline, check_seconds
from quiesce.discovery import describe_failure
from quiesce.drain import (
    DrainConfig,
    StageOutcome,
    StageReport,
    wait_admitted_zero,
    wait_quiescent,
)
from quiesce.errors import ConfigError
from quiesce.probe import QuiescenceProbe

from .discovery import DynamoDiscovery, DynamoEndpoint

log = logging.getLogger("quiesce.adapters.dynamo")

DEFAULT_ROUTER_GRACE_S = 0.5
DEFAULT_CALLBACK_TIMEOUT_S = 30.0

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


def _discovery_of(endpoints: Sequence[DynamoEndpoint] | DynamoDiscovery
                  ) -> DynamoDiscovery | None:
    """The discovery to drain; None (logged) when the endpoints are not endpoints."""
    if isinstance(endpoints, DynamoDiscovery):
        return endpoints
    try:
        return DynamoDiscovery(endpoints if isinstance(endpoints, list) else tuple(endpoints),
                               registered=True)
    except ConfigError as exc:
        log.error("cannot drain: %s", exc)
        return None


async def _drain(discovery: DynamoDiscovery, gate: AdmissionGate, *,
                 probe: QuiescenceProbe | None, grace: float, deadline: Deadline,
                 drain_config: DrainConfig, stages: list[StageReport],
                 clock: Callable[[], float]) -> bool:
    """Stages 1-5 of :func:`graceful_shutdown_with_drain`; True when drained."""
    # 1. unregister: routers stop picking this worker (none served yet: nothing to do)
    started = clock()
    try:
        was_registered = discovery.registered and bool(discovery.endpoints)
        await discovery.unregister(deadline)
        stages.append(StageReport("unregister", StageOutcome.COMPLETED, clock() - started))
    except Exception as exc:
        was_registered = True  # unknown: give the routers their grace
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
    grace = DEFAULT_ROUTER_GRACE_S if grace_period_s is None else grace_period_s
    drain_config = config if config is not None else DrainConfig(router_grace_s=grace)
    deadline = Deadline.after(budget_s, clock)
    stages: list[StageReport] = []
    drained = False
    at_start = gate.outcomes()
    try:
        # inside the try: whatever the endpoints are, the runtime is shut down below
        discovery = _discovery_of(endpoints)
        if discovery is None:
            stages.append(StageReport("unregister", StageOutcome.FAILED, 0.0,
                                      "the endpoints are not Dynamo endpoints"))
        drained = discovery is not None and await _drain(
            discovery, gate, probe=probe, grace=grace, deadline=deadline,
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


