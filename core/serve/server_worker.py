"""quiesce's worker inside an engine's own HTTP server, shared by every such face.

A face (:mod:`quiesce.serve.vllm_serve`, :mod:`quiesce.serve.sglang_serve`) is an ASGI
middleware in the engine's app: a subclass of :class:`ServerMiddleware` that says how to
reach the engine of a started app (:meth:`ServerMiddleware.host`: an :class:`EngineHost`).
Everything else is here, the same for every engine:

- admission: every generation request through the gate
  (:mod:`quiesce.serve.asgi_admission`, with the face's routes), from the first request;
- at the app's lifespan startup complete (the engine is up, the server's own signal
  handlers are set), :class:`ServerWorker` starts, in this order:

  1. the probe and the role (the host's);
  2. the signals: the engine's processes hold SIGTERM/SIGINT from now on
     (:meth:`~quiesce.signal_guard.SignalOwnership.hold`), the host keeps the server's own
     handlers from coming back (:meth:`EngineHost.take_signals`), and the first SIGTERM or
     SIGINT to the server process starts quiesce's shutdown (a second one exits at once,
     code 4, taking the engine's processes along);
  3. the admin API on its own port (drain, resume, status with outcomes and ETA, metrics;
     ``quiesce prestop`` works against it), the lifecycle's metrics in prometheus' default
     registry (the engines' ``/metrics``), and the pod's deletion cost if asked;
  4. admission opens; once the server listens, one JSON line ``{"event": "ready", ...}``
     on stdout.

- On the first signal, :class:`~quiesce.shutdown.Shutdown` runs on one budget: readiness
  fails at once, the router grace passes, admission closes, admitted requests reach zero,
  the engine is quiescent (held KV sends included); then the engine's own shutdown (the
  host's control, after the signal guard permits it) and the server is told to stop
  (:meth:`EngineHost.stop_server`). One JSON line ``{"event": "exit", ...}`` with the
  report, and the process ends with the report's exit code (0 drained, 3 forced, 5 lost;
  :mod:`quiesce.shutdown`) without the interpreter's teardown (:func:`end`).
- If the server stops by itself (an engine failure) with no signal, the worker logs how
  every admitted request ended and prints the exit line with ``"outcome":
  "server_stopped"``; the engine's own unwinding follows, and its exit code stands unless
  an admitted request was lost: then the process exits 5
  (:func:`~quiesce.serve.server_claim.exit_with`), never 0 with a lost request.

Refusals (``lifespan.startup.failed`` with the reason: uvicorn exits with its
startup-failure code, 3, the engine's unwinding stops the engine, nothing was served): no
claim was made in this process (:mod:`quiesce.serve.server_claim`), or the host refuses
(:meth:`ServerMiddleware.host` raises ConfigError).
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import os
import sys
from typing import Any, Protocol

from quiesce.admin.server import LISTEN_BACKLOG
from quiesce.admin.worker_admin import WorkerAdmin
from quiesce.admission import AdmissionGate
from quiesce.discovery import InMemoryDiscovery
from quiesce.engine import EngineControl
from quiesce.errors import ConfigError
from quiesce.lifecycle import Lifecycle
from quiesce.probe import QuiescenceProbe, Role
from quiesce.serve.asgi_admission import (
    AdmissionMiddleware,
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    ServerRoutes,
)
from quiesce.serve.server_claim import Claim, current_claim, exit_with
from quiesce.serve.server_options import ServerOptions
from quiesce.shutdown import EXIT_FORCED, EXIT_LOST, Shutdown

log = logging.getLogger("quiesce.serve.server_worker")

__all__ = ["EngineHost", "ServerMiddleware", "ServerWorker", "end"]


class EngineHost(Protocol):
    """What a face knows of the started engine server it runs inside."""

    server: str
    """The server's name in logs and the ready line (``vllm serve``, ``sglang``)."""
    role: Role
    probe: QuiescenceProbe
    control: EngineControl

    def listening(self) -> bool:
        """Whether the server accepts connections now (cheap, non-blocking)."""

    def take_signals(self) -> None:
        """Keep the server's own SIGTERM/SIGINT handlers from coming back once quiesce's
        are set (called just before; nothing to do where the server sets them once)."""

    def stop_server(self) -> None:
        """Ask the server to stop serving and return (after the engine's shutdown)."""

    def status(self) -> dict[str, object]:
        """What the admin API's status adds about the server."""


def _emit(event: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class ServerWorker:
    """quiesce's worker around a started engine server (module docstring, steps 1-4)."""

    def __init__(self, claim: Claim, host: EngineHost, admission: AdmissionMiddleware) -> None:
        options = claim.options
        self.claim = claim
        self.host = host
        self.gate = AdmissionGate(accepting=False)  # opened by the lifecycle's start
        self.lifecycle = Lifecycle(gate=self.gate, probe=host.probe,
                                   discovery=InMemoryDiscovery(options.name),
                                   config=options.drain_config())
        self.shutdown = Shutdown(self.lifecycle, host.control, options.shutdown_policy(),
                                 signals=claim.signals)
        self.admission = admission
        self.admin: WorkerAdmin | None = None
        self.task: asyncio.Task[None] | None = None
        self.announcing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Steps 2-4 of the module docstring; on any failure the engine's processes act on
        signals again (the engine's unwinding stops them) and the error propagates."""
        try:
            await self._start()
        except BaseException:
            self.claim.signals.permit_shutdown()
            raise

    async def _start(self) -> None:
        claim = self.claim
        # 2. the engine's processes hold signals from here; the server's are quiesce's
        claim.signals.hold()
        self.host.take_signals()
        self.shutdown.install_signal_handlers()
        # 3. the admin API; the lifecycle's metrics also go to the server's own /metrics
        import prometheus_client  # noqa: PLC0415 (the server extra, as the engines')

        self.admin = WorkerAdmin.build(
            self.lifecycle, claim.admin_socket, token=claim.token, signals=claim.signals,
            pod=claim.pod, registry=prometheus_client.REGISTRY, extra=self.host.status())
        # 4. admission opens; then the admin API listens
        await self.lifecycle.start()
        self.admission.lifecycle = self.lifecycle
        claim.admin_socket.listen(LISTEN_BACKLOG)
        await self.admin.server.start()
        self.admin.publish()
        self.task = asyncio.create_task(self._shut_down_when_signalled(), name="quiesce-shutdown")
        self.announcing = asyncio.create_task(self._ready_once_listening(), name="quiesce-ready")

    async def _ready_once_listening(self) -> None:
        """The ready line, once the server listens (it does after the lifespan startup,
        which this worker is part of)."""
        backoff = 0.001
        while not self.host.listening():
            if self.shutdown.requested:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.05)
        assert self.admin is not None
        guards = self.claim.signals.report()
        log.log(logging.INFO if guards.protected else logging.WARNING,
                "quiesce serves %s (role %s); signal guard: %s; admin API on port %d",
                self.host.server, self.host.role.value, guards.summary(),
                self.admin.server.port)
        _emit({"event": "ready", "admin_port": self.admin.server.port, "pid": os.getpid(),
               "role": self.host.role.value, "signal_guard": guards.to_dict()})

    async def _shut_down_when_signalled(self) -> None:
        await self.shutdown.wait_requested()
        code = EXIT_FORCED  # whatever fails below, the process never exits 0 by this path
        try:
            assert self.admin is not None
            admin = self.admin
            admin.leaving()

            async def close() -> None:
                self.host.stop_server()
                await admin.server.stop()

            report = await self.shutdown.run(close=close)
            code = report.exit_code
            _emit({"event": "exit", **report.to_dict()})
        except Exception:
            log.exception("quiesce's shutdown failed; exiting with code %d", code)
        finally:
            await end(code)

    async def server_stopping(self) -> None:
        """The server is stopping (lifespan shutdown). During quiesce's shutdown that is
        its own doing: wait, the shutdown ends the process. Otherwise the server stops on
        its own (module docstring): account for every admitted request and say so."""
        if self.shutdown.requested:
            assert self.task is not None
            await asyncio.wait({self.task})
            return
        if self.task is not None:
            self.task.cancel()
        self.claim.signals.permit_shutdown()  # the engine's unwinding stops it next
        await self.lifecycle.stop()
        if self.admin is not None:
            self.admin.leaving()
            await self.admin.server.stop()
        requests = self.gate.outcomes()
        lost = requests.lost + self.gate.inflight
        if lost:
            exit_with(EXIT_LOST)
        log.log(logging.WARNING if lost else logging.INFO,
                "%s stopped without a signal: %d admitted request(s) lost, %d completed; "
                "exit code %s", self.host.server, lost, requests.completed,
                EXIT_LOST if lost else "the engine's")
        _emit({"event": "exit", "outcome": "server_stopped", "drained": False,
               "lost_requests": lost, "requests": requests.to_dict(),
               "exit_code": EXIT_LOST if lost else None})


EXIT_WAIT_S = 2.0
"""How long the exit waits for the default executor's threads (the engine's shutdown ran
there); one still running then (a shutdown stage that timed out) is left behind."""


async def end(code: int) -> None:
    """End the process with ``code`` once the shutdown is over: the default executor's
    idle threads first (at most :data:`EXIT_WAIT_S`), then
    :func:`~quiesce.adapters.vllm.exit.end_process` (the ``atexit`` handlers, flushed
    output, ``os._exit``: no interpreter teardown); where that must not skip the
    teardown, ``SystemExit`` out of the loop (the server's own unwinding runs, its
    engine shutdown is a no-op by now) with the same code; where a thread still hangs,
    ``os._exit`` with the same code after flushing (the budget is spent)."""
    from quiesce.adapters.vllm.exit import end_process  # noqa: PLC0415

    try:
        await asyncio.wait_for(asyncio.get_running_loop().shutdown_default_executor(),
                               EXIT_WAIT_S)
    except asyncio.TimeoutError:
        log.warning("a thread of the engine's shutdown still runs after %.0fs: exiting "
                    "without it", EXIT_WAIT_S)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    end_process(code)
    raise SystemExit(code)


class ServerMiddleware(abc.ABC):
    """The ASGI middleware a face adds to its engine's app (module docstring)."""

    server: str
    """The server's name in messages (``vllm serve``, ``sglang``)."""
    routes: ServerRoutes
    """The server's routes as admission sees them (which POSTs start no generation, how
    an answer says the engine ended the request)."""
    missing_claim: str
    """Why no claim was made in this process, and what to do about it (a refusal)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.admission = AdmissionMiddleware(app, routes=self.routes)
        self.worker: ServerWorker | None = None

    @abc.abstractmethod
    def host(self, app: Any, options: ServerOptions) -> EngineHost:
        """The engine behind the started ``app``; ConfigError where quiesce cannot serve
        it truthfully (nothing changed then)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        else:
            await self.admission(scope, receive, send)

    async def _start_worker(self, app: Any) -> ServerWorker:
        claim = current_claim()
        if claim is None:
            raise ConfigError("claim", f"quiesce made no claim in this process (pid "
                              f"{os.getpid()}) before the engine started: "
                              f"{self.missing_claim}")
        worker = ServerWorker(claim, self.host(app, claim.options), self.admission)
        await worker.start()
        return worker

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watched_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                try:
                    self.worker = await self._start_worker(scope.get("app"))
                except Exception as exc:  # ConfigError: a refusal; anything else: a failure
                    log.critical("quiesce refuses to serve: %s", exc)
                    print(f"{self.server}: quiesce refuses to start: {exc}", file=sys.stderr,
                          flush=True)
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
            await send(message)

        async def watched_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown" and self.worker is not None:
                await self.worker.server_stopping()
            return message

        await self.app(scope, watched_receive, watched_send)
