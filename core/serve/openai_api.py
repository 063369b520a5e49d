"""The serving API of the reference worker: an OpenAI-compatible HTTP face.

Routes: ``GET /v1/models`` (the served model), ``POST /v1/completions`` and
``POST /v1/chat/completions``, each streaming (server-sent events, ``data: {...}`` lines
ending with ``data: [DONE]``) or answering one JSON object. Request bodies and their
mapping to the engine are in :mod:`quiesce.serve.openai_protocol`.

Every request goes through the admission gate before any work starts, and ends in
exactly one :class:`~quiesce.admission.Outcome` (see :mod:`quiesce.admission`): the
engine's finish reason ``stop``/``length`` is ``completed``; :class:`RequestAborted`
(engine abort, engine dead), or an engine stream that ends without a finish reason, is
``lost``; :class:`RequestRejected` is ``rejected``; a client that leaves is
``client_gone``. A completed request is released only after its last byte (the JSON
answer, or ``usage`` and ``[DONE]``) was handed to the server, so a drain never ends
before the answer did.

Errors use the typed body of :func:`quiesce.admin.server.error_response`
(``{"error": {"type", "message", "retryable"}}``):

- 400 ``invalid_request``: malformed JSON, an unknown or invalid parameter, or input the
  engine refused (a prompt longer than the context, no chat template) — outcome
  ``rejected`` once admitted; nothing ran;
- 404 ``model_not_found``: ``model`` names another model; 404/405 for unknown routes;
- 503 ``worker_draining`` (retryable): the gate is closed; the request never started;
- 503 ``request_aborted``: the engine ended the request (outcome ``lost``).

A stream that already started reports an error as one last event,
``data: {"error": {"type", "message", "retryable", "outcome"}}``, and no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from quiesce.admin.server import error_response
from quiesce.admission import Admission, AdmissionGate, Outcome
from quiesce.engine import EngineControl
from quiesce.errors import RequestAborted, RequestRejected, WorkerDraining
from quiesce.generation import FINISHED_BY_ENGINE, Delta, Prompt, Sampling
from quiesce.probe import QuiescenceProbe
from quiesce.serve.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    sampling_from,
)


class ServingEngine(Protocol):
    """What the reference worker needs from an engine (``SimServing``, ``VllmServing``)."""

    @property
    def probe(self) -> QuiescenceProbe: ...

    @property
    def control(self) -> EngineControl: ...

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names a request's ``model`` may use; the first is the served model name."""
        ...

    async def start(self) -> None: ...

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The conversation as one prompt; raises RequestRejected if it cannot (no template)."""
        ...

    def stream(self, prompt: Prompt, sampling: Sampling, request_id: str,
               kv_transfer_params: Mapping[str, Any]) -> AsyncIterator[Delta]:
        """Start a request. Raises RequestRejected at once for parameters the engine cannot
        honour; the stream raises RequestAborted, or RequestRejected for input refused
        once the engine saw it. The last delta carries the finish reason."""
        ...


class AdmittedStream(StreamingResponse):
    """A streaming response that releases its admission however the response ends,
    even if the client left before the body generator ever started."""

    def __init__(self, body: AsyncIterator[str], admission: Admission) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except BaseException as exc:
            self.admission.end_by(exc)
            raise
        finally:  # the client left before the body started: it is gone
            self.admission.end_by(asyncio.CancelledError())


class AdmittedAnswer(JSONResponse):
    """A JSON answer that holds its admission until it was sent, then records ``outcome``."""

    def __init__(self, content: dict[str, Any], admission: Admission, outcome: Outcome) -> None:
        super().__init__(content)
        self.admission = admission
        self.outcome = outcome

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except BaseException as exc:
            self.admission.end_by(exc)
            raise
        self.admission.finish(self.outcome)


@dataclasses.dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, delta: Delta) -> None:
        self.completion_tokens += delta.tokens
        if delta.prompt_tokens is not None:
            self.prompt_tokens = delta.prompt_tokens

    def to_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _event(payload: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error_event(kind: str, message: str, outcome: Outcome) -> str:
    return _event({"error": {"type": kind, "message": message, "retryable": False,
                             "outcome": outcome.value}})


@dataclasses.dataclass(frozen=True)
class _Shape:
    """How one request's answers look: a text completion or a chat completion."""

    chat: bool
    request_id: str
    model: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model}

    def chunk(self, delta: Delta, usage: _Usage | None, role: bool = False) -> str:
        if self.chat:
            content: dict[str, str] = {"role": "assistant", "content": ""} if role else {
                "content": delta.text}
            choice: dict[str, Any] = {"index": 0, "delta": content}
        else:
            choice = {"index": 0, "text": delta.text}
        choice.update(finish_reason=delta.finish_reason, logprobs=None)
        payload = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        payload["choices"] = [choice]
        if usage is not None:
            payload["usage"] = usage.to_dict()
        if delta.kv_transfer_params is not None:
            payload["kv_transfer_params"] = dict(delta.kv_transfer_params)
        return _event(payload)

    def usage_chunk(self, usage: _Usage) -> str:
        payload = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        payload.update(choices=[], usage=usage.to_dict())
        return _event(payload)

    def answer(self, text: str, last: Delta, usage: _Usage) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0,
                                      "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(finish_reason=last.finish_reason, logprobs=None)
        payload = self._envelope("chat.completion" if self.chat else "text_completion")
        payload.update(choices=[choice], usage=usage.to_dict(),
                       kv_transfer_params=(dict(last.kv_transfer_params)
                                           if last.kv_transfer_params is not None else None))
        return payload


UNFINISHED = "the engine ended the request without a finish reason"


async def _close(deltas: AsyncIterator[Delta]) -> None:
    close = getattr(deltas, "aclose", None)
    if close is not None:
        await close()


async def _sse(deltas: AsyncIterator[Delta], shape: _Shape, admission: Admission,
               include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
    """The event stream of one admitted request; records its outcome (module docstring)."""
    usage = _Usage()
    running = usage if continuous_usage else None
    last: Delta | None = None
    with admission:
        try:
            if shape.chat:
                yield shape.chunk(Delta("", 0), running, role=True)
            async for delta in deltas:
                usage.add(delta)
                last = delta
                if delta.text or delta.finish_reason is not None:
                    yield shape.chunk(delta, running)
        except RequestRejected as exc:
            admission.finish(Outcome.REJECTED)
            yield _error_event("invalid_request", str(exc), Outcome.REJECTED)
            return
        except RequestAborted as exc:
            admission.finish(Outcome.LOST)
            yield _error_event("request_aborted", str(exc), Outcome.LOST)
            return
        finally:
            await _close(deltas)
        if last is None or last.finish_reason not in FINISHED_BY_ENGINE:
            admission.finish(Outcome.LOST)
            yield _error_event("request_aborted", UNFINISHED, Outcome.LOST)
            return
        if include_usage:
            yield shape.usage_chunk(usage)
        yield "data: [DONE]\n\n"
        admission.finish(Outcome.COMPLETED)


async def _answer(deltas: AsyncIterator[Delta], shape: _Shape, admission: Admission) -> Response:
    """The one JSON answer of an admitted, non-streaming request; records its outcome."""
    usage = _Usage()
    text: list[str] = []
    last: Delta | None = None
    try:
        async for delta in deltas:
            usage.add(delta)
            text.append(delta.text)
            last = delta
    except RequestRejected as exc:
        admission.finish(Outcome.REJECTED)
        return error_response(400, "invalid_request", str(exc))
    except RequestAborted as exc:
        admission.finish(Outcome.LOST)
        return error_response(503, "request_aborted", str(exc))
    except BaseException as exc:
        admission.end_by(exc)
        raise
    finally:
        await _close(deltas)
    if last is None or last.finish_reason not in FINISHED_BY_ENGINE:
        admission.finish(Outcome.LOST)
        return error_response(503, "request_aborted", UNFINISHED)
    try:  # rendering the answer can fail too (e.g. a connector's odd kv_transfer_params)
        return AdmittedAnswer(shape.answer("".join(text), last, usage), admission,
                              Outcome.COMPLETED)
    except BaseException as exc:
        admission.end_by(exc)
        raise


def create_completions_app(serving: ServingEngine, gate: AdmissionGate,
                           model_name: str | None = None) -> FastAPI:
    """The serving API: every request is admitted through ``gate`` before it starts.

    ``model_name``: the served model name (default: the engine's first
    :attr:`~ServingEngine.model_names`); requests may name it or any of the engine's names.
    """
    served = model_name if model_name is not None else serving.model_names[0]
    accepted = {served, *serving.model_names}
    started = int(time.time())
    app = FastAPI(title="quiesce reference worker", version="1")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
            f"{e.get('msg')}" for e in exc.errors())
        return error_response(400, "invalid_request", problems or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "not_found", 405: "method_not_allowed"}
        return error_response(exc.status_code, kinds.get(exc.status_code, "http_error"),
                              str(exc.detail), headers=getattr(exc, "headers", None))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served, "object": "model",
                                            "created": started, "owned_by": "quiesce"}]}

    async def generate(body: GenerationRequest, prompt: Callable[[], Prompt],
                       chat: bool) -> Response:
        if body.model is not None and body.model not in accepted:
            return error_response(404, "model_not_found",
                                  f"the model {body.model!r} is not served here; "
                                  f"this worker serves {served!r}")
        request_id = body.request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            admission = gate.admit(request_id)
        except WorkerDraining as exc:
            return error_response(503, "worker_draining", str(exc), retryable=True)
        try:
            deltas = serving.stream(prompt(), sampling_from(body), request_id,
                                    body.kv_transfer_params or {})
        except RequestRejected as exc:
            admission.finish(Outcome.REJECTED)
            return error_response(400, "invalid_request", str(exc))
        except BaseException as exc:
            admission.end_by(exc)
            raise
        shape = _Shape(chat, request_id, served)
        if body.stream:
            return AdmittedStream(_sse(deltas, shape, admission, body.include_usage,
                                       body.continuous_usage), admission)
        return await _answer(deltas, shape, admission)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        return await generate(body, body.engine_prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        return await generate(body, lambda: serving.render_chat(body.chat_messages()),
                              chat=True)

    return app
