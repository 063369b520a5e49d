"""The admin HTTP API (:mod:`quiesce.admin.server`): bad input.

Malformed JSON, wrong types, out-of-range budgets, unknown fields, non-JSON bodies, wrong
methods and unknown paths are a typed 4xx and change nothing (never a 5xx); bodies at
and over the size limit, with honest, lying or missing content lengths.

The worker under test and helpers: :mod:`tests.integration.admin_api_harness`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import pytest

from quiesce.admin.server import MAX_BODY_BYTES
from tests.integration.admin_api_harness import (
    AUTH,
    Worker,
    assert_error,
    assert_oversized_chunked_body_is_413,
    oversized_body,
)

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
    await assert_oversized_chunked_body_is_413(worker, client)
