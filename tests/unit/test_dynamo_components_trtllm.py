"""``quiesce dynamo trtllm``'s hooks, against a FAKE ``dynamo.trtllm`` and a FAKE engine.

Every test here runs quiesce's real :class:`TrtllmComponent` against fake modules that
mirror ai-dynamo 1.6.1's ``dynamo.trtllm`` control flow (tests/unit/dynamo_fakes.py) and
a fake ``TensorRTLLMEngine`` whose ``LLM`` holds a fake ``PyExecutor``
(tests/unit/test_trtllm_probe.py's): a fake, not Dynamo, and no TensorRT-LLM (it cannot
be installed here). That the real source still has every hooked name with the signature
these fakes use is checked against the installed ai-dynamo by
tests/integration/dynamo/test_contract_trtllm.py; the real worker with the real engine is
tests/gpu/test_dynamo_components.py::test_dynamo_trtllm_drains_under_load (GPU, not run
here).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import sys
from collections.abc import AsyncIterator
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

import pytest

from quiesce.adapters.dynamo.components import TrtllmComponent, component_for
from quiesce.adapters.trtllm import InProcessProbe
from quiesce.admission import AdmissionGate
from quiesce.errors import ConfigError
from quiesce.probe import Role, Verdict
from tests.unit.dynamo_fakes import (
    FakeContext,
    FakeDynamo,
    WorkerType,
    WorkerUnavailable,
    push_egress_capable,
    run_until_ready,
    served_endpoint,
    until,
)
from tests.unit.test_trtllm_probe import FakeLLM, NewExecutor, Request, executor_named


class Mode(enum.Enum):  # dynamo.trtllm.constants.DisaggregationMode (1.6.1 values)
    AGGREGATED = "prefill_and_decode"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"


class Modality(enum.Enum):  # dynamo.trtllm.constants.Modality (1.6.1 values)
    TEXT = "text"
    MULTIMODAL = "multimodal"
    VIDEO_DIFFUSION = "video_diffusion"
    IMAGE_DIFFUSION = "image_diffusion"


WORKER_TYPES = {Mode.AGGREGATED: WorkerType.Aggregated, Mode.PREFILL: WorkerType.Prefill,
                Mode.DECODE: WorkerType.Decode}


class Result:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class FakeTrtllmEngine:
    """Dynamo's ``TensorRTLLMEngine`` (a fake): ``llm`` raises until ``initialize``,
    ``cleanup`` shuts the ``LLM`` down; the LLM's executor is the single-process worker's
    over a fake ``PyExecutor``."""

    def __init__(self, mode: Mode, executor: Any, initialize: bool = True) -> None:
        self.disaggregation_mode = mode
        self.executor = executor
        self.initialize_ok = initialize
        self._llm: Any = None
        self.llm_shut_down = False

    async def initialize(self) -> None:
        if self.initialize_ok:
            worker = executor_named("GenerationExecutorWorker", engine=self.executor,
                                    _results={})
            self._llm = FakeLLM(worker)

    @property
    def llm(self) -> Any:
        if not self._llm:
            raise RuntimeError("Engine not initialized")
        return self._llm

    async def cleanup(self) -> None:
        if self._llm:
            self.llm_shut_down = True
            self._llm = None


def chunk_handler() -> type:
    class Handler:
        started: ClassVar[list[str]] = []

        def __init__(self, engine: Any) -> None:
            self.engine = engine

        @push_egress_capable
        async def generate(self, request: dict[str, Any], context: Any
                           ) -> AsyncIterator[Any]:
            type(self).started.append(context.id())
            if "wait" in request:
                await request["wait"].wait()
            for chunk in request["chunks"]:
                yield chunk

    return Handler


def fake_trtllm(dynamo: FakeDynamo, engine: FakeTrtllmEngine, *, mode: Mode = Mode.AGGREGATED,
                modality: Modality = Modality.TEXT) -> dict[str, ModuleType]:
    """``dynamo.trtllm`` 1.6.1 as quiesce's hooks see it: ``main.worker`` → ``parse_args``
    → ``install_signal_handlers`` (a prefill ``drain_callback``) → ``init_llm_worker``:
    ``async with get_llm_engine(engine_args, mode)``, ``register_model(..., endpoint,
    ...)``, then ``serve_endpoint(handler.generate)`` with the push-egress handler."""
    llm = sys.modules["dynamo.llm"]
    aggregated = dynamo.module("dynamo.trtllm.request_handlers.aggregated_handler",
                               AggregatedHandler=chunk_handler())
    handlers = dynamo.module("dynamo.trtllm.request_handlers.handlers",
                             PrefillHandler=chunk_handler(), DecodeHandler=chunk_handler())

    @contextlib.asynccontextmanager
    async def get_llm_engine(engine_args: Any, disaggregation_mode: Any = None,
                             component_gauges: Any = None) -> AsyncIterator[Any]:
        dynamo.calls.append(("engine built", engine_args))
        try:
            await engine.initialize()
            yield engine
        finally:
            await engine.cleanup()

    async def init_llm_worker(runtime: Any, config: Any, shutdown_event: Any,
                              shutdown_endpoints: list[Any], engine_holder: list[Any]) -> None:
        async with llm_worker.get_llm_engine({"model": "m"}, config.disaggregation_mode,
                                             component_gauges=None) as built:
            engine_holder.append(built)
            endpoint = runtime.endpoint("dynamo.tensorrt_llm.generate")
            shutdown_endpoints[:] = [endpoint]
            await llm_worker.register_model(
                "tokens", "chat", endpoint, "/models/m", "m",
                worker_type=WORKER_TYPES[config.disaggregation_mode])
            cls = {Mode.AGGREGATED: aggregated.AggregatedHandler,
                   Mode.PREFILL: handlers.PrefillHandler,
                   Mode.DECODE: handlers.DecodeHandler}[config.disaggregation_mode]
            await endpoint.serve_endpoint(cls(built).generate)

    llm_worker = dynamo.module("dynamo.trtllm.workers.llm_worker",
                               get_llm_engine=get_llm_engine, register_model=llm.register_model)

    def parse_args(argv: list[str] | None = None) -> Any:
        return SimpleNamespace(argv=argv, modality=modality, disaggregation_mode=mode)

    async def drain_in_flight_requests() -> None:
        dynamo.calls.append(("dynamo's drain callback", ()))

    async def worker(argv: list[str] | None = None) -> None:
        config = main.parse_args(argv)
        engine_holder: list[Any] = []
        shutdown_event = asyncio.Event()
        drain = drain_in_flight_requests if config.disaggregation_mode == Mode.PREFILL else None
        main.install_signal_handlers(asyncio.get_running_loop(), dynamo.runtime,
                                     main.shutdown_endpoints, shutdown_event,
                                     drain_callback=drain)
        await init_llm_worker(dynamo.runtime, config, shutdown_event,
                              main.shutdown_endpoints, engine_holder)

    main = dynamo.module("dynamo.trtllm.main", worker=worker, parse_args=parse_args,
                         install_signal_handlers=dynamo.helper("dynamo's helper"),
                         shutdown_endpoints=[])
    return {"main": main, "llm_worker": llm_worker, "aggregated": aggregated,
            "handlers": handlers}


async def start(component: TrtllmComponent | None = None) -> tuple[TrtllmComponent,
                                                                   asyncio.Task[None]]:
    """``component`` (default: a new one with a closed gate) installed and run until the
    model is registered; ``on_ready`` opens its gate."""
    component = component or TrtllmComponent(AdmissionGate(accepting=False))
    task = await run_until_ready(component)
    await until(lambda: bool(component.endpoints and component.endpoints[0].handler))
    return component, task


# -- install ----------------------------------------------------------------------------

def test_the_cli_name_picks_this_component() -> None:
    assert type(component_for("trtllm", AdmissionGate())) is TrtllmComponent


def test_install_gates_every_handler_and_keeps_the_push_signature(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake dynamo.trtllm (real names: tests/integration/dynamo/test_contract_trtllm.py):
    the gated ``generate`` still names ``response_sender``, so Dynamo's runtime keeps
    choosing push egress for it.
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_trtllm_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    modules = fake_trtllm(dynamo, FakeTrtllmEngine(Mode.AGGREGATED, NewExecutor()))
    helper = modules["main"].install_signal_handlers
    TrtllmComponent(AdmissionGate()).install()
    assert modules["main"].install_signal_handlers is not helper
    for module, name in [("aggregated", "AggregatedHandler"), ("handlers", "PrefillHandler"),
                         ("handlers", "DecodeHandler")]:
        generate = getattr(modules[module], name).generate
        assert getattr(generate, "__quiesce_gated__", False)
        assert "response_sender" in inspect.signature(generate).parameters


def test_a_missing_name_is_a_config_error_and_nothing_is_replaced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake dynamo.trtllm whose llm_worker lost ``get_llm_engine``.
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_trtllm_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    modules = fake_trtllm(dynamo, FakeTrtllmEngine(Mode.AGGREGATED, NewExecutor()))
    del modules["llm_worker"].get_llm_engine
    helper = modules["main"].install_signal_handlers
    with pytest.raises(ConfigError) as info:
        TrtllmComponent(AdmissionGate()).install()
    assert "dynamo.trtllm.workers.llm_worker.get_llm_engine" in str(info.value)
    assert modules["main"].install_signal_handlers is helper


def test_dynamo_trtllm_not_importable_is_a_config_error_naming_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dynamo.trtllm.main", None)
    with pytest.raises(ConfigError) as info:
        TrtllmComponent(AdmissionGate()).install()
    assert "ai-dynamo[trtllm]" in str(info.value)


@pytest.mark.parametrize("mode,modality", [(Mode.ENCODE, Modality.TEXT),
                                           (Mode.AGGREGATED, Modality.VIDEO_DIFFUSION),
                                           (Mode.AGGREGATED, Modality.IMAGE_DIFFUSION)])
async def test_a_worker_quiesce_does_not_wrap_is_refused_before_the_engine(
        monkeypatch: pytest.MonkeyPatch, mode: Mode, modality: Modality) -> None:
    """Fake dynamo.trtllm parsing an encode or diffusion worker.
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_trtllm_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    fake_trtllm(dynamo, FakeTrtllmEngine(mode, NewExecutor()), mode=mode, modality=modality)
    component = TrtllmComponent(AdmissionGate())
    component.install()
    with pytest.raises(ConfigError) as info:
        await component.run([])
    assert modality.value in str(info.value) and mode.value in str(info.value)
    assert not [c for c in dynamo.calls if c[0] == "engine built"]


# -- the worker's life ------------------------------------------------------------------

async def test_a_served_worker_reads_the_py_executor_and_admits_pushed_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake dynamo.trtllm and fake engine: idle before the card, then quiesce's
    in-process probe over Dynamo's ``LLM`` (busy while the fake PyExecutor holds a
    request), pushed requests admitted with the outcome their responses state, the pull
    path (canary) too, a closed gate refusing before the handler runs, and the shutdown
    through Dynamo's teardown (``llm.shutdown()`` on leaving ``get_llm_engine``).
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_trtllm_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    executor = NewExecutor(active=[Request()])
    engine = FakeTrtllmEngine(Mode.AGGREGATED, executor)
    modules = fake_trtllm(dynamo, engine)
    component = TrtllmComponent(AdmissionGate(accepting=False))
    assert (await component.probe.pending_work()).verdict is Verdict.QUIESCENT
    component, task = await start(component)
    assert isinstance(component._probe.engine_probe, InProcessProbe)
    assert component.role is Role.AGGREGATED
    work = await component.probe.pending_work()
    assert work.verdict is Verdict.BUSY and work.running == 1
    executor.active_requests.clear()
    assert (await component.probe.pending_work()).verdict is Verdict.QUIESCENT

    endpoint = served_endpoint(dynamo.runtime)
    sent, sender = await endpoint.call({"chunks": [{"token_ids": [1]}, {
        "token_ids": [2], "finish_reason": "stop"}]}, FakeContext("r1"))
    assert sender is not None and sender.closed and len(sent) == 2
    await endpoint.call({"chunks": [{"token_ids": [], "finish_reason": {"error": "x"}}]},
                        FakeContext("r2"))
    await endpoint.call({"chunks": [{"token_ids": [1]}]}, FakeContext("r3"))
    outcomes = component.gate.outcomes()
    assert (outcomes.completed, outcomes.lost) == (1, 2)
    pulled = [c async for c in component.endpoints[0].handler(
        {"chunks": [{"finish_reason": "length"}]}, FakeContext("canary"))]
    assert pulled == [{"finish_reason": "length"}]
    assert component.gate.outcomes().completed == 2
    # the client stopped it: Dynamo's handler ends it without a finish reason
    await endpoint.call({"chunks": [{"token_ids": [1]}]}, FakeContext("r4", stopped=True))
    assert (component.gate.outcomes().client_gone, component.gate.outcomes().lost) == (1, 2)

    component.gate.close("draining")
    with pytest.raises(WorkerUnavailable, match="draining"):
        await endpoint.call({"chunks": []}, FakeContext("late"))
    assert "late" not in modules["aggregated"].AggregatedHandler.started
    assert not [c for c in dynamo.calls if c[0] == "dynamo's helper"]
    await asyncio.wait_for(component.control.shutdown(), 5)
    assert task.done() and task.exception() is None and engine.llm_shut_down


async def test_a_prefill_worker_holds_kv_in_transfer_and_dynamos_drain_is_not_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake dynamo.trtllm prefill worker over a fake PyExecutor with a context request
    whose KV is still being sent: not quiescent; Dynamo's stats-polling drain callback is
    recorded, never run; the prefill response (``length`` + ``disaggregated_params``) is
    completed.
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_trtllm_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    executor = NewExecutor(in_transfer=1)
    fake_trtllm(dynamo, FakeTrtllmEngine(Mode.PREFILL, executor), mode=Mode.PREFILL)
    component, _ = await start()
    assert component.role is Role.PREFILL
    work = await component.probe.pending_work()
    assert work.verdict is Verdict.BUSY and work.kv_sends_held == 1
    await served_endpoint(dynamo.runtime).call({"chunks": [{
        "token_ids": [5], "finish_reason": "length", "disaggregated_params": {"ctx": 1}}]},
        FakeContext("p1"))
    assert component.gate.outcomes().completed == 1
    assert component._callbacks["drain_callback"] is not None
    await asyncio.wait_for(component.control.shutdown(), 5)
    assert ("dynamo's drain callback", ()) not in dynamo.calls


async def test_an_engine_that_cannot_be_read_is_unknown_while_serving(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake TensorRTLLMEngine whose ``llm`` raises (not initialized): UNKNOWN, the reason
    says why, never idle.
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_trtllm_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    fake_trtllm(dynamo, FakeTrtllmEngine(Mode.AGGREGATED, NewExecutor(), initialize=False))
    component, _ = await start()
    work = await component.probe.pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert "cannot read the engine" in work.reasons[0] and "not initialized" in work.reasons[0]
    assert component.engine_control() is None
    await asyncio.wait_for(component.control.shutdown(), 5)


async def test_abort_all_aborts_every_result_and_ends_dynamos_streams(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake dynamo.trtllm and fake LLM results: the forced path.
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_trtllm_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    engine = FakeTrtllmEngine(Mode.AGGREGATED, NewExecutor())
    fake_trtllm(dynamo, engine)
    component, _ = await start()
    results = {1: Result(), 2: Result()}
    engine.llm._executor._results.update(results)
    release = asyncio.Event()
    stream = asyncio.create_task(served_endpoint(dynamo.runtime).call(
        {"wait": release, "chunks": []}, FakeContext("s1")))
    await until(lambda: component.gate.inflight == 1)
    assert await component.control.abort_all("budget ran out") == 2
    assert all(r.aborted for r in results.values())
    assert component.shutdown_event is not None and component.shutdown_event.is_set()
    release.set()
    await stream
    assert component.gate.outcomes().lost == 1
    await asyncio.wait_for(component.control.shutdown(), 5)
