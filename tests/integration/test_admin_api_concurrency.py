"""The admin HTTP API (:mod:`quiesce.admin.server`): concurrent callers and callers that leave.

Concurrent drain, resume and status calls stay consistent (never drained while
accepting; the last of drain and resume wins); a client that leaves in the middle of
``wait``, in-process or over a real server, does not cancel the drain.

The worker under test and helpers: :mod:`tests.integration.admin_api_harness`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import httpx
import pytest

from quiesce.lifecycle import DrainRun, LifecycleEvent, State
from tests.integration.admin_api_harness import (
    AUTH,
    BOUND_S,
    Worker,
    asgi_client,
    current_run,
    embedded_server,
    eventually,
    long_request,
)

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
