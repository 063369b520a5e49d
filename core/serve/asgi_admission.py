"""Admission for an engine's own ASGI server: every request through the gate, unchanged.

:class:`AdmissionMiddleware` is pure ASGI (no ``BaseHTTPMiddleware``: nothing is buffered
or re-encoded), for a server quiesce does not own, such as vLLM's OpenAI server
(:mod:`quiesce.serve.vllm_serve`). Per HTTP request:

- ``GET`` :data:`READY_PATH` is answered here: 200 ``{"status": "serving"}`` while the
  lifecycle serves, else 503 with the state: a readiness probe takes the pod out of the
  Service's endpoints as soon as a drain starts. The engine's own ``/health`` is left
  as it is (it says whether the engine is alive, not whether to send it work).
- Every ``POST`` but those in :data:`UNGATED` (control routes that start no generation:
  tokenize, LoRA loading, profiling, sleep...) and every WebSocket is admitted through
  the :class:`~quiesce.admission.AdmissionGate`. A closed gate answers 503 with a typed,
  retryable error in the OpenAI shape (``{"error": {"message", "type":
  "worker_draining", "param", "code": 503, "retryable": true}}``), ``Retry-After: 1`` and
  ``Connection: close`` (the client's next attempt opens a new connection, which a
  balancer can send elsewhere); a WebSocket is closed with code 1013 (try again later).
  Nothing of the request reaches the engine.
- An admitted request's bytes pass through untouched: its answer is byte for byte what
  the server sends. Each body chunk is only searched (``bytes.find``) for the two marks
  of a request the engine ended (:func:`ended_by_engine`).

How an admitted request ended (:class:`~quiesce.admission.Outcome`), read from what the
server sent, failing closed: the client disconnected before the last byte:
``client_gone``; a 5xx, an exception out of the app, a response never finished, or a
body with an error event (``"error":`` at the top of a JSON body or of an SSE ``data:``
event) or ``"finish_reason":"abort"``: ``lost`` (a 200 stream with an error event inside
is a lost request); a 4xx: ``rejected`` (its own bad input); otherwise ``completed``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from quiesce.admission import Admission, Outcome
from quiesce.errors import WorkerDraining
from quiesce.lifecycle import Lifecycle
from quiesce.lifecycle_state import State

log = logging.getLogger("quiesce.serve.asgi_admission")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

READY_PATH = "/quiesce/ready"
UNGATED = frozenset({
    "/tokenize", "/detokenize", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    "/start_profile", "/stop_profile", "/reset_prefix_cache", "/reset_mm_cache",
    "/sleep", "/wake_up", "/pause", "/resume", "/scale_elastic_ep", "/is_scaling_elastic_ep",
    "/collective_rpc", "/reset_encoder_cache",
})
"""``POST`` routes of vLLM's server that start no generation: neither gated nor counted."""
WEBSOCKET_TRY_AGAIN_LATER = 1013
_ERROR_MARK = b'"error"'
_ABORT_MARK = b'"finish_reason":"abort"'


def draining_body(message: str) -> bytes:
    """The 503 body of a closed gate (see the module docstring)."""
    return json.dumps({"error": {"message": message, "type": "worker_draining",
                                 "param": None, "code": 503, "retryable": True}}).encode()


def ended_by_engine(chunk: bytes) -> bool:
    """Whether a body chunk says the engine ended the request: an error object at the top
    of a JSON body or SSE ``data:`` event, or ``"finish_reason":"abort"``. Cheap on the
    common path (two ``bytes.find`` calls); a chunk with a mark is parsed to be sure."""
    if _ABORT_MARK in chunk:
        return True
    if _ERROR_MARK not in chunk:
        return False
    for line in chunk.splitlines():
        text = line[5:] if line.startswith(b"data:") else line
        if _ERROR_MARK not in text:
            continue
        try:
            event = json.loads(text)
        except ValueError:
            continue
        if isinstance(event, dict) and "error" in event:
            return True
    return False


class _Response:
    """What the server sent for one admitted request."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.finished = False
        self.ended_by_engine = False
        self.disconnected = False

    def outcome(self) -> Outcome:
        if self.finished:
            if (self.status is not None and self.status >= 500) or self.ended_by_engine:
                return Outcome.LOST
            if self.status is not None and self.status >= 400:
                return Outcome.REJECTED
            return Outcome.COMPLETED
        return Outcome.CLIENT_GONE if self.disconnected else Outcome.LOST


class AdmissionMiddleware:
    """ASGI middleware: admission through ``lifecycle``'s gate (module docstring).

    ``lifecycle`` may be set after construction (the server builds its middleware before
    the worker exists): until then every gated request is refused as draining, and the
    readiness route answers 503 ``starting``.
    """

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle | None = None) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            method, path = scope["method"], scope["path"]
            if path == READY_PATH and method in ("GET", "HEAD"):
                await self._ready(send)
                return
            if method != "POST" or path in UNGATED:
                await self.app(scope, receive, send)
                return
            await self._admitted_http(scope, receive, send)
        elif kind == "websocket":
            await self._admitted_websocket(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _admit(self, scope: Scope) -> Admission:
        if self.lifecycle is None:
            raise WorkerDraining(state="starting")
        request_id = None
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                request_id = value.decode("latin-1")
                break
        return self.lifecycle.gate.admit(request_id)

    async def _ready(self, send: Send) -> None:
        state = self.lifecycle.state.value if self.lifecycle is not None else "starting"
        serving = self.lifecycle is not None and self.lifecycle.state is State.SERVING
        body = json.dumps({"status": state}).encode()
        await send({"type": "http.response.start", "status": 200 if serving else 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _admitted_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            admission = self._admit(scope)
        except WorkerDraining as exc:
            await _refuse(send, str(exc))
            return
        response = _Response()

        async def watched_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not response.finished:
                response.disconnected = True
            return message

        async def watched_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                response.status = message["status"]
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if body and not response.ended_by_engine and ended_by_engine(body):
                    response.ended_by_engine = True
                await send(message)
                if not message.get("more_body", False):
                    response.finished = True
                return
            await send(message)

        with admission:
            try:
                await self.app(scope, watched_receive, watched_send)
            except BaseException as exc:
                admission.end_by(exc)
                raise
            admission.finish(response.outcome())

    async def _admitted_websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            admission = self._admit(scope)
        except WorkerDraining:
            message = await receive()  # websocket.connect
            if message["type"] == "websocket.connect":
                await send({"type": "websocket.close", "code": WEBSOCKET_TRY_AGAIN_LATER})
            return
        with admission:
            try:
                await self.app(scope, receive, send)
            except BaseException as exc:
                admission.end_by(exc)
                raise
            admission.finish(Outcome.COMPLETED)


async def _refuse(send: Send, message: str) -> None:
    body = draining_body(message)
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
