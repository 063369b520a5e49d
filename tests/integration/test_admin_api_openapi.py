"""The admin HTTP API (:mod:`quiesce.admin.server`): schemathesis over the generated OpenAPI schema.

The fuzzed document is the one served at ``/openapi.json``; every generated request to
every route, from serving or from drained, gets no undocumented 5xx, a typed error for
every 4xx, and no state change from bad input.

The worker under test and helpers: :mod:`tests.integration.admin_api_harness`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from quiesce.lifecycle import State
from tests.integration.admin_api_harness import AUTH, BOUND_S, Worker, build_worker

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
