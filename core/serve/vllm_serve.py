"""quiesce inside vLLM's own OpenAI server: ``vllm serve MODEL --middleware`` this class.

::

    pip install 'quiesce[vllm]'
    vllm serve MODEL --middleware quiesce.serve.vllm_serve.QuiesceMiddleware
    # optional settings: QUIESCE_VLLM_ARGS="--admin-port 8001 --budget 60 --router-grace 5"

Two pieces, both in vLLM's API server process:

- :mod:`quiesce.serve.vllm_plugin` (a ``vllm.general_plugins`` entry) runs while vLLM
  builds its argument parser, before the engine starts: it checks quiesce's settings
  (a bad one: ``vllm serve`` exits 2 naming it), binds the admin port and claims signal
  ownership, which the engine's processes inherit (quiesce's engine plugin guards them).
- :class:`QuiesceMiddleware`, which vLLM adds to its app. It admits every request
  through the gate (:mod:`quiesce.serve.asgi_admission`: typed, retryable 503 once
  draining; the readiness route ``GET /quiesce/ready``; how each request ended, read
  from what vLLM sent, streams byte for byte unchanged). When vLLM's app has started
  (lifespan startup complete: the engine is up, vLLM's signal handlers are installed)
  it builds the worker (:class:`VllmServeWorker`) around ``app.state.engine_client``.

The worker, in the order it starts:

1. the probe (:class:`~quiesce.adapters.vllm.VllmProbe`: the frontend's unfinished
   requests and EngineCore's own state, held KV sends included) for the role of
   ``--role`` (``auto``: from vLLM's ``--kv-transfer-config``);
2. the signals: the engine's processes hold SIGTERM/SIGINT from now on, and the first
   SIGTERM or SIGINT to the API server starts quiesce's shutdown, replacing vLLM's
   handler (a second one exits at once, code 4, taking the engine's processes along);
3. the admin API on its own port (drain, resume, status with outcomes and ETA, metrics;
   ``quiesce prestop`` works against it), the lifecycle's metrics in vLLM's ``/metrics``
   too, and the pod's deletion cost if asked (``--publish-deletion-cost``);
4. admission opens; once vLLM's port listens, one JSON line ``{"event": "ready", ...}``
   on stdout.

On the first signal, :class:`~quiesce.shutdown.Shutdown` runs on one budget: readiness
fails at once, the router grace passes, admission closes, admitted requests reach zero,
the engine is quiescent (held KV sends included); then vLLM's own shutdown: the engine's
processes get their handlers back and ``AsyncLLM.shutdown`` (vLLM's engine-client
shutdown, the call vLLM's own handler makes), and vLLM's HTTP server is told to exit.
One JSON line ``{"event": "exit", ...}`` with the report, and the process ends with the
report's exit code (0 drained, 3 forced, 5 lost; :mod:`quiesce.shutdown`) without the
interpreter's teardown (:func:`quiesce.adapters.vllm.exit.end_process`).

If vLLM's server stops by itself (its watchdog after an engine failure) with no signal,
the worker logs how every admitted request ended and prints the exit line with
``"outcome": "server_stopped"``; the exit code is then vLLM's.

Refusals (the middleware sends ``lifespan.startup.failed`` with the reason: uvicorn
then exits with its startup-failure code, 3, and vLLM's unwinding stops the engine;
nothing was served): no claim was made in this process
(the middleware came from a ``--config`` file, where the plugin cannot see it before the
engine starts; several API servers, ``--api-server-count`` > 1, each a process of its
own), or vLLM's app has no ``engine_client``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from typing import Any

from quiesce.admin.server import LISTEN_BACKLOG
from quiesce.admin.worker_admin import WorkerAdmin
from quiesce.admission import AdmissionGate
from quiesce.discovery import InMemoryDiscovery
from quiesce.errors import ConfigError
from quiesce.lifecycle import Lifecycle
from quiesce.serve.asgi_admission import (
    AdmissionMiddleware,
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
)
from quiesce.serve.vllm_plugin import MIDDLEWARE, Claim, current_claim
from quiesce.shutdown import EXIT_FORCED, Shutdown

log = logging.getLogger("quiesce.serve.vllm_serve")

__all__ = ["QuiesceMiddleware", "VllmServeWorker"]


def _emit(event: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class VllmServeWorker:
    """quiesce's worker around a running ``vllm serve`` (module docstring, steps 1-4)."""

    def __init__(self, claim: Claim, engine: Any, http_server: Any,
                 admission: AdmissionMiddleware) -> None:
        from quiesce.adapters.vllm import VllmEngineControl, VllmProbe  # noqa: PLC0415

        options = claim.options
        self.claim = claim
        self.engine = engine
        self.http_server = http_server
        kv_config = getattr(getattr(engine, "vllm_config", None), "kv_transfer_config", None)
        self.role = options.resolved_role(getattr(kv_config, "kv_role", None))
        policy = options.shutdown_policy()
        self.gate = AdmissionGate(accepting=False)  # opened by the lifecycle's start
        self.lifecycle = Lifecycle(gate=self.gate, probe=VllmProbe(engine, self.role),
                                   discovery=InMemoryDiscovery(options.name),
                                   config=options.drain_config())
        # vLLM's engine shutdown must fit in the cleanup reserve (its default is 5 s, then kill)
        control = VllmEngineControl(engine, max(1.0, policy.cleanup_reserve_s - 1.0))
        self.shutdown = Shutdown(self.lifecycle, control, policy, signals=claim.signals)
        self.admission = admission
        self.admin: WorkerAdmin | None = None
        self.task: asyncio.Task[None] | None = None
        self.announcing: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, app: Any, admission: AdmissionMiddleware) -> VllmServeWorker:
        """Build and start the worker for vLLM's ``app``; ConfigError if it cannot serve
        with quiesce (the module docstring's refusals), before anything changed."""
        claim = current_claim()
        if claim is None:
            raise ConfigError("--middleware", "quiesce's vLLM plugin made no claim in this "
                              f"process (pid {os.getpid()}) before the engine started: name "
                              f"the middleware on vllm serve's command line (--middleware "
                              f"{MIDDLEWARE}), not in a --config file; run one API server "
                              "(--api-server-count 1); and install quiesce in vLLM's own "
                              "environment (pip install 'quiesce[vllm]')")
        state = getattr(app, "state", None)
        engine = getattr(state, "engine_client", None)
        if engine is None:
            raise ConfigError("--middleware", "vLLM's app has no engine_client (a render-only "
                              "or gRPC server?): there is no engine to drain")
        worker = cls(claim, engine, getattr(state, "server", None), admission)
        try:
            await worker._start()
        except BaseException:
            # nothing is served: the engine's processes act on signals again, and vLLM's
            # unwinding stops them (its SIGTERM would otherwise wait out its timeout)
            claim.signals.permit_shutdown()
            raise
        return worker

    async def _start(self) -> None:
        claim = self.claim
        # 2. the engine's processes hold signals from here; the API server's are quiesce's
        claim.signals.hold()
        self.shutdown.install_signal_handlers()
        # 3. the admin API; the lifecycle's metrics also go to vLLM's own /metrics
        import prometheus_client  # noqa: PLC0415 (the server extra, as vLLM's)

        self.admin = WorkerAdmin.build(
            self.lifecycle, claim.admin_socket, token=claim.token, signals=claim.signals,
            pod=claim.pod, registry=prometheus_client.REGISTRY,
            extra={"vllm_serve": {"role": self.role.value, "pid": os.getpid()}})
        # 4. admission opens; then the admin API listens
        await self.lifecycle.start()
        self.admission.lifecycle = self.lifecycle
        claim.admin_socket.listen(LISTEN_BACKLOG)
        await self.admin.server.start()
        self.admin.publish()
        self.task = asyncio.create_task(self._shut_down_when_signalled(), name="quiesce-shutdown")
        self.announcing = asyncio.create_task(self._ready_once_listening(), name="quiesce-ready")

    async def _ready_once_listening(self) -> None:
        """The ready line, once vLLM's uvicorn listens (it does after the lifespan startup,
        which this worker is part of)."""
        backoff = 0.001
        while self.http_server is not None and not self.http_server.started:
            if self.shutdown.requested:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.05)
        assert self.admin is not None
        guards = self.claim.signals.report()
        log.log(logging.INFO if guards.protected else logging.WARNING,
                "quiesce serves vLLM (role %s); signal guard: %s; admin API on port %d",
                self.role.value, guards.summary(), self.admin.server.port)
        _emit({"event": "ready", "admin_port": self.admin.server.port, "pid": os.getpid(),
               "role": self.role.value, "signal_guard": guards.to_dict()})

    async def _shut_down_when_signalled(self) -> None:
        await self.shutdown.wait_requested()
        code = EXIT_FORCED  # whatever fails below, the process never exits 0 by vLLM's path
        try:
            assert self.admin is not None
            admin = self.admin
            admin.leaving()

            async def close() -> None:
                # vLLM's own server exits (what its handler does after the engine shutdown)
                if self.http_server is not None:
                    self.http_server.should_exit = True
                await admin.server.stop()

            report = await self.shutdown.run(close=close)
            code = report.exit_code
            _emit({"event": "exit", **report.to_dict()})
        except Exception:
            log.exception("quiesce's shutdown failed; exiting with code %d", code)
        finally:
            await end(code)

    async def server_stopping(self) -> None:
        """vLLM's HTTP server is stopping (lifespan shutdown). During quiesce's shutdown
        that is its own doing: wait, the shutdown ends the process. Otherwise vLLM stops on
        its own (module docstring): account for every admitted request and say so."""
        if self.shutdown.requested:
            assert self.task is not None
            await asyncio.wait({self.task})
            return
        if self.task is not None:
            self.task.cancel()
        self.claim.signals.permit_shutdown()  # vLLM's unwinding stops the engine next
        await self.lifecycle.stop()
        if self.admin is not None:
            self.admin.leaving()
            await self.admin.server.stop()
        requests = self.gate.outcomes()
        lost = requests.lost + self.gate.inflight
        log.log(logging.WARNING if lost else logging.INFO,
                "vLLM's server stopped without a signal: %d admitted request(s) lost, %d "
                "completed; the exit code is vLLM's", lost, requests.completed)
        _emit({"event": "exit", "outcome": "server_stopped", "drained": False,
               "lost_requests": lost, "requests": requests.to_dict()})


EXIT_WAIT_S = 2.0
"""How long the exit waits for the default executor's threads (vLLM's engine shutdown ran
there); one still running then (a shutdown stage that timed out) is left behind."""


async def end(code: int) -> None:
    """End the process with ``code`` once the shutdown is over: the default executor's
    idle threads first (at most :data:`EXIT_WAIT_S`), then
    :func:`~quiesce.adapters.vllm.exit.end_process`; where that must not skip the
    interpreter's teardown, ``SystemExit`` out of the loop (vLLM's own unwinding runs,
    its engine shutdown is a no-op by now) with the same code; where a thread still hangs,
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


class QuiesceMiddleware:
    """The ASGI middleware ``vllm serve --middleware`` adds (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.admission = AdmissionMiddleware(app)
        self.worker: VllmServeWorker | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        else:
            await self.admission(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watched_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                try:
                    self.worker = await VllmServeWorker.start(scope.get("app"), self.admission)
                except Exception as exc:  # ConfigError: a refusal; anything else: a failure
                    log.critical("quiesce refuses to serve: %s", exc)
                    print(f"vllm serve: quiesce refuses to start: {exc}", file=sys.stderr,
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

