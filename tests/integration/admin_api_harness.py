"""The worker under test and the helpers of the admin HTTP API tests
(``test_admin_api_*.py``; their ``worker`` and ``client`` fixtures are in ``conftest.py``).

A :class:`Worker` is a real :class:`~quiesce.lifecycle.Lifecycle` over a real
:class:`~quiesce.adapters.sim.SimEngine` (its probe, an :class:`AdmissionGate` and a
:class:`FlakyDiscovery`) with ``create_admin_app`` on top, reached in-process through
``httpx.ASGITransport`` (:func:`asgi_client`) or over TCP (:func:`embedded_server`).
No timing asserts: every wait is on a condition and bounded (:data:`BOUND_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from quiesce.adapters.sim import SimConfig, SimEngine, SimProbe, SimRequest
from quiesce.admin.server import MAX_BODY_BYTES, EmbeddedServer, bind_socket, create_admin_app
from quiesce.admission import Admission, AdmissionGate, Outcome
from quiesce.discovery import InMemoryDiscovery
from quiesce.drain import DrainConfig
from quiesce.lifecycle import DrainRun, Lifecycle, State

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRACE_S = 0.05
"""Router grace of every lifecycle here: short, but long enough to be a real stage."""
BOUND_S = 10.0
"""Upper bound of every wait in these tests; a healthy run needs milliseconds."""


Snapshot = tuple[State, int, bool, bool, int]


# -- the worker under test ---------------------------------------------------------------


class FlakyDiscovery(InMemoryDiscovery):
    """``InMemoryDiscovery`` whose registration raises while ``fail_register`` is set."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(instance_id)
        self.fail_register = False

    async def register(self) -> None:
        if self.fail_register:
            raise ConnectionError("discovery backend unreachable")
        await super().register()


@dataclasses.dataclass
class Worker:
    engine: SimEngine
    gate: AdmissionGate
    discovery: FlakyDiscovery
    lifecycle: Lifecycle
    app: FastAPI

    def snapshot(self) -> Snapshot:
        """Everything bad input must leave alone."""
        lifecycle = self.lifecycle
        return (lifecycle.state, lifecycle.generation, self.gate.accepting,
                self.discovery.registered, self.gate.admitted_total)


def build_worker(token: str | None = TOKEN, grace_s: float = GRACE_S) -> Worker:
    engine = SimEngine(SimConfig(decode_step_s=0.001), name="admin-api")
    gate = AdmissionGate()
    discovery = FlakyDiscovery("worker-0")
    lifecycle = Lifecycle(gate=gate, probe=SimProbe(engine), discovery=discovery,
                          config=DrainConfig(router_grace_s=grace_s))
    return Worker(engine, gate, discovery, lifecycle, create_admin_app(lifecycle, token=token))


@contextlib.asynccontextmanager
async def running_worker(token: str | None = TOKEN) -> AsyncIterator[Worker]:
    """A started engine and a serving, registered lifecycle; both stopped on exit."""
    worker = build_worker(token)
    await worker.engine.start()
    try:
        await worker.lifecycle.start()
        yield worker
    finally:
        await worker.lifecycle.stop()
        await worker.engine.shutdown()


def asgi_client(app: FastAPI) -> httpx.AsyncClient:
    # raise_app_exceptions=False: an unhandled error must show up as the 500 a real
    # server would send, so the assertions below see it.
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://test")


@contextlib.asynccontextmanager
async def embedded_server(app: FastAPI) -> AsyncIterator[str]:
    """A real uvicorn server on 127.0.0.1 (a free port); yields its base URL."""
    server = EmbeddedServer(app, bind_socket("127.0.0.1", 0), graceful_s=1.0)
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.stop()


# -- helpers -------------------------------------------------------------------------------


def assert_error(response: httpx.Response, status: int | None, kind: str | None, *,
                 retryable: bool = False) -> dict[str, Any]:
    """The response is the typed error; ``None`` accepts any 4xx status or any type."""
    if status is None:
        assert 400 <= response.status_code < 500, (response.status_code, response.text)
    else:
        assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"type", "message", "retryable"}, error
    if kind is not None:
        assert error["type"] == kind, error
    assert isinstance(error["type"], str) and error["type"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["retryable"] is retryable, error
    return error


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    """Wait until ``predicate()`` holds; fail (not hang) after ``BOUND_S``."""

    async def poll() -> None:
        while True:
            if predicate():
                return
            await asyncio.sleep(0.002)

    try:
        await asyncio.wait_for(poll(), BOUND_S)
    except asyncio.TimeoutError:
        pytest.fail(f"not reached within {BOUND_S}s: {what}")


@contextlib.contextmanager
def admitted(gate: AdmissionGate, request_id: str = "long") -> Iterator[Admission]:
    """Hold one admitted request for the duration of the block."""
    admission = gate.admit(request_id)
    try:
        yield admission
    finally:
        admission.finish(Outcome.COMPLETED)


async def long_request(worker: Worker, release: asyncio.Event, admitted_event: asyncio.Event,
                       tokens: int = 5) -> list[int]:
    """A request admitted through the gate that runs on the engine once ``release`` is set."""
    with worker.gate.admit("long-request") as admission:
        admitted_event.set()
        await release.wait()
        out = [t async for t in worker.engine.generate(SimRequest("long-request",
                                                                  max_tokens=tokens))]
        admission.finish(Outcome.COMPLETED)
        return out


async def current_run(worker: Worker) -> DrainRun:
    run = worker.lifecycle.current_run
    assert run is not None
    return run


def oversized_body() -> bytes:
    prefix, suffix = b'{"pad": "', b'"}'
    return prefix + b"a" * (MAX_BODY_BYTES + 1 - len(prefix) - len(suffix)) + suffix


async def chunks(body: bytes, size: int = 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


async def assert_oversized_chunked_body_is_413(worker: Worker, http: httpx.AsyncClient) -> None:
    """A drain whose oversized body comes in chunks (no content length) is a typed 413
    and changes nothing."""
    before = worker.snapshot()
    response = await http.post("/engine/drain", content=chunks(oversized_body()),
                               headers={**AUTH, "content-type": "application/json"})
    assert response.status_code < 500, response.text
    assert_error(response, 413, "body_too_large")
    assert worker.snapshot() == before
