"""The Dynamo adapter's logic with stand-in endpoints (no runtime needed): retries, the
unknown state, the gate wrapper and the order of the draining shutdown. The real runtime
is in tests/integration/test_dynamo_discovery.py."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

from quiesce.adapters.dynamo import (
    DiscoveryUnavailable,
    DynamoDiscovery,
    finish_outcome,
    gated,
    graceful_shutdown_with_drain,
    install_signal_handlers,
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
    ({"endpoints": ()}, "endpoints"), ({"endpoints": object()}, "endpoints"),
    ({"endpoints": [object()]}, "endpoints"),
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


async def test_a_live_list_is_read_when_the_drain_runs() -> None:
    """Dynamo's components hand over ``shutdown_endpoints`` empty and fill it in place
    once the engine is up: the drain unregisters what the list holds then."""
    log: list[str] = []
    endpoints: list[StandInEndpoint] = []
    discovery = DynamoDiscovery(endpoints)
    assert discovery.endpoints == []
    await discovery.unregister()  # nothing served yet: nothing to do, not an error
    assert log == [] and not discovery.registered
    discovery.served()
    endpoints[:] = [StandInEndpoint(log), StandInEndpoint(log)]
    await discovery.unregister()
    assert log == ["unregister", "unregister"]


async def test_sigterm_before_any_endpoint_exists_still_shuts_the_runtime_down() -> None:
    """The early-SIGTERM hang: a signal during model load, while Dynamo's
    ``shutdown_endpoints`` is still empty, used to raise before the runtime's shutdown
    (the worker then hung until SIGKILL). Now it drains nothing and shuts down."""
    log: list[str] = []
    gate = AdmissionGate()
    shutdown_event = asyncio.Event()
    reports: list[Any] = []
    loop = asyncio.get_running_loop()
    task_of = install_signal_handlers(loop, StandInRuntime(log), [], shutdown_event,
                                      on_done=reports.append, gate=gate, budget_s=5.0)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(500):
            if reports:
                break
            await asyncio.sleep(0.01)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    task = task_of()
    assert task is not None and task.done() and task.exception() is None
    assert log == ["runtime.shutdown"] and shutdown_event.is_set()
    report = reports[0]
    assert report.drained and report.left_inflight == 0
    outcomes = {s.stage: s.outcome.value for s in report.stages}
    assert outcomes["router_grace"] == "skipped"  # nothing was registered


async def test_shutdown_with_bad_endpoints_reports_it_and_still_shuts_down() -> None:
    log: list[str] = []
    report = await graceful_shutdown_with_drain(StandInRuntime(log), (object(),),  # type: ignore[arg-type]
                                                gate=AdmissionGate(), budget_s=1.0)
    assert not report.drained and log == ["runtime.shutdown"]
    assert {s.stage: s.outcome.value for s in report.stages}["unregister"] == "failed"


class StandInContext:
    def __init__(self, stopped: bool) -> None:
        self.stopped = stopped

    def is_stopped(self) -> bool:
        return self.stopped


@pytest.mark.parametrize("chunks,stopped,outcome", [
    ([{"token_ids": [1]}, {"token_ids": [2], "finish_reason": "length"}], False, "completed"),
    ([{"token_ids": [1], "finish_reason": "stop"}], False, "completed"),
    ([{"token_ids": [1]}, {"token_ids": [], "finish_reason": "cancelled"}], True,
     "client_gone"),
    ([{"token_ids": [1]}, {"token_ids": [], "finish_reason": "cancelled"}], False, "lost"),
    ([{"token_ids": [], "finish_reason": "error: engine dead"}], False, "lost"),
    ([{"token_ids": [1]}, {"token_ids": [2]}], False, "lost"),  # no finish: fail closed
    ([{"token_ids": [1]}], True, "client_gone"),  # no finish, the client stopped it
])
async def test_a_dynamo_stream_counts_the_outcome_its_chunks_state(
        chunks: list[dict[str, Any]], stopped: bool, outcome: str) -> None:
    """Dynamo's handlers end a stream with a finish_reason chunk, also when the engine
    aborted it or failed: a stream that ends normally is not by itself completed."""
    gate = AdmissionGate()

    async def generate(request: dict[str, Any], context: StandInContext
                       ) -> AsyncIterator[dict[str, Any]]:
        for chunk in chunks:
            yield chunk

    handler = gated(generate, gate, outcome=finish_outcome)
    assert [c async for c in handler({}, StandInContext(stopped))] == chunks
    counts = gate.outcomes().to_dict()
    assert counts[outcome] == 1 and sum(counts.values()) == 1


async def test_a_closed_gate_raises_the_refusal_the_component_chose() -> None:
    class Unavailable(Exception):
        pass

    gate = AdmissionGate()
    gate.close("draining")

    async def generate(request: dict[str, Any], context: object) -> AsyncIterator[int]:
        yield 1

    handler = gated(generate, gate, refusal=lambda refused: Unavailable(str(refused)))
    with pytest.raises(Unavailable):
        await handler({}, object()).__anext__()
    assert gate.inflight == 0 and gate.outcomes().ended == 0
