"""The Dynamo adapter's logic with stand-in endpoints (no runtime needed): retries, the
unknown state, the gate wrapper and the order of the draining shutdown. The real runtime
is in tests/integration/test_dynamo_discovery.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from quiesce.adapters.dynamo import (
    DiscoveryUnavailable,
    DynamoDiscovery,
    gated,
    graceful_shutdown_with_drain,
)
from quiesce.admission import AdmissionGate, Outcome
from quiesce.budget import Deadline
from quiesce.discovery import Discovery, registration_state
from quiesce.errors import ConfigError, WorkerDraining


class StandInEndpoint:
    """Records calls; fails the next ``failures`` calls with ``error``."""

    def __init__(self, log: list[str], failures: int = 0,
                 error: Exception | None = None) -> None:
        self.log = log
        self.failures = failures
        self.error = error or RuntimeError("discovery store unavailable")

    async def _call(self, what: str) -> None:
        self.log.append(what)
        if self.failures:
            self.failures -= 1
            raise self.error

    async def unregister_endpoint_instance(self) -> None:
        await self._call("unregister")

    async def register_endpoint_instance(self) -> None:
        await self._call("register")


class StandInRuntime:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def shutdown(self) -> None:
        self.log.append("runtime.shutdown")


async def test_unregister_and_register_are_idempotent_and_retried() -> None:
    log: list[str] = []
    discovery = DynamoDiscovery(StandInEndpoint(log, failures=2), registered=True)
    assert isinstance(discovery, Discovery)
    await discovery.unregister()
    assert log == ["unregister"] * 3 and not discovery.registered
    await discovery.unregister()
    assert log == ["unregister"] * 3
    await discovery.register()
    await discovery.register()
    assert log == ["unregister"] * 3 + ["register"]
    assert registration_state(discovery) == (True, None)


async def test_not_found_on_unregister_counts_as_already_gone() -> None:
    log: list[str] = []
    endpoint = StandInEndpoint(log, failures=1, error=RuntimeError("Could not find key 'x'"))
    discovery = DynamoDiscovery(endpoint)
    await discovery.unregister()
    assert log == ["unregister"] and registration_state(discovery) == (False, None)


async def test_out_of_budget_leaves_the_state_unknown_with_the_error() -> None:
    log: list[str] = []
    discovery = DynamoDiscovery(StandInEndpoint(log, failures=10**6), retry_budget_s=10.0)
    with pytest.raises(DiscoveryUnavailable) as info:
        await asyncio.wait_for(discovery.unregister(Deadline.after(0.2)), 5.0)
    assert info.value.attempts == len(log) >= 2
    registered, error = registration_state(discovery)
    assert registered is None and error is not None and "unavailable" in error
    assert discovery.registered  # fail closed


@pytest.mark.parametrize("kwargs,field", [
    ({"endpoints": []}, "endpoints"), ({"endpoints": object()}, "endpoints"),
    ({"rpc_timeout_s": 0}, "rpc_timeout_s"), ({"retry_budget_s": -1}, "retry_budget_s"),
    ({"registered": "yes"}, "registered"),
])
def test_bad_input_is_a_config_error(kwargs: dict[str, Any], field: str) -> None:
    values: dict[str, Any] = {"endpoints": StandInEndpoint([]), **kwargs}
    endpoints = values.pop("endpoints")
    with pytest.raises(ConfigError) as info:
        DynamoDiscovery(endpoints, **values)
    assert info.value.field == field


async def test_gated_handler_counts_streams_and_refuses_when_closed() -> None:
    gate = AdmissionGate()

    async def generate(request: dict[str, int]) -> AsyncIterator[int]:
        for i in range(request["n"]):
            yield i

    handler = gated(generate, gate)
    assert [i async for i in handler({"n": 3})] == [0, 1, 2]
    assert gate.inflight == 0 and gate.outcomes().completed == 1
    gate.close("draining")
    with pytest.raises(WorkerDraining):
        _ = [i async for i in handler({"n": 1})]
    assert gate.refused_total == 1


async def test_shutdown_sets_the_abort_event_only_after_the_stream_ended() -> None:
    log: list[str] = []
    gate = AdmissionGate()
    release = asyncio.Event()
    shutdown_event = asyncio.Event()

    async def stream() -> None:
        with gate.admit("r1") as admission:
            await release.wait()
            assert not shutdown_event.is_set()  # not aborted while still streaming
            log.append("stream end")
            admission.finish(Outcome.COMPLETED)

    async def cleanup() -> None:
        log.append("cleanup")

    task = asyncio.get_running_loop().create_task(stream())
    await asyncio.sleep(0)
    shutdown = asyncio.get_running_loop().create_task(graceful_shutdown_with_drain(
        StandInRuntime(log), [StandInEndpoint(log)], shutdown_event, 0.01,
        cleanup_callback=cleanup, gate=gate, budget_s=10.0))
    await asyncio.sleep(0.05)
    assert not shutdown.done() and not gate.accepting and not shutdown_event.is_set()
    release.set()
    report = await asyncio.wait_for(shutdown, 5.0)
    await task
    assert report.drained and report.left_inflight == 0
    assert log == ["unregister", "stream end", "cleanup", "runtime.shutdown"]
    assert shutdown_event.is_set()
    outcomes = {s.stage: s.outcome.value for s in report.stages}
    assert outcomes["unregister"] == "completed" and outcomes["inflight"] == "completed"


async def test_shutdown_out_of_budget_leaves_the_rest_to_the_abort_and_says_so() -> None:
    log: list[str] = []
    gate = AdmissionGate()
    admission = gate.admit("stuck")
    report = await asyncio.wait_for(graceful_shutdown_with_drain(
        StandInRuntime(log), [StandInEndpoint(log, failures=10**6)], None, 0.0,
        gate=gate, budget_s=0.2), 5.0)
    assert not report.drained and report.left_inflight == 1
    outcomes = {s.stage: s.outcome.value for s in report.stages}
    assert outcomes["unregister"] == "failed" and outcomes["inflight"] == "timed_out"
    assert log[-1] == "runtime.shutdown"
    admission.finish(Outcome.LOST)


def test_shutdown_rejects_bad_arguments_before_doing_anything() -> None:
    log: list[str] = []
    with pytest.raises(ConfigError):
        asyncio.run(graceful_shutdown_with_drain(StandInRuntime(log), [StandInEndpoint(log)],
                                                 gate=AdmissionGate(), budget_s=0))
    with pytest.raises(ConfigError):
        asyncio.run(graceful_shutdown_with_drain(StandInRuntime(log), [StandInEndpoint(log)],
                                                 gate="gate"))  # type: ignore[arg-type]
    assert log == []


async def test_a_request_lost_during_the_drain_means_not_drained() -> None:
    """The engine ended a stream by itself while the worker drained (an abort): the
    worker is idle afterwards, yet it must not claim drained."""
    log: list[str] = []
    gate = AdmissionGate()
    admission = gate.admit("r1")
    shutdown = asyncio.get_running_loop().create_task(graceful_shutdown_with_drain(
        StandInRuntime(log), [StandInEndpoint(log)], None, 0.01, gate=gate, budget_s=10.0))
    await asyncio.sleep(0.05)
    admission.finish(Outcome.LOST)
    report = await asyncio.wait_for(shutdown, 5.0)
    assert report.left_inflight == 0 and not report.drained
    assert report.to_dict()["lost_requests"] == 1
