"""Admission for an engine's own ASGI server: every request through the gate, unchanged.

:class:`AdmissionMiddleware` is pure ASGI (no ``BaseHTTPMiddleware``: nothing is buffered
or re-encoded), for a server quiesce does not own: vLLM's OpenAI server
(:mod:`quiesce.serve.vllm_serve`, :data:`VLLM_ROUTES`) or SGLang's
(:mod:`quiesce.serve.sglang_serve`, :data:`SGLANG_ROUTES`). Per HTTP request:

- ``GET`` :data:`READY_PATH` is answered here: 200 ``{"status": "serving"}`` while the
  lifecycle serves, else 503 with the state: a readiness probe takes the pod out of the
  Service's endpoints as soon as a drain starts. The engine's own ``/health`` is left
  as it is (it says whether the engine is alive, not whether to send it work).
- Every ``POST`` but the server's control routes (:class:`ServerRoutes`: tokenize, cancels
  and aborts, LoRA loading, weight updates, profiling, sleep, pause...: they start no
  generation, and a cancel shortens a drain; a route not listed is gated: fail closed)
  and every WebSocket is admitted through the
  :class:`~quiesce.admission.AdmissionGate`. A closed gate answers 503 with a typed,
  retryable error in the OpenAI shape (``{"error": {"message", "type":
  "worker_draining", "param", "code": 503, "retryable": true}}``), ``Retry-After: 1`` and
  ``Connection: close`` (the client's next attempt opens a new connection, which a
  balancer can send elsewhere); a WebSocket is accepted and closed at once with code 1013
  (try again later). Nothing of the request reaches the engine. Paths are matched
  without the server's ``root_path``.
- An admitted request's bytes pass through untouched: its answer is byte for byte what
  the server sends. Each body chunk is only searched (``bytes.find``) for the marks of a
  request the engine ended (:func:`ended_by_engine`).

How an admitted request ended (:class:`~quiesce.admission.Outcome`), read from what the
server sent, failing closed: a 5xx, an exception out of the app, or a success whose body
says the engine ended it (:func:`ended_by_engine`: ``"error"`` at the top of a JSON body
or an SSE ``data:`` event, or one of the server's marks: ``"finish_reason":"abort"``, a
Responses API ``"status": "cancelled"`` or ``"failed"``; SGLang's native ``"finish_reason":
{"type":"abort"}``): ``lost`` (a 200 stream with an error event inside is a
lost request); the client disconnected before the answer was complete (vLLM then aborts
the request and may still send a short answer nobody reads): ``client_gone``; a 4xx:
``rejected`` (its own bad input, whatever its error body says); a response never
finished: ``lost``; otherwise ``completed``. A WebSocket session counts ``completed``
when the app returns and ``lost`` on an exception (its close codes are not read), and
holds the drain while it stays open.
"""

from __future__ import annotations

import dataclasses
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
WEBSOCKET_TRY_AGAIN_LATER = 1013
_ERROR_MARK = b'"error"'


@dataclasses.dataclass(frozen=True)
class ServerRoutes:
    """An engine server's routes as admission sees them."""

    ungated: frozenset[str]
    """``POST`` routes that start no generation: neither gated nor counted."""
    ended_marks: tuple[bytes, ...]
    """Byte strings that, in a successful answer, say the engine ended the request (each
    is a JSON key and value as the server encodes them: compact, no spaces)."""
    ungated_prefix_suffix: tuple[str, str] | None = None
    """Also ungated: paths with this prefix and suffix (a cancel route with an id)."""

    def is_ungated(self, path: str) -> bool:
        """Whether a ``POST`` to ``path`` (without the root path) starts no generation."""
        if path in self.ungated:
            return True
        if self.ungated_prefix_suffix is None:
            return False
        prefix, suffix = self.ungated_prefix_suffix
        return path.startswith(prefix) and path.endswith(suffix)


_VLLM_UNGATED = frozenset({
    "/tokenize", "/detokenize", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    "/abort_requests", "/inference/v1/abort_requests", "/ping",
    "/start_profile", "/stop_profile", "/reset_prefix_cache", "/reset_mm_cache",
    "/reset_encoder_cache", "/release_kv_cache_memory", "/sleep", "/wake_up", "/pause",
    "/resume", "/scale_elastic_ep", "/is_scaling_elastic_ep", "/collective_rpc",
    "/update_weights", "/update_weight_version", "/start_weight_update",
    "/start_draft_weight_update", "/finish_weight_update", "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine", "/weight_checker",
})
_RESPONSES_ENDED = (b'"finish_reason":"abort"', b'"status":"cancelled"', b'"status":"failed"')
VLLM_ROUTES = ServerRoutes(_VLLM_UNGATED, _RESPONSES_ENDED, ("/v1/responses/", "/cancel"))
"""vLLM 0.32's server: its ``POST`` routes that start no generation (and
``/v1/responses/{id}/cancel``); an OpenAI ``"finish_reason":"abort"``, a Responses API
object ``"cancelled"`` or ``"failed"``."""
SGLANG_ROUTES = ServerRoutes(frozenset({
    "/set_internal_state", "/flush_cache", "/add_external_corpus", "/remove_external_corpus",
    "/hicache/storage-backend/clear", "/start_profile", "/stop_profile", "/set_trace_level",
    "/freeze_gc", "/start_expert_distribution_record", "/stop_expert_distribution_record",
    "/dump_expert_distribution_record", "/update_weights_from_disk",
    "/init_weights_send_group_for_remote_instance", "/send_weights_to_remote_instance",
    "/init_weights_update_group", "/destroy_weights_update_group",
    "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update",
    "/update_weights_from_distributed", "/update_weights_from_ipc", "/update_weight_version",
    "/get_weights_by_name", "/release_memory_occupation", "/resume_memory_occupation",
    "/weights_checker", "/slow_down", "/pd_role_switch", "/load_lora_adapter",
    "/load_lora_adapter_from_tensors", "/unload_lora_adapter", "/open_session",
    "/close_session", "/configure_logging", "/abort_request", "/parse_function_call",
    "/separate_reasoning", "/pause_generation", "/continue_generation", "/tokenize",
    "/detokenize", "/v1/tokenize", "/v1/detokenize", "/v1/messages/count_tokens",
    "/api/show",
}), (*_RESPONSES_ENDED, b'"type":"abort"'), ("/v1/responses/", "/cancel"))
"""SGLang 0.5.23's server: its ``POST`` routes that start no generation (control, weights,
sessions, profiling, parsing, token counting; ``/v1/responses/{id}/cancel``); the OpenAI
and Responses marks, and its native ``"finish_reason":{"type":"abort",...}``."""


def draining_body(message: str) -> bytes:
    """The 503 body of a closed gate (see the module docstring)."""
    return json.dumps({"error": {"message": message, "type": "worker_draining",
                                 "param": None, "code": 503, "retryable": True}}).encode()


def ended_by_engine(chunk: bytes, marks: tuple[bytes, ...] = _RESPONSES_ENDED) -> bool:
    """Whether a chunk of a successful answer says the engine ended the request: an error
    object at the top of a JSON body or SSE ``data:`` event, or one of ``marks`` (the
    server's: :attr:`ServerRoutes.ended_marks`). Cheap on the common path (a few
    ``bytes.find`` calls); a chunk with an error mark is parsed to be sure."""
    if any(mark in chunk for mark in marks):
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
        status = self.status if self.status is not None else 0
        if status >= 500 or (status < 400 and self.ended_by_engine):
            return Outcome.LOST
        if self.disconnected:
            return Outcome.CLIENT_GONE
        if not self.finished:
            return Outcome.LOST
        return Outcome.REJECTED if status >= 400 else Outcome.COMPLETED


class AdmissionMiddleware:
    """ASGI middleware: admission through ``lifecycle``'s gate (module docstring), for a
    server with ``routes``.

    ``lifecycle`` may be set after construction (the server builds its middleware before
    the worker exists): until then every gated request is refused as draining, and the
    readiness route answers 503 ``starting``.
    """

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle | None = None, *,
                 routes: ServerRoutes = VLLM_ROUTES) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            method, path = scope["method"], _route(scope)
            if path == READY_PATH and method in ("GET", "HEAD"):
                await self._ready(send)
                return
            if method != "POST" or self.routes.is_ungated(path):
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
                if body and not response.ended_by_engine and (response.status or 0) < 400 \
                        and ended_by_engine(body, self.routes.ended_marks):
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
                # closed before accept, uvicorn answers HTTP 403: accept, then say why
                await send({"type": "websocket.accept"})
                await send({"type": "websocket.close", "code": WEBSOCKET_TRY_AGAIN_LATER,
                            "reason": "worker draining: retry elsewhere"})
            return
        with admission:
            try:
                await self.app(scope, receive, send)
            except BaseException as exc:
                admission.end_by(exc)
                raise
            admission.finish(Outcome.COMPLETED)


def _route(scope: Scope) -> str:
    """The request's path as the app routes it: without the server's ``root_path``."""
    path: str = scope["path"]
    root = scope.get("root_path") or ""
    return path[len(root):] or "/" if root and path.startswith(root) else path


async def _refuse(send: Send, message: str) -> None:
    body = draining_body(message)
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
