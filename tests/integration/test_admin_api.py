"""The admin HTTP API (:mod:`quiesce.server`) over a real lifecycle and the simulated engine.

Every test builds a real :class:`Lifecycle` over a real :class:`SimEngine` (its probe,
an :class:`AdmissionGate` and an ``InMemoryDiscovery``) and talks to
``create_admin_app`` in-process through ``httpx.ASGITransport``; a few talk to a real
:class:`EmbeddedServer` on 127.0.0.1 over TCP. Covered: bearer auth and the bind and
token configuration; drain, wait, status, resume, stop and a failed resume; bad input
(never a 5xx, never a state change); schemathesis over the generated OpenAPI schema;
concurrent drain/resume/status calls; and a client that leaves in the middle of
``wait`` without cancelling the drain.

No timing asserts: every wait is on a condition and bounded by ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings

from quiesce.adapters.sim import SimConfig, SimEngine, SimProbe, SimRequest
from quiesce.admission import Admission, AdmissionGate, Outcome
from quiesce.discovery import InMemoryDiscovery
from quiesce.drain import DrainConfig
from quiesce.errors import ConfigError
from quiesce.lifecycle import DrainRun, Lifecycle, LifecycleEvent, State
from quiesce.server import (
    MAX_BODY_BYTES,
    TOKEN_ENV,
    EmbeddedServer,
    bind_socket,
    check_bind,
    create_admin_app,
    load_token,
)

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRACE_S = 0.05
"""Router grace of every lifecycle here: short, but long enough to be a real stage."""
BOUND_S = 10.0
"""Upper bound of every wait in this file; a healthy run needs milliseconds."""

ADMIN_ROUTES = [("POST", "/engine/drain"), ("POST", "/engine/resume"),
                ("GET", "/engine/status")]
STATUS_KEYS = {"state", "generation", "inflight_requests", "accepting", "discovery_registered",
               "since", "seconds_in_state", "last_error", "pending_work", "drain", "last_drain"}
DRAIN_KEYS = {"generation", "stage", "elapsed_s", "budget_s", "budget_left_s", "trend"}
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


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    async with running_worker() as started:
        yield started


@pytest.fixture
async def client(worker: Worker) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(worker.app) as opened:
        yield opened


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


# -- 1. auth and configuration -----------------------------------------------------------

BAD_CREDENTIALS = {
    "missing": {},
    "wrong token": {"Authorization": "Bearer not-the-token"},
    "token prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    "token with suffix": {"Authorization": f"Bearer {TOKEN}x"},
    "empty bearer": {"Authorization": "Bearer "},
    "basic scheme": {"Authorization": "Basic "
                     + base64.b64encode(f"admin:{TOKEN}".encode()).decode()},
    "token scheme": {"Authorization": f"Token {TOKEN}"},
    "no scheme": {"Authorization": TOKEN},
}


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
@pytest.mark.parametrize("credentials", list(BAD_CREDENTIALS))
async def test_admin_routes_refuse_missing_wrong_or_non_bearer_credentials(
        worker: Worker, client: httpx.AsyncClient, method: str, path: str,
        credentials: str) -> None:
    before = worker.snapshot()
    response = await client.request(method, path, headers=BAD_CREDENTIALS[credentials],
                                    json={"wait": True} if method == "POST" else None)
    assert_error(response, 401, "unauthorized")
    assert response.headers["www-authenticate"] == "Bearer"
    assert worker.snapshot() == before


async def test_admin_routes_accept_the_right_bearer_token(
        worker: Worker, client: httpx.AsyncClient) -> None:
    status = await client.get("/engine/status", headers=AUTH)
    assert status.status_code == 200 and status.json()["state"] == "serving"
    # the scheme is case-insensitive (RFC 9110); surrounding blanks are ignored
    lower = await client.get("/engine/status", headers={"Authorization": f"bearer  {TOKEN} "})
    assert lower.status_code == 200
    drain = await client.post("/engine/drain", headers=AUTH)
    assert drain.status_code in (200, 202) and drain.json()["state"] in ("draining", "drained")
    resume = await client.post("/engine/resume", headers=AUTH)
    assert resume.status_code == 200 and resume.json()["state"] == "serving"
    assert worker.lifecycle.state is State.SERVING


async def test_health_and_metrics_are_open(worker: Worker, client: httpx.AsyncClient) -> None:
    live = await client.get("/health/live")
    assert live.status_code == 200 and live.json() == {"status": "live"}
    ready = await client.get("/health/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "serving"}
    metrics = await client.get("/metrics", headers={"Authorization": "Bearer wrong"})
    assert metrics.status_code == 200 and "quiesce_state" in metrics.text


async def test_without_a_token_admin_routes_are_open() -> None:
    async with running_worker(token=None) as open_worker, \
            asgi_client(open_worker.app) as client:
        status = await client.get("/engine/status")
        assert status.status_code == 200 and status.json()["state"] == "serving"
        drain = await client.post("/engine/drain", json={"wait": True})
        assert drain.status_code == 200 and drain.json()["state"] == "drained"
        # an Authorization header is simply not looked at
        resume = await client.post("/engine/resume", headers={"Authorization": "Bearer x"})
        assert resume.status_code == 200 and resume.json()["state"] == "serving"
        assert open_worker.lifecycle.state is State.SERVING


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "worker.example.com"])
def test_check_bind_refuses_a_non_loopback_host_without_a_token(host: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_bind(host, None)
    assert raised.value.field == "admin_host"
    assert "admin_host" in str(raised.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_check_bind_allows_loopback_without_a_token(host: str) -> None:
    check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "127.0.0.1", "worker.example.com"])
def test_check_bind_allows_any_host_with_a_token(host: str) -> None:
    check_bind(host, TOKEN)


def test_load_token_from_a_file_is_stripped(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n\n")
    assert load_token(str(token_file)) == TOKEN  # the file wins over the environment


@pytest.mark.parametrize("content", ["", "   \n\t\n"])
def test_load_token_refuses_an_empty_file(tmp_path: Path, content: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(content)
    with pytest.raises(ConfigError) as raised:
        load_token(str(token_file))
    assert raised.value.field == "admin_token_file"


def test_load_token_refuses_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        load_token(str(tmp_path / "does-not-exist"))
    assert raised.value.field == "admin_token_file"


def test_load_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, f" {TOKEN}\n")
    assert load_token() == TOKEN
    monkeypatch.setenv(TOKEN_ENV, "  ")
    assert load_token() is None
    monkeypatch.delenv(TOKEN_ENV)
    assert load_token() is None
    assert load_token(None) is None


# -- 2. behaviour --------------------------------------------------------------------------


async def test_status_while_serving(worker: Worker, client: httpx.AsyncClient) -> None:
    response = await client.get("/engine/status", headers=AUTH)
    assert response.status_code == 200
    body = response.json()
    assert set(body) >= STATUS_KEYS
    assert body["state"] == "serving"
    assert body["generation"] == worker.lifecycle.generation == 0
    assert body["inflight_requests"] == 0
    assert body["accepting"] is True
    assert body["discovery_registered"] is True
    assert isinstance(body["since"], float) and body["since"] <= time.time()
    assert body["last_error"] is None
    assert body["drain"] is None and body["last_drain"] is None
    pending = body["pending_work"]
    assert pending["source"] == "sim.engine"
    assert pending["verdict"] == "quiescent"
    assert pending["total"] == 0


async def test_status_shows_engine_work_as_busy(worker: Worker,
                                                client: httpx.AsyncClient) -> None:
    tokens: list[int] = []

    async def generate() -> None:
        with worker.gate.admit("busy"):
            async for token in worker.engine.generate(SimRequest("busy", max_tokens=8192)):
                tokens.append(token)

    task = asyncio.create_task(generate())
    try:
        await eventually(lambda: bool(tokens), "the engine generates")
        body = (await client.get("/engine/status", headers=AUTH)).json()
        assert body["inflight_requests"] == 1
        assert body["pending_work"]["verdict"] == "busy"
        assert body["pending_work"]["total"] >= 1
    finally:
        worker.engine.abort("busy")
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), BOUND_S)


async def test_drain_answers_202_and_readiness_fails_while_draining(
        worker: Worker, client: httpx.AsyncClient) -> None:
    lifecycle = worker.lifecycle
    with admitted(worker.gate):
        response = await client.post("/engine/drain", headers=AUTH, json={"budget_s": 30})
        assert response.status_code == 202, response.text
        body = response.json()
        assert body["state"] == "draining" and lifecycle.state is State.DRAINING
        assert body["generation"] == lifecycle.generation == 1
        assert body["inflight_requests"] == 1
        drain = body["drain"]
        assert set(drain) == DRAIN_KEYS
        assert drain["generation"] == 1
        assert drain["budget_s"] == 30
        assert 0 <= drain["budget_left_s"] <= 30
        assert drain["stage"] in ("unregister", "router_grace", "close_admission", "inflight")
        assert body["pending_work"]["source"] == "sim.engine"
        assert body["pending_work"]["verdict"] in ("quiescent", "busy", "unknown")

        ready = await client.get("/health/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "draining"}

        # a second drain joins the run in progress
        again = await client.post("/engine/drain", headers=AUTH, json={})
        assert again.status_code == 202 and again.json()["generation"] == 1

        # waiting, bounded: still draining, since the request is still admitted
        waited = await client.post("/engine/drain", headers=AUTH,
                                   json={"wait": True, "wait_timeout_s": 0.05})
        assert waited.status_code == 202 and waited.json()["state"] == "draining"
        await eventually(lambda: not worker.gate.accepting, "admission closes")
        status = (await client.get("/engine/status", headers=AUTH)).json()
        assert status["state"] == "draining" and status["drain"]["stage"] == "inflight"
        assert status["accepting"] is False and status["discovery_registered"] is False

    await eventually(lambda: lifecycle.state is State.DRAINED, "drained once the request ended")
    ready = await client.get("/health/ready")
    assert ready.status_code == 503 and ready.json() == {"status": "drained"}
    body = (await client.get("/engine/status", headers=AUTH)).json()
    assert body["state"] == "drained" and body["inflight_requests"] == 0
    assert body["accepting"] is False and body["drain"] is None
    assert body["last_drain"]["drained"] is True and body["last_drain"]["outcome"] == "completed"
    assert body["last_error"] is None


async def test_drain_with_wait_answers_200_once_drained(worker: Worker,
                                                        client: httpx.AsyncClient) -> None:
    release, admitted_event = asyncio.Event(), asyncio.Event()
    request = asyncio.create_task(long_request(worker, release, admitted_event))
    try:
        await asyncio.wait_for(admitted_event.wait(), BOUND_S)
        drain = asyncio.create_task(client.post("/engine/drain", headers=AUTH,
                                                json={"wait": True}))
        await eventually(lambda: not worker.gate.accepting, "the drain closes admission")
        assert not drain.done()  # held by the admitted request
        release.set()
        response = await asyncio.wait_for(drain, BOUND_S)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["state"] == "drained" and worker.lifecycle.state is State.DRAINED
        assert body["accepting"] is False and body["inflight_requests"] == 0
        assert body["pending_work"]["verdict"] == "quiescent"
        assert await asyncio.wait_for(request, BOUND_S) == [1, 2, 3, 4, 5]
        # once drained, drain is idempotent and answers 200 at once
        again = await client.post("/engine/drain", headers=AUTH, json={"wait": True})
        assert again.status_code == 200 and again.json()["generation"] == body["generation"]
    finally:
        release.set()
        await asyncio.wait_for(asyncio.gather(request, return_exceptions=True), BOUND_S)


async def test_resume_returns_to_serving(worker: Worker, client: httpx.AsyncClient) -> None:
    drained = await client.post("/engine/drain", headers=AUTH, json={"wait": True})
    assert drained.status_code == 200 and drained.json()["state"] == "drained"
    generation = worker.lifecycle.generation
    response = await client.post("/engine/resume", headers=AUTH)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["state"] == "serving" and body["generation"] == generation + 1
    assert body["accepting"] is True and body["discovery_registered"] is True
    assert worker.lifecycle.state is State.SERVING and worker.gate.accepting
    ready = await client.get("/health/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "serving"}
    # resume while serving changes nothing
    again = await client.post("/engine/resume", headers=AUTH)
    assert again.status_code == 200 and again.json()["generation"] == generation + 1


async def test_resume_cancels_a_drain_in_progress(worker: Worker,
                                                  client: httpx.AsyncClient) -> None:
    with admitted(worker.gate):
        drain = await client.post("/engine/drain", headers=AUTH)
        assert drain.status_code == 202
        run = await current_run(worker)
        resume = await client.post("/engine/resume", headers=AUTH)
        assert resume.status_code == 200 and resume.json()["state"] == "serving"
        assert run.task.done() and run.report is not None and not run.report.drained
        assert resume.json()["last_drain"]["outcome"] == "cancelled"
    assert worker.lifecycle.state is State.SERVING and worker.gate.accepting


async def test_drain_and_resume_while_stopping_are_409(worker: Worker,
                                                       client: httpx.AsyncClient) -> None:
    await worker.lifecycle.stop()
    before = worker.snapshot()
    assert before[0] is State.STOPPING
    for body in (None, {"wait": True}, {"budget_s": 5}):
        drain = await client.post("/engine/drain", headers=AUTH, json=body)
        assert_error(drain, 409, "invalid_transition")
        assert worker.snapshot() == before
    resume = await client.post("/engine/resume", headers=AUTH)
    error = assert_error(resume, 409, "invalid_transition")
    assert "stopping" in error["message"]
    assert worker.snapshot() == before
    status = await client.get("/engine/status", headers=AUTH)
    assert status.status_code == 200 and status.json()["state"] == "stopping"
    ready = await client.get("/health/ready")
    assert ready.status_code == 503 and ready.json() == {"status": "stopping"}


async def test_resume_whose_registration_fails_is_503_and_drains_again(
        worker: Worker, client: httpx.AsyncClient) -> None:
    lifecycle = worker.lifecycle
    drained = await client.post("/engine/drain", headers=AUTH, json={"wait": True})
    assert drained.status_code == 200
    worker.discovery.fail_register = True
    response = await client.post("/engine/resume", headers=AUTH)
    error = assert_error(response, 503, "resume_failed", retryable=True)
    assert "ConnectionError" in error["message"]
    # rolled back: admission closed again, not registered, draining towards drained
    assert lifecycle.state in (State.DRAINING, State.DRAINED)
    assert not worker.gate.accepting and not worker.discovery.registered
    status = (await client.get("/engine/status", headers=AUTH)).json()
    assert status["state"] in ("draining", "drained") and status["accepting"] is False
    assert "resume failed" in status["last_error"]
    await eventually(lambda: lifecycle.state is State.DRAINED, "drained again after rollback")
    ready = await client.get("/health/ready")
    assert ready.status_code == 503

    worker.discovery.fail_register = False
    retried = await client.post("/engine/resume", headers=AUTH)
    assert retried.status_code == 200 and retried.json()["state"] == "serving"
    assert retried.json()["last_error"] is None
    assert worker.discovery.registered and worker.gate.accepting


async def test_metrics_are_prometheus_text(worker: Worker, client: httpx.AsyncClient) -> None:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "# TYPE quiesce_state gauge" in response.text
    assert 'quiesce_state{state="serving"} 1.0' in response.text
    assert 'quiesce_state{state="drained"} 0.0' in response.text
    await client.post("/engine/drain", headers=AUTH, json={"wait": True})
    response = await client.get("/metrics")
    assert 'quiesce_state{state="drained"} 1.0' in response.text
    assert 'quiesce_state{state="serving"} 0.0' in response.text
    assert 'quiesce_drain_outcomes_total{outcome="completed"} 1.0' in response.text


# -- 3. bad input --------------------------------------------------------------------------


def raw(body: bytes, content_type: str = "application/json") -> dict[str, Any]:
    return {"content": body, "headers": {**AUTH, "content-type": content_type}}


def as_json(value: object) -> dict[str, Any]:
    return {"json": value, "headers": AUTH}


@dataclasses.dataclass(frozen=True)
class BadInput:
    method: str
    path: str
    request: dict[str, Any]
    status: int | None  # None: any 4xx
    kind: str | None  # None: any error type


def bad(method: str, path: str, request: dict[str, Any], status: int | None, kind: str | None,
        *, id: str) -> Any:
    return pytest.param(BadInput(method, path, request, status, kind), id=id)


DRAIN = ("POST", "/engine/drain")
BAD_INPUT = [
    # malformed JSON
    bad(*DRAIN, raw(b'{"budget_s": '), 422, "invalid_request", id="truncated-json"),
    bad(*DRAIN, raw(b"{"), 422, "invalid_request", id="open-brace"),
    bad(*DRAIN, raw(b"{} trailing"), 422, "invalid_request", id="trailing-garbage"),
    bad(*DRAIN, raw(b"{'wait': true}"), 422, "invalid_request", id="single-quotes"),
    bad(*DRAIN, raw(b'{"wait": tru}'), 422, "invalid_request", id="bad-literal"),
    bad(*DRAIN, raw(b'{"budget_s": "\xff\xfe"}'), None, None, id="invalid-utf8"),
    # JSON that is not an object
    bad(*DRAIN, as_json([]), 422, "invalid_request", id="empty-array"),
    bad(*DRAIN, as_json([{"wait": True}]), 422, "invalid_request", id="array"),
    bad(*DRAIN, as_json("drain"), 422, "invalid_request", id="string"),
    bad(*DRAIN, as_json(42), 422, "invalid_request", id="number"),
    bad(*DRAIN, as_json(True), 422, "invalid_request", id="true"),
    # wrong types
    bad(*DRAIN, as_json({"budget_s": "abc"}), 422, "invalid_request", id="budget-abc"),
    bad(*DRAIN, as_json({"budget_s": [30]}), 422, "invalid_request", id="budget-list"),
    bad(*DRAIN, as_json({"budget_s": {}}), 422, "invalid_request", id="budget-object"),
    bad(*DRAIN, as_json({"budget_s": True}), 422, "invalid_request", id="budget-bool"),
    bad(*DRAIN, as_json({"budget_s": "30"}), 422, "invalid_request", id="budget-numeric-string"),
    bad(*DRAIN, as_json({"wait": "yes"}), 422, "invalid_request", id="wait-yes"),
    bad(*DRAIN, as_json({"wait": 1}), 422, "invalid_request", id="wait-1"),
    bad(*DRAIN, as_json({"wait": "true"}), 422, "invalid_request", id="wait-string-true"),
    bad(*DRAIN, as_json({"wait": None}), 422, "invalid_request", id="wait-null"),
    bad(*DRAIN, as_json({"wait_timeout_s": "soon"}), 422, "invalid_request",
        id="wait-timeout-string"),
    # out-of-range budgets and timeouts
    bad(*DRAIN, as_json({"budget_s": -1}), 422, "invalid_request", id="budget-neg"),
    bad(*DRAIN, as_json({"budget_s": 0}), 422, "invalid_request", id="budget-zero"),
    bad(*DRAIN, as_json({"budget_s": -0.0}), 422, "invalid_request", id="budget-minus-zero"),
    bad(*DRAIN, as_json({"budget_s": "NaN"}), 422, "invalid_request", id="budget-nan-string"),
    bad(*DRAIN, as_json({"budget_s": "inf"}), 422, "invalid_request", id="budget-inf-string"),
    bad(*DRAIN, raw(b'{"budget_s": NaN}'), 422, "invalid_request", id="budget-nan-literal"),
    bad(*DRAIN, raw(b'{"budget_s": Infinity}'), 422, "invalid_request",
        id="budget-infinity-literal"),
    bad(*DRAIN, raw(b'{"budget_s": 1e400}'), 422, "invalid_request", id="budget-overflow"),
    bad(*DRAIN, as_json({"budget_s": 1e12}), 422, "invalid_request", id="budget-absurd"),
    bad(*DRAIN, as_json({"budget_s": 86_400.5}), 422, "invalid_request", id="budget-over-a-day"),
    bad(*DRAIN, as_json({"wait": True, "wait_timeout_s": 0}), 422,
        "invalid_request", id="wait-timeout-zero"),
    bad(*DRAIN, as_json({"wait": True, "wait_timeout_s": -5}), 422,
        "invalid_request", id="wait-timeout-neg"),
    bad(*DRAIN, as_json({"wait": True, "wait_timeout_s": 1e12}), 422,
        "invalid_request", id="wait-timeout-absurd"),
    # unknown fields
    bad(*DRAIN, as_json({"budget": 5}), 422, "invalid_request", id="unknown-field"),
    bad(*DRAIN, as_json({"budget_s": 5, "force": True}), 422, "invalid_request", id="extra-field"),
    bad(*DRAIN, as_json({"": 1}), 422, "invalid_request", id="empty-field-name"),
    # a body that is not JSON at all
    bad(*DRAIN, raw(b"wait=true", "application/x-www-form-urlencoded"), 422,
        "invalid_request", id="form-body"),
    bad(*DRAIN, raw(b"{}", "text/plain"), 422, "invalid_request", id="text-plain"),
    # wrong methods
    bad("GET", "/engine/drain", {"headers": AUTH}, 405, "method_not_allowed", id="GET-drain"),
    bad("PUT", "/engine/drain", as_json({}), 405, "method_not_allowed", id="PUT-drain"),
    bad("DELETE", "/engine/drain", {"headers": AUTH}, 405, "method_not_allowed", id="DELETE-drain"),
    bad("GET", "/engine/resume", {"headers": AUTH}, 405, "method_not_allowed", id="GET-resume"),
    bad("POST", "/engine/status", as_json({}), 405, "method_not_allowed", id="POST-status"),
    bad("POST", "/health/ready", {}, 405, "method_not_allowed", id="POST-ready"),
    bad("DELETE", "/metrics", {}, 405, "method_not_allowed", id="DELETE-metrics"),
    # unknown paths
    bad("POST", "/engine/stop", as_json({}), 404, "not_found", id="engine-stop"),
    bad("GET", "/engine", {"headers": AUTH}, 404, "not_found", id="engine"),
    bad("POST", "/engine/drain/now", as_json({}), 404, "not_found", id="drain-now"),
    bad("GET", "/nope", {}, 404, "not_found", id="nope"),
]


@pytest.mark.parametrize("bad_input", BAD_INPUT)
async def test_bad_input_is_a_typed_4xx_and_changes_nothing(
        worker: Worker, client: httpx.AsyncClient, bad_input: BadInput) -> None:
    before = worker.snapshot()
    response = await client.request(bad_input.method, bad_input.path, **bad_input.request)
    assert response.status_code < 500, response.text
    status = bad_input.status
    error = assert_error(response, status, bad_input.kind)
    if status == 405:
        assert response.headers.get("allow"), "a 405 names the allowed methods"
    if status == 422:
        assert error["message"] != "invalid request", "the problem is named"
    await asyncio.sleep(0)  # a drain started by mistake would have transitioned already
    assert worker.snapshot() == before
    assert worker.lifecycle.current_run is None
    # and the API still answers
    status_response = await client.get("/engine/status", headers=AUTH)
    assert status_response.status_code == 200
    assert status_response.json()["state"] == "serving"


async def test_a_null_body_never_fails(worker: Worker, client: httpx.AsyncClient) -> None:
    # ``null`` is read as "no body" (every field is optional): whatever the answer, no 5xx
    response = await client.post("/engine/drain", **raw(b"null"))
    assert response.status_code < 500, response.text


async def test_a_body_at_the_limit_is_read(worker: Worker, client: httpx.AsyncClient) -> None:
    before = worker.snapshot()
    prefix, suffix = b'{"pad": "', b'"}'
    body = prefix + b"a" * (MAX_BODY_BYTES - len(prefix) - len(suffix)) + suffix
    assert len(body) == MAX_BODY_BYTES
    response = await client.post("/engine/drain", **raw(body))
    assert_error(response, 422, "invalid_request")  # read and validated, not refused
    assert worker.snapshot() == before


def oversized_body() -> bytes:
    prefix, suffix = b'{"pad": "', b'"}'
    return prefix + b"a" * (MAX_BODY_BYTES + 1 - len(prefix) - len(suffix)) + suffix


async def chunks(body: bytes, size: int = 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


async def test_oversized_body_with_its_content_length_is_413(
        worker: Worker, client: httpx.AsyncClient) -> None:
    before = worker.snapshot()
    response = await client.post("/engine/drain", **raw(oversized_body()))
    assert_error(response, 413, "body_too_large")
    assert worker.snapshot() == before


async def test_a_declared_content_length_over_the_limit_is_413(
        worker: Worker, client: httpx.AsyncClient) -> None:
    before = worker.snapshot()
    response = await client.post("/engine/drain", content=b"{}",
                                 headers={**AUTH, "content-type": "application/json",
                                          "content-length": str(MAX_BODY_BYTES + 1)})
    assert_error(response, 413, "body_too_large")
    assert worker.snapshot() == before


async def test_a_non_numeric_content_length_is_a_typed_4xx(
        worker: Worker, client: httpx.AsyncClient) -> None:
    before = worker.snapshot()
    response = await client.post("/engine/drain", content=b"{}",
                                 headers={**AUTH, "content-type": "application/json",
                                          "content-length": "lots"})
    assert_error(response, None, None)
    assert worker.snapshot() == before


async def test_oversized_body_behind_a_lying_content_length_is_413(
        worker: Worker, client: httpx.AsyncClient) -> None:
    before = worker.snapshot()
    response = await client.post("/engine/drain", content=oversized_body(),
                                 headers={**AUTH, "content-type": "application/json",
                                          "content-length": "2"})
    assert response.status_code < 500, response.text
    assert_error(response, 413, "body_too_large")
    assert worker.snapshot() == before


async def test_oversized_chunked_body_is_413(worker: Worker,
                                             client: httpx.AsyncClient) -> None:
    before = worker.snapshot()
    response = await client.post("/engine/drain", content=chunks(oversized_body()),
                                 headers={**AUTH, "content-type": "application/json"})
    assert response.status_code < 500, response.text
    assert_error(response, 413, "body_too_large")
    assert worker.snapshot() == before


# -- 4. schemathesis -----------------------------------------------------------------------


@dataclasses.dataclass
class FuzzTarget:
    worker: Worker
    examples: int = 0

    def next_example(self) -> None:
        """Start every other example from drained, the others from serving."""
        self.wait_no_run_in_progress()
        self.examples += 1
        if self.examples % 2:
            setup = fuzz_schema["/engine/drain"]["POST"].Case(
                body={"wait": True}, media_type="application/json")
        else:
            setup = fuzz_schema["/engine/resume"]["POST"].Case()
        response = setup.call(headers=AUTH, app=self.worker.app)
        assert response.status_code == 200, response.text
        self.wait_no_run_in_progress()

    def wait_no_run_in_progress(self) -> None:
        """Block until no drain run is running (they run on schemathesis' ASGI loop thread)."""
        deadline = time.monotonic() + BOUND_S
        while (run := self.worker.lifecycle.current_run) is not None and not run.task.done():
            assert time.monotonic() < deadline, "a drain run did not end"
            time.sleep(0.002)


@pytest.fixture
def fuzz_target() -> Iterator[FuzzTarget]:
    # Plain (sync) fixture: schemathesis serves the app on its own event-loop thread, so
    # the lifecycle's tasks live there; nothing here may touch it from pytest's loop.
    worker = build_worker(grace_s=0.005)
    asyncio.run(worker.lifecycle.start())  # opens the gate and registers; loop-free
    target = FuzzTarget(worker)
    try:
        yield target
    finally:
        target.wait_no_run_in_progress()
        asyncio.run(worker.engine.shutdown())  # never started: nothing to stop but the flag


# The document FastAPI serves at /openapi.json (routes do not depend on the lifecycle, so a
# throwaway worker's app gives the same one); each example is sent, in-process, to the
# app of the test's own worker through schemathesis' ASGI transport (``app=``).
fuzz_schema = schemathesis.openapi.from_dict(build_worker().app.openapi())

async def test_the_fuzzed_document_is_the_served_one(worker: Worker,
                                                     client: httpx.AsyncClient) -> None:
    response = await client.get("/openapi.json")
    assert response.status_code == 200
    document = response.json()
    assert document == worker.app.openapi() == fuzz_schema.raw_schema
    assert set(document["paths"]) == {"/engine/drain", "/engine/resume", "/engine/status",
                                      "/health/live", "/health/ready", "/metrics"}


DOCUMENTED_5XX = {("GET", "/health/ready", 503), ("POST", "/engine/resume", 503)}


@fuzz_schema.parametrize()
@settings(max_examples=50, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_schemathesis_finds_no_server_error(case: schemathesis.Case[Any],
                                            fuzz_target: FuzzTarget) -> None:
    worker = fuzz_target.worker
    fuzz_target.next_example()  # no drain run in progress: a change can only be this call
    before = worker.snapshot()
    response = case.call(headers=AUTH, app=worker.app)
    method, path, code = case.method.upper(), case.path, response.status_code
    if code >= 500:
        assert (method, path, code) in DOCUMENTED_5XX, (method, path, code, response.text)
    if (method, path) == ("GET", "/health/ready"):
        assert code in (200, 503), (code, response.text)
        assert (code == 200) == (response.json()["status"] == "serving")
    elif code >= 400:  # every error, including 405s of the unsupported-method probes
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"type", "message",
                                                                 "retryable"}, body
        if code == 503:
            assert body["error"]["type"] == "resume_failed", body
        else:  # bad input never changes state
            assert worker.snapshot() == before, (method, path, code, response.text)
    assert worker.lifecycle.state is not State.STOPPING
    if worker.lifecycle.state is State.DRAINED:
        assert not worker.gate.accepting


# -- 5. concurrency ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_concurrent_drain_resume_and_status_stay_consistent(
        worker: Worker, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    lifecycle = worker.lifecycle
    # The lifecycle serializes drain and resume on one lock and nothing awaits between
    # the lock's release and the return: wrapping them records the order they took it.
    order: list[str] = []
    original_drain, original_resume = lifecycle.drain, lifecycle.resume

    async def drain(budget_s: float | None = None) -> DrainRun:
        run = await original_drain(budget_s)
        order.append("drain")
        return run

    async def resume() -> None:
        await original_resume()
        order.append("resume")

    monkeypatch.setattr(lifecycle, "drain", drain)
    monkeypatch.setattr(lifecycle, "resume", resume)

    drained_while_accepting: list[LifecycleEvent] = []

    def watch(event: LifecycleEvent) -> None:
        if event.state is State.DRAINED and worker.gate.accepting:
            drained_while_accepting.append(event)

    lifecycle.add_listener(watch)

    rng = random.Random(seed)
    clients = [asgi_client(worker.app) for _ in range(10)]
    calls: list[tuple[str, dict[str, Any] | None]] = []
    for _ in range(50):
        kind = rng.choice(["drain", "drain", "drain-wait", "resume", "resume", "status"])
        if kind == "drain":
            calls.append(("drain", rng.choice([None, {}, {"budget_s": 30}])))
        elif kind == "drain-wait":
            calls.append(("drain", {"wait": True, "wait_timeout_s": 0.2}))
        else:
            calls.append((kind, None))

    async def call(index: int, kind: str, body: dict[str, Any] | None) -> httpx.Response:
        http = clients[index % len(clients)]
        await asyncio.sleep(rng.random() * 0.01)
        if kind == "status":
            return await http.get("/engine/status", headers=AUTH)
        return await http.post(f"/engine/{kind}", headers=AUTH, json=body)

    try:
        responses = await asyncio.wait_for(
            asyncio.gather(*(call(i, kind, body) for i, (kind, body) in enumerate(calls))),
            BOUND_S)
    finally:
        for http in clients:
            await http.aclose()

    for (kind, _), response in zip(calls, responses, strict=True):
        assert response.status_code < 500, (kind, response.status_code, response.text)
        body = response.json()
        if kind == "drain":
            assert response.status_code in (200, 202), response.text
            assert (response.status_code == 200) == (body["state"] == "drained")
        else:
            assert response.status_code == 200, response.text
        if body["state"] == "drained":
            assert body["accepting"] is False, body
    assert drained_while_accepting == []

    assert order, "some drain or resume ran"
    if order[-1] == "resume":
        assert lifecycle.state is State.SERVING
        assert worker.gate.accepting and worker.discovery.registered
    else:
        assert lifecycle.state in (State.DRAINING, State.DRAINED)
        await eventually(lambda: lifecycle.state is State.DRAINED, "the last drain completes")
        assert not worker.gate.accepting and not worker.discovery.registered
    assert not (lifecycle.state is State.DRAINED and worker.gate.accepting)
    assert worker.gate.inflight == 0


# -- a client that leaves during wait -----------------------------------------------------


async def assert_drain_survives_a_leaving_client(
        worker: Worker, post: Callable[[], Coroutine[Any, Any, httpx.Response]],
        leave: Callable[[], Awaitable[None]] | None = None) -> None:
    """Start ``post()`` (a drain with wait) while a request is admitted, cancel it
    mid-wait (then ``leave()``: close the client), and check that the drain still
    reaches drained once the request ends."""
    lifecycle = worker.lifecycle
    release, admitted_event = asyncio.Event(), asyncio.Event()
    request = asyncio.create_task(long_request(worker, release, admitted_event))
    try:
        await asyncio.wait_for(admitted_event.wait(), BOUND_S)
        waiting = asyncio.create_task(post())
        await eventually(lambda: lifecycle.state is State.DRAINING, "the drain starts")
        await eventually(lambda: not worker.gate.accepting, "the drain closes admission")
        run = await current_run(worker)
        assert not waiting.done()

        waiting.cancel()  # the client gives up in the middle of wait
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(waiting, BOUND_S)
        if leave is not None:
            await leave()
        for _ in range(5):
            await asyncio.sleep(0)
        assert not run.task.done(), "the drain run must outlive its client"
        assert lifecycle.state is State.DRAINING

        release.set()
        assert await asyncio.wait_for(request, BOUND_S) == [1, 2, 3, 4, 5]
        report = await asyncio.wait_for(run.wait(), BOUND_S)
        assert report is not None and report.drained
        assert lifecycle.state is State.DRAINED and not worker.gate.accepting
    finally:
        release.set()
        await asyncio.wait_for(asyncio.gather(request, return_exceptions=True), BOUND_S)


async def test_client_leaving_mid_wait_does_not_cancel_the_drain_real_server(
        worker: Worker) -> None:
    async with embedded_server(worker.app) as url:
        leaving = httpx.AsyncClient(base_url=url)
        try:
            await assert_drain_survives_a_leaving_client(
                worker, lambda: leaving.post("/engine/drain", headers=AUTH,
                                             json={"wait": True}),
                leave=leaving.aclose)
        finally:
            await leaving.aclose()
        async with httpx.AsyncClient(base_url=url) as fresh:
            status = await fresh.get("/engine/status", headers=AUTH)
            assert status.status_code == 200 and status.json()["state"] == "drained"


async def test_client_leaving_mid_wait_does_not_cancel_the_drain_asgi(
        worker: Worker, client: httpx.AsyncClient) -> None:
    # In-process the handler runs in the client's task: cancelling the client cancels
    # the handler itself in the middle of ``run.wait``.
    await assert_drain_survives_a_leaving_client(
        worker, lambda: client.post("/engine/drain", headers=AUTH, json={"wait": True}))
    status = await client.get("/engine/status", headers=AUTH)
    assert status.status_code == 200 and status.json()["state"] == "drained"


# -- over a real server --------------------------------------------------------------------


async def test_real_server_auth_drain_resume_and_metrics(worker: Worker) -> None:
    async with embedded_server(worker.app) as url, httpx.AsyncClient(base_url=url) as http:
        refused = await http.get("/engine/status", headers={"Authorization": "Bearer nope"})
        assert_error(refused, 401, "unauthorized")
        assert refused.headers["www-authenticate"] == "Bearer"
        assert (await http.get("/health/live")).status_code == 200
        assert (await http.get("/health/ready")).status_code == 200
        bad = await http.post("/engine/drain", headers=AUTH, json={"budget_s": -1})
        assert_error(bad, 422, "invalid_request")
        too_large = await http.post("/engine/drain", headers=AUTH,
                                    content=oversized_body())
        assert_error(too_large, 413, "body_too_large")
        assert worker.lifecycle.state is State.SERVING and worker.lifecycle.generation == 0

        drained = await http.post("/engine/drain", headers=AUTH, json={"wait": True})
        assert drained.status_code == 200 and drained.json()["state"] == "drained"
        assert (await http.get("/health/ready")).status_code == 503
        metrics = await http.get("/metrics")
        assert 'quiesce_state{state="drained"} 1.0' in metrics.text
        resumed = await http.post("/engine/resume", headers=AUTH)
        assert resumed.status_code == 200 and resumed.json()["state"] == "serving"
        assert (await http.get("/health/ready")).status_code == 200


async def test_real_server_oversized_chunked_body_is_413(worker: Worker) -> None:
    async with embedded_server(worker.app) as url, httpx.AsyncClient(base_url=url) as http:
        before = worker.snapshot()
        response = await http.post("/engine/drain", content=chunks(oversized_body()),
                                   headers={**AUTH, "content-type": "application/json"})
        assert response.status_code < 500, response.text
        assert_error(response, 413, "body_too_large")
        assert worker.snapshot() == before
