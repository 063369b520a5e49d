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
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Receive, Scope, Send

from quiesce.adapters.sim import SimConfig, SimServing
from quiesce.admission import Admission, AdmissionGate
from quiesce.discovery import InMemoryDiscovery
from quiesce.drain import DrainConfig
from quiesce.engine import EngineControl
from quiesce.errors import ConfigError, EngineNotInstalled, RequestAborted, WorkerDraining
from quiesce.lifecycle import Lifecycle
from quiesce.metrics import WorkerMetrics
from quiesce.probe import QuiescenceProbe
from quiesce.serve_options import WorkerOptions, options_from_args
from quiesce.server import (
    EmbeddedServer,
    bind_socket,
    check_bind,
    create_admin_app,
    error_response,
    load_token,
)
from quiesce.shutdown import Shutdown, ShutdownPolicy

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


class ServingEngine(Protocol):
    """What the reference worker needs from an engine (``SimServing``, ``VllmServing``)."""

    @property
    def probe(self) -> QuiescenceProbe: ...

    @property
    def control(self) -> EngineControl: ...

    async def start(self) -> None: ...

    def stream(self, prompt: str, max_tokens: int, request_id: str,
               kv_transfer_params: Mapping[str, Any]) -> AsyncIterator[tuple[str, str | None]]:
        """Text pieces with the finish reason on the last; raises RequestAborted."""
        ...


def create_completions_app(serving: ServingEngine, gate: AdmissionGate,
                           model_name: str = "quiesce") -> FastAPI:
    """The serving API: every request is admitted through ``gate`` before it starts."""
    app = FastAPI(title="quiesce reference worker", version="1")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        request_id = body.request_id or f"cmpl-{uuid.uuid4().hex[:16]}"
        prompt = body.prompt if isinstance(body.prompt, str) else " ".join(body.prompt)
        try:
            admission = gate.admit(request_id)
        except WorkerDraining as exc:
            return error_response(503, "worker_draining", str(exc), retryable=True)
        pieces = serving.stream(prompt, body.max_tokens, request_id,
                                body.kv_transfer_params or {})
        model = body.model or model_name
        if body.stream:
            return AdmittedStream(_sse(pieces, request_id, model, admission), admission)
        with admission:
            try:
                answer = [piece async for piece in pieces]
            except RequestAborted as exc:
                return error_response(503, "request_aborted", str(exc), retryable=False)
        return JSONResponse({"id": request_id, "object": "text_completion", "model": model,
                             "created": int(time.time()),
                             "choices": [{"index": 0, "text": "".join(t for t, _ in answer),
                                          "finish_reason": answer[-1][1] if answer else None,
                                          "logprobs": None}],
                             "usage": {"completion_tokens": len(answer)}})

    return app


async def _sse(pieces: AsyncIterator[tuple[str, str | None]], request_id: str, model: str,
               admission: Admission) -> AsyncIterator[str]:
    with admission:
        try:
            async for text, finish in pieces:
                yield _chunk(request_id, model, text, finish)
        except RequestAborted as exc:
            error = {"error": {"type": "request_aborted", "message": str(exc)}}
            yield f"data: {json.dumps(error)}\n\n"
            return
        yield "data: [DONE]\n\n"


def build_serving(options: WorkerOptions) -> ServingEngine:
    """The engine behind the worker; vLLM is imported only when asked for."""
    if options.engine == "vllm":
        from quiesce.adapters.vllm import installed_vllm_version  # noqa: PLC0415
        from quiesce.adapters.vllm.serving import VllmServing  # noqa: PLC0415

        if installed_vllm_version() is None:
            raise EngineNotInstalled("vllm", "vllm", "vllm")
        assert options.model is not None
        # vLLM's own shutdown must fit in the cleanup reserve (its default is 5 s, then kill).
        return VllmServing(options.model, options.role, max_model_len=options.max_model_len,
                           shutdown_timeout_s=max(1.0, options.cleanup_reserve_s - 1.0),
                           enforce_eager=True, dtype=options.dtype,
                           **({"gpu_memory_utilization": options.gpu_memory_utilization}
                              if options.gpu_memory_utilization is not None else {}))
    return SimServing(SimConfig(decode_step_s=options.decode_step_s), options.role,
                      options.name)


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
    serving = build_serving(options)
    await serving.start()
    gate = AdmissionGate()
    lifecycle = Lifecycle(gate=gate, probe=serving.probe,
                          discovery=InMemoryDiscovery(options.name),
                          config=DrainConfig(router_grace_s=options.router_grace_s))
    shutdown = Shutdown(lifecycle, serving.control,
                        ShutdownPolicy(total_s=options.budget_s,
                                       cleanup_reserve_s=options.cleanup_reserve_s))
    shutdown.install_signal_handlers()

    api = EmbeddedServer(create_completions_app(serving, gate, options.engine),
                         bind_socket(options.host, options.port))
    admin = EmbeddedServer(create_admin_app(lifecycle, token=token,
                                            metrics=WorkerMetrics(lifecycle)),
                           bind_socket(options.admin_host, options.admin_port))
    await api.start()
    await admin.start()
    await lifecycle.start()
    _emit({"event": "ready", "port": api.port, "admin_port": admin.port, "pid": os.getpid()})

    await shutdown.wait_requested()
    report = await shutdown.run()
    # Every admitted stream has ended (or was aborted); close the listeners last.
    await api.stop()
    await admin.stop()
    _emit({"event": "exit", **report.to_dict()})
    return report.exit_code


def serve_main(args: argparse.Namespace) -> int:
    """Entry of ``quiesce serve``; configuration errors exit 2 with one clear line."""
    try:
        return asyncio.run(run_worker(options_from_args(args)))
    except (ConfigError, EngineNotInstalled, OSError) as exc:
        print(f"quiesce serve: {exc}", file=sys.stderr)
        return 2
