"""The reference worker: ``quiesce serve``. The integration example for backend authors.

One process, one event loop, two HTTP servers:

- the serving API on ``--port``: an OpenAI-compatible ``POST /v1/completions``
  (streaming as server-sent events, or one JSON answer), every request through the
  admission gate; a closed gate answers 503 with a typed, retryable error;
- the admin API on ``--admin-port`` (:mod:`quiesce.server`).

SIGTERM or SIGINT runs the budgeted shutdown (:mod:`quiesce.shutdown`); a second
signal exits at once. The process prints one JSON line when it is ready
(``{"event": "ready", "port": ..., "admin_port": ..., "pid": ...}``) and one when it
exits (``{"event": "exit", ...}`` with the shutdown report); the exit code is the
report's: 0 clean drain, 3 forced, 4 second signal.

The wiring a backend needs is all in :func:`run_worker`: build the gate, the probe,
discovery and the lifecycle; admit every request; hand SIGTERM to ``Shutdown``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from quiesce.adapters.sim import RequestAborted, SimConfig, SimEngine, SimProbe, SimRequest
from quiesce.admission import Admission, AdmissionGate
from quiesce.discovery import InMemoryDiscovery
from quiesce.drain import DrainConfig
from quiesce.errors import ConfigError, WorkerDraining
from quiesce.lifecycle import Lifecycle
from quiesce.metrics import WorkerMetrics
from quiesce.probe import Role
from quiesce.server import (
    EmbeddedServer,
    bind_socket,
    check_bind,
    create_admin_app,
    error_response,
    load_token,
)
from quiesce.shutdown import Shutdown, ShutdownPolicy
from starlette.types import Receive, Scope, Send

log = logging.getLogger("quiesce.worker")

MAX_TOKENS_LIMIT = 8192


class CompletionRequest(BaseModel):
    """The subset of OpenAI's completion request the reference worker understands."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[str] = ""
    max_tokens: int = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)
    stream: bool = False
    request_id: str | None = Field(default=None, max_length=200)
    kv_transfer_params: dict[str, Any] | None = Field(
        default=None, description="do_remote_decode: hold KV for a decoder (as in vLLM); "
                                  "sim_never_pulled: that decoder never pulls (tests).")


class AdmittedStream(StreamingResponse):
    """A streaming response that releases its admission however the response ends,
    even if the client left before the body generator ever started."""

    def __init__(self, body: AsyncIterator[str], admission: Admission) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.admission.release()


def _chunk(request_id: str, model: str, text: str, finish: str | None) -> str:
    payload = {"id": request_id, "object": "text_completion", "created": int(time.time()),
               "model": model,
               "choices": [{"index": 0, "text": text, "finish_reason": finish,
                            "logprobs": None}]}
    return f"data: {json.dumps(payload)}\n\n"


def create_completions_app(engine: SimEngine, gate: AdmissionGate,
                           model_name: str = "quiesce-sim") -> FastAPI:
    """The serving API: every request is admitted through ``gate`` before it starts."""
    app = FastAPI(title="quiesce reference worker", version="1")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        request_id = body.request_id or f"cmpl-{uuid.uuid4().hex[:16]}"
        params = body.kv_transfer_params or {}
        prompt = body.prompt if isinstance(body.prompt, str) else " ".join(body.prompt)
        sim = SimRequest(request_id, prompt_tokens=max(1, len(prompt.split())),
                         max_tokens=body.max_tokens,
                         remote_decode=bool(params.get("do_remote_decode")),
                         never_pulled=bool(params.get("sim_never_pulled")))
        try:
            admission = gate.admit(request_id)
        except WorkerDraining as exc:
            return error_response(503, "worker_draining", str(exc), retryable=True)
        model = body.model or model_name
        if body.stream:
            return AdmittedStream(_stream(engine, sim, model, admission), admission)
        with admission:
            try:
                tokens = [t async for t in engine.generate(sim)]
            except RequestAborted as exc:
                return error_response(503, "request_aborted", str(exc), retryable=False)
        return JSONResponse({"id": request_id, "object": "text_completion", "model": model,
                             "created": int(time.time()),
                             "choices": [{"index": 0, "text": " ".join(f"t{t}" for t in tokens),
                                          "finish_reason": "length", "logprobs": None}],
                             "usage": {"prompt_tokens": sim.prompt_tokens,
                                       "completion_tokens": len(tokens),
                                       "total_tokens": sim.prompt_tokens + len(tokens)}})

    return app


async def _stream(engine: SimEngine, sim: SimRequest, model: str,
                  admission: Admission) -> AsyncIterator[str]:
    with admission:
        try:
            async for token in engine.generate(sim):
                finish = "length" if token == sim.max_tokens else None
                yield _chunk(sim.request_id, model, f" t{token}", finish)
        except RequestAborted as exc:
            error = {"error": {"type": "request_aborted", "message": str(exc)}}
            yield f"data: {json.dumps(error)}\n\n"
            return
        yield "data: [DONE]\n\n"


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    admin_host: str = "127.0.0.1"
    admin_port: int = 8001
    role: Role = Role.AGGREGATED
    budget_s: float = 30.0
    cleanup_reserve_s: float = 5.0
    router_grace_s: float = 2.0
    admin_token_file: str | None = None
    decode_step_s: float = 0.02
    name: str = "worker"


def _emit(event: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def run_worker(options: WorkerOptions) -> int:
    """Serve until signalled, then shut down on one budget. Returns the exit code."""
    token = load_token(options.admin_token_file)
    check_bind(options.admin_host, token)
    policy = ShutdownPolicy(total_s=options.budget_s, cleanup_reserve_s=options.cleanup_reserve_s)
    engine = SimEngine(SimConfig(decode_step_s=options.decode_step_s), name=options.name)
    gate = AdmissionGate()
    lifecycle = Lifecycle(gate=gate, probe=SimProbe(engine, options.role),
                          discovery=InMemoryDiscovery(options.name),
                          config=DrainConfig(router_grace_s=options.router_grace_s))
    shutdown = Shutdown(lifecycle, engine, policy)
    shutdown.install_signal_handlers()
    if token is None:
        log.warning("admin API has no token: open to local processes on %s only",
                    options.admin_host)

    await engine.start()
    serving = EmbeddedServer(create_completions_app(engine, gate),
                             bind_socket(options.host, options.port))
    admin = EmbeddedServer(create_admin_app(lifecycle, token=token,
                                            metrics=WorkerMetrics(lifecycle)),
                           bind_socket(options.admin_host, options.admin_port))
    await serving.start()
    await admin.start()
    await lifecycle.start()
    _emit({"event": "ready", "port": serving.port, "admin_port": admin.port, "pid": os.getpid()})

    await shutdown.wait_requested()
    report = await shutdown.run()
    # Every admitted stream has ended (or was aborted); close the listeners last.
    await serving.stop()
    await admin.stop()
    _emit({"event": "exit", **report.to_dict()})
    return report.exit_code


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = WorkerOptions()
    parser.add_argument("--engine", choices=["sim"], default="sim",
                        help="engine behind the worker (sim: the simulated engine)")
    parser.add_argument("--host", default=defaults.host, help="serving API address")
    parser.add_argument("--port", type=int, default=defaults.port, help="serving API port")
    parser.add_argument("--admin-host", default=defaults.admin_host, help="admin API address")
    parser.add_argument("--admin-port", type=int, default=defaults.admin_port,
                        help="admin API port")
    parser.add_argument("--admin-token-file", default=None,
                        help="file with the admin bearer token (else $QUIESCE_ADMIN_TOKEN)")
    parser.add_argument("--role", default=defaults.role.value,
                        choices=[r.value for r in Role], help="worker role")
    parser.add_argument("--budget", type=float, default=defaults.budget_s,
                        help="shutdown budget from SIGTERM to exit, s (%(default)s)")
    parser.add_argument("--reserve", type=float, default=None,
                        help="part of the budget kept for abort and cleanup, s "
                             "(default: a fifth of the budget, at most 5)")
    parser.add_argument("--router-grace", type=float, default=defaults.router_grace_s,
                        help="keep admitting this long after unregistering, s (%(default)s)")
    parser.add_argument("--decode-step", type=float, default=defaults.decode_step_s,
                        help="sim engine: seconds per decode step (%(default)s)")


def serve_main(args: argparse.Namespace) -> int:
    """Entry of ``quiesce serve``; configuration errors exit 2 with one clear line."""
    try:
        options = WorkerOptions(
            host=args.host, port=args.port, admin_host=args.admin_host,
            admin_port=args.admin_port, role=Role.parse(args.role), budget_s=args.budget,
            cleanup_reserve_s=(args.reserve if args.reserve is not None
                               else min(5.0, args.budget / 5)),
            router_grace_s=args.router_grace,
            admin_token_file=args.admin_token_file, decode_step_s=args.decode_step)
        SimConfig(decode_step_s=options.decode_step_s)
        return asyncio.run(run_worker(options))
    except (ConfigError, OSError) as exc:
        print(f"quiesce serve: {exc}", file=sys.stderr)
        return 2
