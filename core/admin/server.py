"""The admin HTTP API of a worker (FastAPI on uvicorn, the stack vLLM and SGLang ship).

Routes (admin routes need ``Authorization: Bearer <token>`` when a token is set):

=========================  =====  ===========================================================
route                      auth   answer
=========================  =====  ===========================================================
``POST /engine/drain``     yes    start (or join) a drain; body ``{"budget_s", "wait",
                                  "wait_timeout_s"}``, all optional. 202 while draining,
                                  200 once drained. 409 while stopping.
``POST /engine/resume``    yes    back to serving. 409 while stopping; 503 if re-registration
                                  failed (the worker is draining again; see ``last_error``).
``GET /engine/status``     yes    state, generation, inflight, pending work (read now, with its
                                  source and unknown reasons), registration, drain progress.
``GET /health/live``       no     200 while the process and its event loop answer.
``GET /health/ready``      no     200 only while serving, else 503: a readiness probe takes the
                                  pod out of Service endpoints as soon as a drain starts.
``GET /metrics``           no     Prometheus exposition (:mod:`quiesce.admin.metrics`).
=========================  =====  ===========================================================

Every error is a 4xx (or the 503 above) with one body shape:
``{"error": {"type": ..., "message": ..., "retryable": bool}}``. Bad input never
changes state: validation runs before the lifecycle is touched. ``state ==
"drained"`` is the only deletion-safety signal.

Security: the token is compared in constant time. Health and metrics are open (a
kubelet and a Prometheus scraper must reach them without credentials); they show
no request content. :func:`check_bind` refuses a non-loopback address without a
token, and :class:`EmbeddedServer` leaves signal handling to :mod:`quiesce.shutdown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from quiesce.admin.metrics import WorkerMetrics
from quiesce.errors import ConfigError, InvalidTransition, QuiesceError, ResumeFailed
from quiesce.lifecycle import Lifecycle, State

log = logging.getLogger("quiesce.admin.server")

MAX_BUDGET_S = 86_400.0
"""Largest budget or wait accepted (one day); anything larger is a typo, not a plan."""
MAX_BODY_BYTES = 8_192
TOKEN_ENV = "QUIESCE_ADMIN_TOKEN"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class DrainBody(BaseModel):
    """Body of ``POST /engine/drain``; unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid", strict=True)

    budget_s: float | None = Field(
        default=None, gt=0, le=MAX_BUDGET_S, allow_inf_nan=False,
        description="Bound of this drain in seconds; unset: the worker's default (or none).")
    wait: bool = Field(default=False, description="Answer only when the drain run ended.")
    wait_timeout_s: float | None = Field(
        default=None, gt=0, le=MAX_BUDGET_S, allow_inf_nan=False,
        description="With wait: answer after at most this long (the drain goes on).")


class ErrorDetail(BaseModel):
    type: str
    message: str
    retryable: bool = False


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_response(status: int, kind: str, message: str, retryable: bool = False,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(type=kind, message=message, retryable=retryable))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class _ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, retryable: bool = False,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.response = error_response(status, kind, message, retryable, headers)


class AdminGuard:
    """ASGI middleware in front of everything else, so bad requests cost nothing:

    1. admin routes (``/engine/...``) need the bearer token, checked before the body is
       read (an unauthenticated caller learns nothing, not even a validation error);
    2. request bodies over ``limit`` bytes get a typed 413, whether the length is
       declared, lied about or chunked: the body is read here, up to the limit, and
       replayed to the app.
    """

    def __init__(self, app: ASGIApp, token: str | None, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.expected = token.encode() if token is not None else None
        self.limit = limit

    def _authorized(self, scope: Scope) -> bool:
        if self.expected is None or not str(scope.get("path", "")).startswith("/engine/"):
            return True
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await error_response(401, "unauthorized", "missing or wrong bearer token",
                                 headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        too_large = error_response(413, "body_too_large", f"request body over {self.limit} bytes")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await too_large(scope, receive, send)
            return
        body: list[Message] = []
        size = 0
        while True:
            message = await receive()
            body.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return body.pop(0) if body else await receive()

        await self.app(scope, replay, send)


def load_token(token_file: str | None = None) -> str | None:
    """The admin token from ``token_file`` or ``$QUIESCE_ADMIN_TOKEN``; None if neither is set."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError("admin_token_file", f"cannot read {token_file}: {exc}") from exc
        if not token:
            raise ConfigError("admin_token_file", f"{token_file} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to expose unauthenticated admin routes beyond this machine."""
    if token is None and not is_loopback(host):
        raise ConfigError("admin_host", f"refusing to bind the admin API to {host} without a "
                          f"token: set ${TOKEN_ENV} or --admin-token-file, or bind 127.0.0.1")


def create_admin_app(lifecycle: Lifecycle, *, token: str | None = None,
                     metrics: WorkerMetrics | None = None,
                     extra_status: Callable[[], Mapping[str, object]] | None = None) -> FastAPI:
    """The admin API for ``lifecycle``. ``token=None`` leaves admin routes open (loopback).

    ``extra_status`` adds the worker's own fields to ``GET /engine/status`` (the reference
    worker adds ``signal_guard``); it must be quick and must not raise.
    """
    metrics = metrics if metrics is not None else WorkerMetrics(lifecycle)
    app = FastAPI(title="quiesce worker admin API", version="1",
                  responses={400: {"model": ErrorBody}, 401: {"model": ErrorBody},
                             413: {"model": ErrorBody}, 422: {"model": ErrorBody}})
    admin: dict[str, Any] = {"openapi_extra": {"security": [{"bearer": []}]}
                             if token is not None else {}}

    @app.exception_handler(_ApiError)
    async def _api_error(_: Request, exc: _ApiError) -> JSONResponse:
        return exc.response

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}"
                             for e in exc.errors())
        return error_response(422, "invalid_request", problems or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}
        return error_response(exc.status_code, kinds.get(exc.status_code, "http_error"),
                              str(exc.detail), headers=getattr(exc, "headers", None))

    async def status_dict() -> dict[str, object]:
        status = (await lifecycle.read_status()).to_dict()
        if extra_status is not None:
            status.update(extra_status())
        return status

    @app.post("/engine/drain", status_code=202, **admin,
              responses={200: {"description": "drained"}, 409: {"model": ErrorBody}})
    async def drain(body: DrainBody | None = None) -> JSONResponse:
        body = body if body is not None else DrainBody()
        try:
            run = await lifecycle.drain(budget_s=body.budget_s)
        except InvalidTransition as exc:
            raise _ApiError(409, "invalid_transition", str(exc)) from exc
        if body.wait:
            # waiting never cancels the run: a client that leaves cannot strand the worker
            await run.wait(body.wait_timeout_s)
        status = await status_dict()
        return JSONResponse(status, status_code=200 if status["state"] == "drained" else 202)

    @app.post("/engine/resume", **admin,
              responses={409: {"model": ErrorBody}, 503: {"model": ErrorBody}})
    async def resume() -> dict[str, object]:
        try:
            # shielded: a client that disconnects must not cut a resume in half
            await asyncio.shield(lifecycle.resume())
        except InvalidTransition as exc:
            raise _ApiError(409, "invalid_transition", str(exc)) from exc
        except ResumeFailed as exc:
            raise _ApiError(503, "resume_failed", str(exc), retryable=True) from exc
        return await status_dict()

    @app.get("/engine/status", **admin)
    async def status() -> dict[str, object]:
        return await status_dict()

    @app.get("/health/live")
    async def live() -> dict[str, str]:
        return {"status": "live"}

    @app.get("/health/ready", responses={503: {"description": "not serving"}})
    async def ready() -> JSONResponse:
        state = lifecycle.state
        return JSONResponse({"status": state.value},
                            status_code=200 if state is State.SERVING else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.exception_handler(QuiesceError)
    async def _quiesce_error(_: Request, exc: QuiesceError) -> JSONResponse:
        return error_response(400, type(exc).__name__, str(exc))

    app.add_middleware(AdminGuard, token=token)
    if token is not None:
        _document_bearer(app)
    return app


def _document_bearer(app: FastAPI) -> None:
    """Declare the bearer scheme in the OpenAPI document (enforced by :class:`AdminGuard`)."""
    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = FastAPI.openapi(app)
            document.setdefault("components", {}).setdefault("securitySchemes", {})[
                "bearer"] = {"type": "http", "scheme": "bearer"}
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]


LISTEN_BACKLOG = 128


def bind_socket(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port=0`` picks a free one; read it from
    ``getsockname``), listening unless ``listen`` is False: then connections are refused
    until the caller calls ``sock.listen(LISTEN_BACKLOG)``. Raises OSError (port in use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server inside the worker's own loop; signals are left to quiesce.shutdown."""

    def __init__(self, app: Any, sock: socket.socket, graceful_s: float = 5.0,
                 keep_alive_s: int = 5) -> None:
        super().__init__(uvicorn.Config(app, log_level="warning", lifespan="off",
                                        timeout_graceful_shutdown=max(1, round(graceful_s)),
                                        timeout_keep_alive=keep_alive_s))
        self.sock = sock
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        port: int = self.sock.getsockname()[1]
        return port

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def start(self) -> None:
        """Serve in the background; returns once listening (raises if startup failed)."""
        self._task = asyncio.get_running_loop().create_task(self.serve(sockets=[self.sock]))
        backoff = 0.001
        while not self.started and not self._task.done():
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.05)
        if self._task.done():
            self._task.result()

    async def stop(self) -> None:
        """Stop accepting; open responses finish within the graceful timeout."""
        self.should_exit = True
        if self._task is not None:
            await asyncio.wait({self._task})
