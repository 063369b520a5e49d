"""``quiesce dynamo COMPONENT -- ARGS``: NVIDIA Dynamo's own worker, drained by quiesce.

COMPONENT is ``vllm``, ``sglang`` or ``trtllm``. Runs Dynamo's real worker
(``python -m dynamo.COMPONENT ARGS``, ai-dynamo 1.6.1) in this process with the hooks of
:mod:`quiesce.adapters.dynamo.components`, and around it what ``quiesce serve`` has:

- the worker owns SIGTERM and SIGINT from the first instant (claimed before the engine
  starts, so the engine's processes are guarded where quiesce's engine plugin runs in
  them and a signal to the group or to every process does not stop them on their own);
  Dynamo's graceful-shutdown helper is never installed;
- every request Dynamo's handlers serve is admitted through the gate; once draining, a
  new one gets Dynamo's ``WorkerUnavailable`` (HTTP 503) before any work;
- SIGTERM runs the budgeted shutdown (:mod:`quiesce.shutdown`): unregister the worker's
  model card (what Dynamo's frontend routes by) and endpoint instances, router grace (at
  least ``--router-grace``, then until ``--router-quiet`` passes without a request),
  close admission, wait until nothing is admitted and the engine (quiesce's probe for
  it, held KV sends on a prefill worker included) is quiescent, then Dynamo's own
  teardown (its callbacks, ``shutdown_event``, ``runtime.shutdown()``, engine
  shutdown). A second signal exits at once;
- the admin API on ``--admin-port`` (status, drain, resume, metrics; ``quiesce prestop``
  works against it), listening once the model is registered.

A signal at any point of the worker's life ends with a report and an exit code: during
model load or before registration the worker stops without serving (nothing admitted:
drained, 0); while serving or draining, the drain's outcome (0 drained, 3 forced, 5
lost); a second signal 4. Dynamo's worker failing on its own is exit 1 with its error;
bad options, a Dynamo or engine that cannot be imported, or a worker kind quiesce does
not wrap (refused as soon as Dynamo parsed its arguments; each component's docstring
lists them) are exit 2 before anything serves. Output: one JSON line ``{"event":
"starting", ...}`` once the worker owns its signals (before Dynamo and the engine are
imported), one ``{"event": "ready", ...}`` when the model is registered, and one
``{"event": "exit", ...}`` with the shutdown report, as ``quiesce serve`` prints them.
An engine that dies ends the worker through Dynamo's own handler (``os._exit(1)``), with
no report: exit 1, never 0.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence

from quiesce.adapters.dynamo import DynamoDiscovery
from quiesce.adapters.dynamo.components import component_for
from quiesce.adapters.dynamo.model_card import ModelCardDiscovery
from quiesce.admin.metrics import WorkerMetrics
from quiesce.admin.server import (
    LISTEN_BACKLOG,
    EmbeddedServer,
    bind_socket,
    check_bind,
    create_admin_app,
    load_token,
)
from quiesce.admission import AdmissionGate
from quiesce.drain import DrainConfig
from quiesce.errors import ConfigError, EngineNotInstalled
from quiesce.lifecycle import Lifecycle
from quiesce.serve.options import dynamo_policy
from quiesce.shutdown import Shutdown, ShutdownPolicy
from quiesce.signal_guard import SignalOwnership

log = logging.getLogger("quiesce.serve.dynamo_worker")

EXIT_WORKER_FAILED = 1
"""Dynamo's worker ended on its own (an error, or its runtime went away) before any signal."""


def _emit(event: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def run_dynamo_worker(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run Dynamo's worker until signalled, then shut down on one budget (exit code)."""
    policy, drain_config = dynamo_policy(args)  # ConfigError before anything starts
    if importlib.util.find_spec("dynamo") is None:
        raise ConfigError("dynamo", "ai-dynamo is not installed: quiesce dynamo runs Dynamo's "
                          "own worker (ai-dynamo 1.6.1; ci/setup_dynamo.sh shows how)")
    token = load_token(args.admin_token_file)
    check_bind(args.admin_host, token)
    admin_socket = bind_socket(args.admin_host, args.admin_port, listen=False)
    # The worker owns SIGTERM/SIGINT before Dynamo or the engine start anything: the
    # engine's processes inherit the claim and are guarded by quiesce's plugin.
    signals = SignalOwnership()
    signals.claim()
    try:
        return await _run(args, argv, policy=policy, drain_config=drain_config, token=token,
                          admin_socket=admin_socket, signals=signals)
    finally:
        signals.release()


async def _run(args: argparse.Namespace, argv: Sequence[str], *, policy: ShutdownPolicy,
               drain_config: DrainConfig, token: str | None, admin_socket: socket.socket,
               signals: SignalOwnership) -> int:
    gate = AdmissionGate(accepting=False)  # opened when the model is registered
    component = component_for(  # ConfigError before anything starts
        args.component, gate,
        accept_untested_engine=getattr(args, "accept_untested_engine", None))
    discovery = ModelCardDiscovery(DynamoDiscovery(component.endpoints, registered=False),
                                   lambda: component.model)
    lifecycle = Lifecycle(gate=gate, probe=component.probe, discovery=discovery,
                          config=drain_config)
    shutdown = Shutdown(lifecycle, component.control, policy, signals=signals)
    shutdown.install_signal_handlers()  # before the (slow) import of Dynamo and the engine
    _emit({"event": "starting", "component": args.component, "pid": os.getpid()})
    component.install()

    def worker_status() -> dict[str, object]:
        return {"signal_guard": signals.report(max_age_s=1.0).to_dict(),
                "dynamo": {"component": args.component, "serving": component.serving,
                           "endpoints": len(component.endpoints)},
                "warnings": list(component.warnings)}

    admin = EmbeddedServer(create_admin_app(lifecycle, token=token,
                                            metrics=WorkerMetrics(lifecycle),
                                            extra_status=worker_status), admin_socket)

    async def on_ready() -> None:
        # Dynamo registered the model and serves the endpoints next (serve_endpoint
        # registers the instances): admission opens, then the admin API listens.
        discovery.served(card=True)
        await lifecycle.start()
        admin_socket.listen(LISTEN_BACKLOG)
        await admin.start()
        guards = signals.report()
        log.log(logging.INFO if guards.protected else logging.WARNING, "signal guard: %s",
                guards.summary())
        _emit({"event": "ready", "component": args.component, "admin_port": admin.port,
               "pid": os.getpid(), "signal_guard": guards.to_dict(),
               "warnings": list(component.warnings)})

    component.on_ready = on_ready
    worker = asyncio.create_task(component.run(argv), name="dynamo-worker")
    requested = asyncio.create_task(shutdown.wait_requested())
    await asyncio.wait({worker, requested}, return_when=asyncio.FIRST_COMPLETED)
    if not shutdown.requested:  # Dynamo's worker ended by itself
        requested.cancel()
        error = worker.exception() if not worker.cancelled() else None
        await lifecycle.stop()
        await admin.stop()
        if isinstance(error, ConfigError):
            raise error
        log.error("Dynamo's worker ended without a signal: %r", error)
        _emit({"event": "exit", "outcome": "worker_failed", "error": repr(error),
               "exit_code": EXIT_WORKER_FAILED})
        return EXIT_WORKER_FAILED
    if not component.serving:  # a signal before the model was registered: stop starting
        # Nothing was served, so there is nothing to drain: the engine's processes get
        # their own handlers back before Dynamo's cleanup stops them (vLLM's process
        # manager sends SIGTERM, which a guarded EngineCore would hold back until killed).
        signals.permit_shutdown()
        worker.cancel()  # Dynamo's own cleanup stops an engine it already built
        await asyncio.wait({worker}, timeout=policy.total_s - policy.cleanup_reserve_s)
    report = await shutdown.run()
    await admin.stop()
    if not worker.done():  # its teardown overran the budget: stop waiting for it
        worker.cancel()
        await asyncio.wait({worker}, timeout=1.0)
    _emit({"event": "exit", **report.to_dict()})
    return report.exit_code


def dynamo_main(args: argparse.Namespace) -> int:
    """Entry of ``quiesce dynamo``; configuration errors exit 2 with one clear line."""
    argv = list(getattr(args, "args", None) or [])
    try:
        return asyncio.run(run_dynamo_worker(args, argv))
    except (ConfigError, EngineNotInstalled, OSError) as exc:
        print(f"quiesce dynamo {args.component}: {exc}", file=sys.stderr)
        return 2
