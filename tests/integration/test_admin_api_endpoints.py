"""The admin HTTP API (:mod:`quiesce.admin.server`): status, drain, wait, resume and metrics.

Status while serving and busy; drain answers 202 (200 with ``wait`` once drained) and
readiness fails while draining; resume returns to serving and cancels a drain in
progress; drain and resume while stopping are 409; a resume whose registration fails is
503 and drains again; metrics are Prometheus text.

The worker under test and helpers: :mod:`tests.integration.admin_api_harness`.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from quiesce.adapters.sim import SimRequest
from quiesce.lifecycle import State
from tests.integration.admin_api_harness import (
    AUTH,
    BOUND_S,
    Worker,
    admitted,
    assert_error,
    current_run,
    eventually,
    long_request,
)

STATUS_KEYS = {"state", "generation", "inflight_requests", "accepting", "discovery_registered",
               "since", "seconds_in_state", "last_error", "pending_work", "drain", "last_drain"}
DRAIN_KEYS = {"generation", "stage", "elapsed_s", "budget_s", "budget_left_s", "trend"}


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
