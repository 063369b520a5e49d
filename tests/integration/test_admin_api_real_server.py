"""The admin HTTP API (:mod:`quiesce.admin.server`): the same API over TCP.

A real :class:`~quiesce.admin.server.EmbeddedServer` (uvicorn on 127.0.0.1): auth, bad input,
an oversized body (also chunked), drain, resume, readiness and metrics.

The worker under test and helpers: :mod:`tests.integration.admin_api_harness`.
"""

from __future__ import annotations

import httpx

from quiesce.lifecycle import State
from tests.integration.admin_api_harness import (
    AUTH,
    Worker,
    assert_error,
    assert_oversized_chunked_body_is_413,
    embedded_server,
    oversized_body,
)

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
        await assert_oversized_chunked_body_is_413(worker, http)
