"""Admission for an engine's own ASGI server (quiesce.serve.asgi_admission), against small
ASGI apps that answer as vLLM's server does (a JSON body, an SSE stream ending in
``data: [DONE]``, an error event inside a 200 stream). The real vLLM server behind the
middleware is covered by tests/integration/vllm/test_vllm_serve.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from quiesce import AdmissionGate, InMemoryDiscovery, Outcome
from quiesce.lifecycle import Lifecycle
from quiesce.probe import PendingWork, Probe, Role
from quiesce.serve.asgi_admission import (
    READY_PATH,
    AdmissionMiddleware,
    Message,
    Receive,
    Scope,
    Send,
    ended_by_engine,
)

STREAM = [b'data: {"id":"c1","choices":[{"text":"a","finish_reason":null}]}\n\n',
          b'data: {"id":"c1","choices":[{"text":"b","finish_reason":"length"}]}\n\n',
          b"data: [DONE]\n\n"]
ERROR_EVENT = b'data: {"error": {"message": "EngineCore died", "type": "InternalServerError", ' \
              b'"param": null, "code": 500}}\n\n'


class IdleProbe(Probe):
    def __init__(self) -> None:
        super().__init__(Role.AGGREGATED, "test")

    async def pending_work(self) -> PendingWork:
        return PendingWork.idle(self.role, self.source)


async def lifecycle() -> Lifecycle:
    life = Lifecycle(gate=AdmissionGate(accepting=False), probe=IdleProbe(),
                     discovery=InMemoryDiscovery("w"))
    await life.start()
    return life


def app_sending(chunks: list[bytes], status: int = 200, *, raise_after: bool = False,
                content_type: bytes = b"text/event-stream") -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type)]})
        for index, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk,
                        "more_body": index < len(chunks) - 1})
        if raise_after:
            raise RuntimeError("engine dead")
    return app


async def call(middleware: AdmissionMiddleware, method: str = "POST",
               path: str = "/v1/completions", *, disconnect: bool = False
               ) -> tuple[list[Message], None]:
    sent: list[Message] = []

    async def receive() -> Message:
        if disconnect:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(b"x-request-id", b"r-1")]}
    await middleware(scope, receive, send)
    return sent, None


def body_of(sent: list[Message]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_a_stream_passes_byte_for_byte_and_counts_completed() -> None:
    life = await lifecycle()
    middleware = AdmissionMiddleware(app_sending(STREAM), life)
    sent, _ = await call(middleware)
    assert body_of(sent) == b"".join(STREAM)
    assert life.gate.outcomes().completed == 1 and life.gate.inflight == 0


async def test_a_200_stream_with_an_error_event_is_lost() -> None:
    life = await lifecycle()
    middleware = AdmissionMiddleware(app_sending([STREAM[0], ERROR_EVENT, STREAM[2]]), life)
    await call(middleware)
    assert life.gate.outcomes().lost == 1 and life.gate.outcomes().completed == 0


VLLM_400 = (b'{"error":{"message":"This model\'s maximum context length is 512 tokens",'
            b'"type":"BadRequestError","param":null,"code":400}}')


@pytest.mark.parametrize(("status", "body", "outcome"), [
    (500, b'{"error": {"message": "engine dead", "code": 500}}', Outcome.LOST),
    (400, VLLM_400, Outcome.REJECTED),  # its own bad input, whatever the error body says
    (401, b'{"error": "Unauthorized"}', Outcome.REJECTED),
    (200, b'{"id": "x", "choices": []}', Outcome.COMPLETED),
    (200, b'{"id": "resp", "object": "response", "status":"cancelled"}', Outcome.LOST),
])
async def test_the_status_then_the_body_decide_a_json_answer(status: int, body: bytes,
                                                            outcome: Outcome) -> None:
    life = await lifecycle()
    middleware = AdmissionMiddleware(app_sending([body], status,
                                                 content_type=b"application/json"), life)
    await call(middleware)
    assert getattr(life.gate.outcomes(), outcome.value) == 1


async def test_a_client_gone_before_a_short_answer_is_client_gone() -> None:
    """vLLM's non-streaming handlers abort a request whose client left and still answer
    ``200 null``, which nobody reads: not a completed request."""
    async def cancelled_then_null(scope: Scope, receive: Receive, send: Send) -> None:
        assert (await receive())["type"] == "http.disconnect"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"null"})

    life = await lifecycle()
    await call(AdmissionMiddleware(cancelled_then_null, life), disconnect=True)
    assert life.gate.outcomes().client_gone == 1 and life.gate.outcomes().completed == 0


async def test_an_exception_out_of_the_app_is_lost_and_raised() -> None:
    life = await lifecycle()
    middleware = AdmissionMiddleware(app_sending(STREAM[:2], raise_after=True), life)
    with pytest.raises(RuntimeError):
        await call(middleware)
    assert life.gate.outcomes().lost == 1


async def test_a_stream_left_unfinished_is_client_gone_only_if_the_client_left() -> None:
    async def half(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": STREAM[0], "more_body": True})
        await receive()

    life = await lifecycle()
    await call(AdmissionMiddleware(half, life), disconnect=True)
    assert life.gate.outcomes().client_gone == 1
    await call(AdmissionMiddleware(half, life), disconnect=False)
    assert life.gate.outcomes().lost == 1  # never finished, client still there: fail closed


async def test_a_closed_gate_answers_a_typed_retryable_503_without_calling_the_app() -> None:
    life = await lifecycle()
    called: list[Scope] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        called.append(scope)

    life.gate.close()
    sent, _ = await call(AdmissionMiddleware(app, life))
    assert not called
    start = sent[0]
    assert start["status"] == 503
    headers = dict(start["headers"])
    assert headers[b"retry-after"] == b"1" and headers[b"connection"] == b"close"
    error = json.loads(body_of(sent))["error"]
    assert error["type"] == "worker_draining" and error["retryable"] is True
    assert error["code"] == 503
    assert life.gate.refused_total == 1


async def test_before_the_worker_exists_gated_requests_are_refused() -> None:
    sent, _ = await call(AdmissionMiddleware(app_sending(STREAM), None))
    assert sent[0]["status"] == 503
    assert "starting" in json.loads(body_of(sent))["error"]["message"]


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/models"), ("GET", "/health"), ("POST", "/tokenize"), ("GET", "/metrics"),
    ("POST", "/abort_requests"), ("POST", "/v1/responses/resp_1/cancel")])
async def test_reads_and_control_routes_are_not_gated(method: str, path: str) -> None:
    life = await lifecycle()
    life.gate.close()
    sent, _ = await call(AdmissionMiddleware(app_sending([b"ok"], content_type=b"text/plain"),
                                             life), method, path)
    assert sent[0]["status"] == 200 and life.gate.admitted_total == 0


async def test_routes_are_matched_without_the_root_path() -> None:
    life = await lifecycle()
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b""}

    async def send(message: Message) -> None:
        sent.append(message)

    await AdmissionMiddleware(app_sending([]), life)(
        {"type": "http", "method": "GET", "path": "/x/quiesce/ready", "root_path": "/x",
         "headers": []}, receive, send)
    assert sent[0]["status"] == 200 and json.loads(body_of(sent)) == {"status": "serving"}


async def test_readiness_fails_as_soon_as_a_drain_starts() -> None:
    life = await lifecycle()
    middleware = AdmissionMiddleware(app_sending([]), life)
    sent, _ = await call(middleware, "GET", READY_PATH)
    assert sent[0]["status"] == 200 and json.loads(body_of(sent)) == {"status": "serving"}
    run = await life.drain()
    sent, _ = await call(middleware, "GET", READY_PATH)
    assert sent[0]["status"] == 503
    await run.wait(5)
    sent, _ = await call(AdmissionMiddleware(app_sending([]), None), "GET", READY_PATH)
    assert sent[0]["status"] == 503 and json.loads(body_of(sent)) == {"status": "starting"}


async def test_a_websocket_is_refused_with_try_again_later_once_draining() -> None:
    life = await lifecycle()
    life.gate.close()
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await AdmissionMiddleware(app_sending([]), life)({"type": "websocket", "path": "/v1/realtime",
                                                      "headers": []}, receive, send)
    # closed before accept, uvicorn would answer HTTP 403: accepted, then closed with 1013
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.close"]
    assert sent[1]["code"] == 1013


@pytest.mark.parametrize(("chunk", "ended"), [
    (STREAM[0], False), (b"data: [DONE]\n\n", False), (ERROR_EVENT, True),
    (b'{"error": {"message": "x"}}', True),
    (b'data: {"choices":[{"text":"\\"error\\""}]}\n\n', False),
    (b'data: {"choices":[{"finish_reason":"abort"}]}\n\n', True),
    (b'event: response.failed\ndata: {"response":{"status":"failed"}}\n\n', True),
])
def test_ended_by_engine_reads_only_top_level_errors_and_aborts(chunk: bytes, ended: bool) -> None:
    assert ended_by_engine(chunk) is ended


async def test_concurrent_requests_are_each_counted_once() -> None:
    life = await lifecycle()
    await asyncio.gather(*(call(AdmissionMiddleware(app_sending(STREAM), life))
                           for _ in range(50)))
    assert life.gate.outcomes().completed == 50 and life.gate.admitted_total == 50
    assert life.gate.inflight == 0
