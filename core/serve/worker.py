"""The reference worker: ``quiesce serve``. The integration example for backend authors.

One process, one event loop, two HTTP servers:

- the serving API on ``--port`` (:mod:`quiesce.serve.openai_api`): OpenAI-compatible
  ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``
  (streaming as server-sent events, or one JSON answer), every request through the
  admission gate and ending in one recorded outcome; a closed gate answers 503 with a
  typed, retryable error;
- the admin API on ``--admin-port`` (:mod:`quiesce.admin.server`).

SIGTERM or SIGINT runs the budgeted shutdown (:mod:`quiesce.shutdown`); a second
signal exits at once. The process prints one JSON line once it owns its signals
(``{"event": "starting", "pid": ...}``), one when it is ready (``{"event": "ready",
"port": ..., "admin_port": ..., "pid": ...}``; a worker signalled before that never
registers or serves) and one when it exits (``{"event": "exit", ...}`` with the shutdown
report: how every request admitted since the drain began ended); the exit code is the
report's: 0 drained with nothing lost,
3 forced (the budget ran out), 5 requests lost on the way, 4 second signal.

Signals: the worker owns SIGTERM and SIGINT (:mod:`quiesce.signal_guard`). Its engine's
processes are guarded so that a signal sent to the whole process group (Ctrl-C, an init
shim) or to every process (systemd, ``pkill``) does not make them shut down on their
own; they get their handlers back when the drain is over. Whether every process is
protected is logged at start-up, printed in the ready line and shown in
``GET /engine/status`` (``signal_guard``).

The wiring a backend needs is all in :func:`run_worker`: build the gate, the probe,
discovery and the lifecycle; admit every request; hand SIGTERM to ``Shutdown``.

``--dynamo``: the sim engine is served behind NVIDIA Dynamo's frontend instead of the
HTTP API (:mod:`quiesce.adapters.dynamo.backend`: Dynamo's model card and a token
endpoint through its runtime, every request through the gate; discovery is the card and
the endpoint instance). SIGTERM runs quiesce's shutdown as above, with ``runtime.shutdown()``
as the listeners' close; or, with ``--dynamo-shutdown dynamo``, Dynamo 1.6.1's own
graceful-shutdown helper as its workers ship it (unregister the instance, sleep the grace,
abort what is left), after which the worker stops its engine and exits 0, or 5 when an
admitted request was lost (the exit line counts every request since start). The ready
line has ``"port": null`` and ``dynamo`` (endpoint, shutdown); a serve that ends without
a signal exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable

from quiesce.adapters.dynamo.backend import DynamoBackend, require_dynamo_shutdown
from quiesce.adapters.etcd import EtcdDiscovery
from quiesce.adapters.nvml import GpuQuietProbe, require_gpu_quiet
from quiesce.adapters.sim import SimConfig, SimServing
from quiesce.admin.pod_deletion_cost import PodIdentity
from quiesce.admin.server import (
    LISTEN_BACKLOG,
    EmbeddedServer,
    bind_socket,
    check_bind,
    load_token,
)
from quiesce.admin.worker_admin import WorkerAdmin
from quiesce.admission import AdmissionGate
from quiesce.discovery import Discovery, DiscoveryUnavailable, InMemoryDiscovery
from quiesce.errors import ConfigError, EngineNotInstalled
from quiesce.lifecycle import Lifecycle
from quiesce.probe import QuiescenceProbe
from quiesce.serve.openai_api import ServingEngine, create_completions_app
from quiesce.serve.options import WorkerOptions, options_from_args
from quiesce.shutdown import (
    EXIT_CLEAN,
    EXIT_LOST,
    SIGNALS,
    Shutdown,
    exit_immediately,
)
from quiesce.signal_guard import SignalOwnership

log = logging.getLogger("quiesce.serve.worker")

EXIT_WORKER_FAILED = 1
"""``--dynamo``: serving ended without a signal (Dynamo's runtime went away)."""
Cleanup = Callable[[], Awaitable[None]]


def build_serving(options: WorkerOptions) -> ServingEngine:
    """The engine behind the worker; an engine is imported only when asked for.

    Options left unset stay unset, so the engine's defaults apply (vLLM: the model's
    context length; on a CPU the adapter's dtype and KV cache defaults, see
    :mod:`quiesce.adapters.vllm.serving`; TensorRT-LLM: see
    :mod:`quiesce.adapters.trtllm.serving`, which also runs the drift check at start;
    SGLang: :mod:`quiesce.adapters.sglang.serving`, its CPU path where there is no GPU).
    """
    if options.engine == "trtllm":
        return _trtllm_serving(options)
    if options.engine == "sglang":
        return _sglang_serving(options)
    if options.engine == "vllm":
        from quiesce.adapters.vllm import installed_vllm_version  # noqa: PLC0415
        from quiesce.adapters.vllm.serving import VllmServing  # noqa: PLC0415

        if installed_vllm_version() is None:
            raise EngineNotInstalled("vllm", "vllm", "vllm")
        assert options.model is not None
        engine_args: dict[str, object] = {"dtype": options.dtype}
        if options.gpu_memory_utilization is not None:
            engine_args["gpu_memory_utilization"] = options.gpu_memory_utilization
        # vLLM's own shutdown must fit in the cleanup reserve (its default is 5 s, then kill).
        return VllmServing(options.model, options.role, max_model_len=options.max_model_len,
                           shutdown_timeout_s=max(1.0, options.cleanup_reserve_s - 1.0),
                           served_model_name=options.served_model_name,
                           kv_transfer_config=options.kv_transfer_config,
                           enforce_eager=True, **engine_args)
    return SimServing(SimConfig(decode_step_s=options.decode_step_s), options.role,
                      options.name, served_model_name=options.served_model_name or "quiesce")


def _sglang_serving(options: WorkerOptions) -> ServingEngine:
    from quiesce.adapters.sglang import installed_sglang_version  # noqa: PLC0415
    from quiesce.adapters.sglang.serving import SglangServing  # noqa: PLC0415

    if installed_sglang_version() is None:
        raise EngineNotInstalled("sglang", "sglang", "sglang")
    assert options.model is not None
    server_args: dict[str, object] = {}
    if options.dtype != "auto":
        server_args["dtype"] = options.dtype
    if options.gpu_memory_utilization is not None:
        server_args["mem_fraction_static"] = options.gpu_memory_utilization
    return SglangServing(options.model, options.role, max_model_len=options.max_model_len,
                         served_model_name=options.served_model_name, **server_args)


def _trtllm_serving(options: WorkerOptions) -> ServingEngine:
    from quiesce.adapters.trtllm import installed_trtllm_version  # noqa: PLC0415
    from quiesce.adapters.trtllm.serving import TrtllmServing  # noqa: PLC0415

    if installed_trtllm_version() is None:
        raise EngineNotInstalled("trtllm", "tensorrt_llm", "trtllm")
    assert options.model is not None
    return TrtllmServing(options.model, options.role, max_model_len=options.max_model_len,
                         served_model_name=options.served_model_name,
                         gpu_memory_fraction=options.gpu_memory_utilization,
                         cache_transceiver_config=options.cache_transceiver_config,
                         dtype=options.dtype)


def build_discovery(options: WorkerOptions, api_port: int) -> Discovery:
    """etcd with ``--etcd`` (routers watch the prefix), else an in-process directory."""
    if options.etcd is None:
        return InMemoryDiscovery(options.name)
    return EtcdDiscovery(options.etcd_config(api_port))


async def _start_or_stop(lifecycle: Lifecycle, serving: ServingEngine,
                         close_discovery: Cleanup | None = None) -> None:
    """Register and open admission; if the first registration fails, stop the discovery
    client and the engine, and raise DiscoveryUnavailable (exit code 2)."""
    try:
        await lifecycle.start()
    except DiscoveryUnavailable:  # never listed, nothing served: stop the engine
        log.error("the first registration failed; stopping the engine and exiting")
        if isinstance(lifecycle.discovery, EtcdDiscovery):
            await lifecycle.discovery.close()
        if close_discovery is not None:
            await close_discovery()
        await serving.control.shutdown()
        raise


def _check_installed(options: WorkerOptions) -> None:
    """EngineNotInstalled for an optional package an option needs and that is missing."""
    if options.require_gpu_quiet and importlib.util.find_spec("pynvml") is None:
        raise EngineNotInstalled("nvml", "nvidia-ml-py", "nvml")
    if options.etcd is not None and importlib.util.find_spec("aetcd") is None:
        raise EngineNotInstalled("etcd", "aetcd", "etcd")


def _emit(event: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def run_worker(options: WorkerOptions) -> int:
    """Serve until signalled, then shut down on one budget. Returns the exit code."""
    token = load_token(options.admin_token_file)
    check_bind(options.admin_host, token)
    if token is None:
        log.warning("admin API has no token: open to local processes on %s only",
                    options.admin_host)
    loop = asyncio.get_running_loop()
    # The worker owns SIGTERM/SIGINT: claimed before the engine starts its processes,
    # which inherit the claim; a signal during the (slow) engine start is kept for later.
    signals = SignalOwnership()
    signals.claim()
    early: list[signal.Signals] = []

    def during_start(sig: signal.Signals) -> None:
        if early:  # a second signal: exit now, as at any other time
            exit_immediately(sig, None)
        early.append(sig)

    for sig in SIGNALS:
        loop.add_signal_handler(sig, during_start, sig)
    _emit({"event": "starting", "pid": os.getpid()})
    try:
        if options.dynamo:
            return await _serve_dynamo(options, token, signals, early)
        return await _serve(options, token, signals, early)
    finally:
        signals.release()


async def _probe(options: WorkerOptions, serving: ServingEngine, timeout_s: float
                 ) -> tuple[QuiescenceProbe, GpuQuietProbe | None]:
    """The engine's probe, with the GPUs' quiet (``--require-gpu-quiet``) when asked."""
    if not options.require_gpu_quiet:
        return serving.probe, None
    gpu_quiet = require_gpu_quiet(serving.probe, options.require_gpu_quiet,
                                  probe_timeout_s=timeout_s)
    if (why := await gpu_quiet.check()) is not None:
        log.warning("--require-gpu-quiet: the GPUs cannot be read, so the worker will "
                    "not report drained until they can: %s", why)
    return gpu_quiet, gpu_quiet


def _signalled_meanwhile(shutdown: Shutdown) -> bool:
    """``shutdown.requested``, read again after an await (a signal may have come)."""
    return shutdown.requested


def _releaser(discovery: Discovery | None, gpu_quiet: GpuQuietProbe | None) -> Cleanup:
    """What a worker closes after its shutdown, whichever way it went: the etcd client
    (unregistered by the drain, or its lease expires) and the GPU reader (NVML and its
    thread)."""
    async def release() -> None:
        if isinstance(discovery, EtcdDiscovery):
            await discovery.close()
        if gpu_quiet is not None:
            await gpu_quiet.aclose()

    return release


async def _stop_without_serving(shutdown: Shutdown, *, listeners: tuple[socket.socket, ...],
                                close: Cleanup | None = None, release: Cleanup) -> int:
    """Signalled before serving. ``listeners`` (sockets no server took over) are closed
    first, so a connection is refused at once (one in a backlog is reset), never kept
    waiting through the drain's router grace and quiet; then the shutdown runs
    (``close``: its listeners' stage), then ``release`` (the clients the normal path
    closes after it); the exit line is printed. Returns the report's exit code."""
    log.warning("signalled during start-up: stopping without serving")
    for sock in listeners:
        sock.close()
    report = await shutdown.run(close=close)
    await release()
    _emit({"event": "exit", **report.to_dict()})
    return report.exit_code


async def _serve(options: WorkerOptions, token: str | None, signals: SignalOwnership,
                 early: list[signal.Signals]) -> int:
    # Configuration errors surface before the (slow) engine start.
    pod = PodIdentity.from_environment() if options.publish_deletion_cost else None
    _check_installed(options)
    drain_config = options.drain_config()
    # The ports and the discovery client too, so that a port in use or a bad discovery
    # setting fails at once; the ports refuse connections until the worker registers.
    api_socket = bind_socket(options.host, options.port, listen=False)
    admin_socket = bind_socket(options.admin_host, options.admin_port, listen=False)
    discovery = build_discovery(options, api_socket.getsockname()[1])
    serving = build_serving(options)
    await serving.start()
    guards = signals.report()
    log.log(logging.INFO if guards.protected else logging.WARNING, "signal guard: %s",
            guards.summary())
    probe, gpu_quiet = await _probe(options, serving, drain_config.probe_timeout_s)
    gate = AdmissionGate()
    api = EmbeddedServer(create_completions_app(serving, gate), api_socket)
    lifecycle = Lifecycle(gate=gate, probe=probe, discovery=discovery, config=drain_config)
    shutdown = Shutdown(lifecycle, serving.control, options.shutdown_policy(),
                        signals=signals)
    shutdown.install_signal_handlers()
    if early:
        shutdown.on_signal(early[0])
    admin = WorkerAdmin.build(lifecycle, admin_socket, token=token, signals=signals, pod=pod)
    release = _releaser(discovery, gpu_quiet)
    # Registered before the servers start: nothing is served (and /health/ready does not
    # answer) until routers can find the worker; a failed registration serves nothing.
    # What connects during the registration (a few ms) waits in the listen backlog.
    listeners = (api_socket, admin_socket)
    if shutdown.requested:  # signalled while the engine started: never register or serve
        return await _stop_without_serving(shutdown, listeners=listeners, release=release)
    for sock in listeners:
        sock.listen(LISTEN_BACKLOG)
    await _start_or_stop(lifecycle, serving)
    if _signalled_meanwhile(shutdown):  # while it registered: unregister, never serve
        return await _stop_without_serving(shutdown, listeners=listeners, release=release)
    await api.start()
    await admin.server.start()
    _emit({"event": "ready", "port": api.port, "admin_port": admin.server.port,
           "pid": os.getpid(), "signal_guard": guards.to_dict()})
    admin.publish()
    await shutdown.wait_requested()
    admin.leaving()

    async def close() -> None:  # together: each uvicorn stop takes 0.1-0.3 s
        await asyncio.gather(api.stop(), admin.server.stop())

    report = await shutdown.run(close=close)
    await release()
    _emit({"event": "exit", **report.to_dict()})
    return report.exit_code


async def _serve_dynamo(options: WorkerOptions, token: str | None, signals: SignalOwnership,
                        early: list[signal.Signals]) -> int:
    """``--dynamo`` (module docstring): the sim engine behind Dynamo's frontend."""
    pod = PodIdentity.from_environment() if options.publish_deletion_cost else None
    _check_installed(options)
    as_shipped = options.dynamo_shutdown == "dynamo"
    if as_shipped:
        require_dynamo_shutdown()  # ai-dynamo missing: exit 2 before anything starts
    drain_config = options.drain_config()
    policy = options.shutdown_policy()
    serving = SimServing(SimConfig(decode_step_s=options.decode_step_s), options.role,
                         options.name, served_model_name=options.served_model_name or "quiesce")
    gate = AdmissionGate(accepting=False)  # opened by the lifecycle's start
    backend = DynamoBackend(options.dynamo_config(), gate, serving.stream,
                            serving.engine.abort)  # reads the model's tokenizer
    admin_socket = bind_socket(options.admin_host, options.admin_port, listen=False)
    await backend.connect()
    await serving.start()
    probe, gpu_quiet = await _probe(options, serving, drain_config.probe_timeout_s)
    lifecycle = Lifecycle(gate=gate, probe=probe, discovery=backend.discovery,
                          config=drain_config)
    shutdown = Shutdown(lifecycle, backend.control(serving.control), policy, signals=signals)

    async def close_backend() -> None:
        await backend.close(policy.cleanup_reserve_s)

    backend.stopping = lambda: shutdown.requested  # signalled: the card only, never serve
    if early:
        shutdown.on_signal(early[0])
    elif as_shipped:  # Dynamo's helper owns SIGTERM/SIGINT from here, as in dynamo.vllm
        backend.install_dynamo_shutdown(asyncio.get_running_loop())
    else:
        shutdown.install_signal_handlers()
    dynamo = {"endpoint": backend.config.endpoint, "shutdown": options.dynamo_shutdown}
    admin = WorkerAdmin.build(lifecycle, admin_socket, token=token, signals=signals, pod=pod,
                         extra={"dynamo": dynamo})
    if not shutdown.requested:
        admin_socket.listen(LISTEN_BACKLOG)
        await _start_or_stop(lifecycle, serving, close_backend)  # card, then serve_endpoint
    if _signalled_meanwhile(shutdown):  # before or while the card registered: never served
        return await _stop_without_serving(shutdown, listeners=(admin_socket,),
                                           close=close_backend,
                                           release=_releaser(None, gpu_quiet))
    await admin.server.start()
    _emit({"event": "ready", "port": None, "admin_port": admin.server.port,
           "pid": os.getpid(), "dynamo": dynamo, "signal_guard": signals.report().to_dict()})
    admin.publish()
    assert backend.serving is not None
    requested = asyncio.ensure_future(shutdown.wait_requested())
    await asyncio.wait({backend.serving, requested}, return_when=asyncio.FIRST_COMPLETED)
    signalled = requested.done()
    requested.cancel()
    admin.leaving()
    if as_shipped or not signalled:
        code = await _after_serving(backend, lifecycle, serving, admin.server)
    else:
        async def close() -> None:
            await asyncio.gather(close_backend(), admin.server.stop())

        report = await shutdown.run(close=close)
        _emit({"event": "exit", **report.to_dict()})
        code = report.exit_code
    await _releaser(None, gpu_quiet)()
    return code


async def _after_serving(backend: DynamoBackend, lifecycle: Lifecycle, serving: SimServing,
                         admin: EmbeddedServer) -> int:
    """``serve_endpoint`` returned: after Dynamo's own helper (it set ``shutdown_event``,
    then shut the runtime down), or on its own (a failure). Stop the rest and report."""
    helper_ran = backend.shutdown_event.is_set()
    await backend.close(1.0)  # returned already: reads how it ended
    await lifecycle.stop()
    await serving.control.shutdown()
    await admin.stop()
    if not helper_ran:
        error = backend.serving.exception() if backend.serving is not None and \
            backend.serving.done() and not backend.serving.cancelled() else None
        log.error("Dynamo's runtime stopped serving without a signal: %r", error)
        _emit({"event": "exit", "outcome": "worker_failed", "error": repr(error),
               "exit_code": EXIT_WORKER_FAILED})
        return EXIT_WORKER_FAILED
    requests = lifecycle.gate.outcomes()
    lost = requests.lost + lifecycle.gate.inflight
    code = EXIT_LOST if lost else EXIT_CLEAN
    _emit({"event": "exit", "shutdown": "dynamo", "outcome": "lost" if lost else "ended",
           "drained": False, "lost_requests": lost, "requests": requests.to_dict(),
           "exit_code": code})
    return code


def serve_main(args: argparse.Namespace) -> int:
    """Entry of ``quiesce serve``; configuration errors exit 2 with one clear line."""
    try:
        code = asyncio.run(run_worker(options_from_args(args)))
    except (ConfigError, EngineNotInstalled, DiscoveryUnavailable, OSError) as exc:
        # DiscoveryUnavailable: the first registration failed; nothing was served
        print(f"quiesce serve: {exc}", file=sys.stderr)
        return 2
    if args.engine == "vllm":
        # The engine is shut down and the loop closed: skip the interpreter's teardown
        # of ~5,500 modules (1.3-1.6 s here), see quiesce.adapters.vllm.exit.
        from quiesce.adapters.vllm.exit import end_process  # noqa: PLC0415

        end_process(code)  # returns only where it may not (then: a normal exit)
    return code
