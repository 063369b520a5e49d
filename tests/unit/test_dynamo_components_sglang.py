"""``quiesce dynamo sglang``'s hooks, against a FAKE ``dynamo.sglang`` and a FAKE engine.

Every test here runs quiesce's real :class:`SglangComponent` against fake modules that
mirror ai-dynamo 1.6.1's ``dynamo.sglang`` control flow (tests/unit/dynamo_fakes.py): a
fake, not Dynamo, and no SGLang. That the real source still has every hooked name with
the signature these fakes use is checked against the installed ai-dynamo by
tests/integration/dynamo/test_contract_sglang.py; the real worker with the real engine
is tests/gpu/test_dynamo_components.py::test_dynamo_sglang_drains_under_load (GPU, not
run here).
"""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import sys
from collections.abc import AsyncIterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from quiesce.adapters.dynamo import DynamoDiscovery
from quiesce.adapters.dynamo.components import (
    COMPONENTS,
    SglangComponent,
    component_for,
)
from quiesce.adapters.dynamo.model_card import ModelCardDiscovery
from quiesce.adapters.sglang import SglangProbe
from quiesce.admission import AdmissionGate
from quiesce.errors import ConfigError
from quiesce.ops import cli
from quiesce.probe import Role, Verdict
from quiesce.serve.options import DYNAMO_COMPONENTS
from tests.unit.dynamo_fakes import (
    FakeContext,
    FakeDynamo,
    FakeEngine,
    WorkerType,
    WorkerUnavailable,
    chunks_handler,
    run_until_ready,
    served_endpoint,
    until,
)

FIND_SPEC = importlib.util.find_spec
OTHER_FLAGS = ("image_diffusion_worker", "video_generation_worker", "rerank_worker",
               "embedding_worker", "multimodal_encode_worker", "multimodal_worker",
               "diffusion_worker")


class FakeSglangEngine(FakeEngine):
    """SGLang's ``Engine`` as far as the probe and the control touch it (a fake)."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[dict[str, Any]] = []
        self.tokenizer_manager = SimpleNamespace(
            server_args=SimpleNamespace(dp_size=1, pp_size=1, tokenizer_worker_num=1),
            rid_to_state={}, load_snapshot_reader=None, asyncio_tasks=set(),
            abort_request=lambda **kwargs: self.aborted.append(kwargs),
            get_internal_state=self._internal_state)

    async def _internal_state(self) -> list[dict[str, Any]]:
        return []  # quiesce's scheduler plugin is not loaded in a fake: UNKNOWN

    def sigterm_handler(self) -> None:
        raise AssertionError("SGLang's own SIGTERM handler ran")


def prefill_handler() -> type:
    """dynamo.sglang 1.6.1's ``PrefillWorkerHandler`` as the outcome sees it (a fake, read
    from ``request_handlers/llm/prefill_handler.py``): the bootstrap chunk is yielded
    before the prefill runs; then ``_consume_results`` (a task the stream awaits)
    consumes the engine's outputs (``request["results"]``) and returns the final
    ``meta_info``, None when the client cancelled; a ``kv_cache_hit`` chunk follows when
    that ``meta_info`` has ``prompt_tokens``, else the stream just ends."""

    class PrefillWorkerHandler(chunks_handler()):  # type: ignore[misc]
        async def generate(self, request: dict[str, Any], context: Any
                           ) -> AsyncIterator[Any]:
            type(self).started.append(context.id())
            yield {"token_ids": [], "text": None, "finish_reason": None,
                   "disaggregated_params": {"bootstrap_room": 7}}
            final = await asyncio.create_task(
                self._consume_results(request.get("results", []), None, context))
            if final is not None and final.get("prompt_tokens") is not None:
                yield {"token_ids": [], "engine_data": {"kv_cache_hit": {
                    "prompt_tokens": final["prompt_tokens"], "reused_tokens": 0}}}

        async def _consume_results(self, results: list[dict[str, Any]],
                                   submitted_request_id: str | None, context: Any
                                   ) -> dict[str, Any] | None:
            final = None
            for result in results:
                meta = result.get("meta_info") or {}
                if meta.get("finish_reason"):
                    final = meta
            return None if context.is_stopped() else final

    return PrefillWorkerHandler


def fake_sglang(dynamo: FakeDynamo, engine: Any, *, worker_type: Any = WorkerType.Aggregated,
                gateway: bool = False, engine_registered: bool = True,
                **flags: bool) -> dict[str, ModuleType]:
    """``dynamo.sglang`` 1.6.1 as quiesce's hooks see it: ``main.worker`` →
    ``parse_args`` → ``install_graceful_shutdown`` → ``init_decode``/``init_prefill``,
    which builds the engine, serves ``handler.generate`` and registers the model card
    concurrently (``register_model_with_readiness_gate`` → ``register_model``); the
    TokenizerManager registers its SIGTERM handler on the loop. ``engine_registered``
    False: the registration gets ``engine=None`` (as Dynamo's encode worker passes)."""
    llm = sys.modules["dynamo.llm"]
    decode, prefill = chunks_handler(), prefill_handler()
    handlers = dynamo.module("dynamo.sglang.request_handlers", DecodeWorkerHandler=decode,
                             PrefillWorkerHandler=prefill)
    register = dynamo.module("dynamo.sglang.register", register_model=llm.register_model)

    async def register_with_runtime_config(engine: Any, endpoint: Any, worker_type: Any
                                           ) -> bool:
        try:
            await register.register_model("tokens", "chat", endpoint, "/models/m", "m",
                                          worker_type=worker_type)
        except Exception:
            return False
        return True

    async def register_model_with_readiness_gate(  # noqa: PLR0917 (Dynamo's order)
            engine: Any, generate_endpoint: Any, server_args: Any, dynamo_args: Any,
            input_type: Any = None, output_type: Any = None,
            readiness_gate: asyncio.Event | None = None, *, worker_type: Any,
            needs: Any = None, serves_lora_load: bool = False) -> None:
        if not await register_with_runtime_config(engine, generate_endpoint, worker_type):
            engine.shutdown()
            raise RuntimeError("Model registration failed")
        if readiness_gate:
            readiness_gate.set()

    async def serve_via_gateway_children(engine: Any, count: int, shutdown_event: Any,
                                         load_time: Any = None) -> None:
        dynamo.calls.append(("gateway children", count))

    async def init_llm_worker(runtime: Any, config: Any, shutdown_event: asyncio.Event,
                              shutdown_endpoints: list[Any], run_deferred_handlers: Any, *,
                              prefill_worker: bool) -> None:
        endpoint = runtime.endpoint("dynamo.backend.generate")
        dynamo.calls.append(("engine built", engine))
        if gateway:
            try:
                await init_llm.serve_via_gateway_children(engine, 2, shutdown_event)
            finally:
                engine.shutdown()
                await run_deferred_handlers()
            return
        shutdown_endpoints[:] = [endpoint]
        cls = handlers.PrefillWorkerHandler if prefill_worker else handlers.DecodeWorkerHandler
        handler = cls(engine, config, None, endpoint, shutdown_event)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, engine.sigterm_handler)
        try:
            await asyncio.gather(
                endpoint.serve_endpoint(handler.generate, graceful_shutdown=True),
                init_llm.register_model_with_readiness_gate(
                    engine if engine_registered else None, endpoint, None,
                    config.dynamo_args, readiness_gate=asyncio.Event(),
                    worker_type=worker_type, needs=[], serves_lora_load=True))
        finally:
            handler.cleanup()
            await run_deferred_handlers()

    init_llm = dynamo.module("dynamo.sglang.init_llm",
                             register_model_with_readiness_gate=register_model_with_readiness_gate,
                             serve_via_gateway_children=serve_via_gateway_children)

    async def parse_args(argv: list[str]) -> Any:
        return SimpleNamespace(argv=argv, dynamo_args=SimpleNamespace(
            **{flag: flags.get(flag, False) for flag in OTHER_FLAGS}))

    async def worker(argv: list[str] | None = None) -> None:
        config = await main.parse_args(argv)
        shutdown_event, shutdown_endpoints = asyncio.Event(), list[Any]()
        loop = asyncio.get_running_loop()
        run_deferred_handlers = main.install_graceful_shutdown(
            loop, dynamo.runtime, shutdown_endpoints, shutdown_event)
        await init_llm_worker(dynamo.runtime, config, shutdown_event, shutdown_endpoints,
                              run_deferred_handlers,
                              prefill_worker=str(worker_type) == "prefill")

    main = dynamo.module("dynamo.sglang.main", worker=worker, parse_args=parse_args,
                         install_graceful_shutdown=dynamo.helper("dynamo's helper"))
    return {"main": main, "init_llm": init_llm, "register": register, "handlers": handlers}


class Running:
    """The component installed and its worker task running until the model is registered."""

    def __init__(self, component: SglangComponent, task: asyncio.Task[None]) -> None:
        self.component = component
        self.task = task

    async def stop(self) -> None:
        await asyncio.wait_for(self.component.control.shutdown(), 5)


async def start(component: SglangComponent | None = None) -> Running:
    """``component`` (default: a new one with a closed gate) installed and run until
    the model is registered; ``on_ready`` opens its gate."""
    component = component or SglangComponent(AdmissionGate(accepting=False))
    task = await run_until_ready(component)
    return Running(component, task)


# -- install ----------------------------------------------------------------------------

def test_the_cli_name_picks_this_component() -> None:
    assert type(component_for("sglang", AdmissionGate())) is SglangComponent
    with pytest.raises(ConfigError) as info:
        component_for("mocker", AdmissionGate())
    assert "sglang" in str(info.value)


@pytest.mark.parametrize("name", ["sglang", "trtllm"])
def test_the_cli_accepts_each_component_and_exits_2_without_dynamo(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        name: str) -> None:
    """Everything after ``--`` goes to Dynamo; without ai-dynamo the worker exits 2
    before anything starts (with ai-dynamo but without the engine: the contract tests)."""
    assert tuple(COMPONENTS) == DYNAMO_COMPONENTS
    seen: list[Any] = []

    def record(args: Any) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(cli, "_dynamo", record)
    assert cli.main(["dynamo", name, "--budget", "40", "--", "--model-path", "m"]) == 0
    assert seen[0].component == name and seen[0].args == ["--model-path", "m"]
    monkeypatch.undo()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda module, *a: None if module == "dynamo" else FIND_SPEC(module))
    assert cli.main(["dynamo", name, "--", "--model-path", "m"]) == 2
    assert f"quiesce dynamo {name}: dynamo: ai-dynamo is not installed" in \
        capsys.readouterr().err


def test_install_replaces_every_hooked_name_and_gates_both_handlers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake dynamo.sglang (real names: tests/integration/dynamo/test_contract_sglang.py).
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_sglang_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    modules = fake_sglang(dynamo, FakeSglangEngine())
    before = {(m, n): getattr(modules[m], n) for m, n in [
        ("main", "parse_args"), ("main", "install_graceful_shutdown"),
        ("init_llm", "register_model_with_readiness_gate"), ("register", "register_model"),
        ("init_llm", "serve_via_gateway_children")]}
    generate = {name: getattr(modules["handlers"], name).generate
                for name in ("DecodeWorkerHandler", "PrefillWorkerHandler")}
    SglangComponent(AdmissionGate()).install()
    assert all(getattr(modules[m], n) is not original for (m, n), original in before.items())
    for name, original in generate.items():
        gated = getattr(modules["handlers"], name).generate
        assert gated is not original and gated.__wrapped__ is original
    with pytest.raises(ConfigError, match="install\\(\\) once per process"):
        SglangComponent(AdmissionGate()).install()


def test_a_missing_name_is_a_config_error_and_nothing_is_replaced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake dynamo.sglang without one hooked name (a Dynamo whose layout changed).
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_sglang_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    modules = fake_sglang(dynamo, FakeSglangEngine())
    del modules["init_llm"].serve_via_gateway_children
    parse = modules["main"].parse_args
    with pytest.raises(ConfigError) as info:
        SglangComponent(AdmissionGate()).install()
    assert "dynamo.sglang.init_llm.serve_via_gateway_children" in str(info.value)
    assert modules["main"].parse_args is parse
    assert not hasattr(modules["handlers"].DecodeWorkerHandler.generate, "__wrapped__")


def test_dynamo_sglang_not_importable_is_a_config_error_naming_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dynamo.sglang.main", None)  # import raises ImportError
    with pytest.raises(ConfigError) as info:
        SglangComponent(AdmissionGate()).install()
    assert "ai-dynamo[sglang]" in str(info.value) and info.value.field == "dynamo"


# -- the worker's life ------------------------------------------------------------------

async def test_a_served_worker_is_gated_probed_and_stopped_by_dynamos_teardown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake dynamo.sglang and fake engine: idle before the model card exists, then the
    SGLang probe over Dynamo's engine (never idle while it holds requests), requests
    admitted with their outcome, SGLang's own SIGTERM handler kept off the loop, Dynamo's
    helper never run, and the shutdown through Dynamo's teardown (engine shut down).
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_sglang_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    engine = FakeSglangEngine()
    modules = fake_sglang(dynamo, engine)
    gate = AdmissionGate(accepting=False)
    component = SglangComponent(gate)
    work = await component.probe.pending_work()
    assert work.verdict is Verdict.QUIESCENT and "never served" in work.source
    running = await start(component)
    assert component.serving and component.role is Role.AGGREGATED
    probe = component._probe.engine_probe
    assert isinstance(probe, SglangProbe) and probe.tokenizer_manager is engine.tokenizer_manager
    engine.tokenizer_manager.rid_to_state.update(a=1, b=2)
    work = await component.probe.pending_work()
    assert work.verdict is Verdict.BUSY and work.queues["tokenizer_requests"] == 2
    engine.tokenizer_manager.rid_to_state.clear()
    work = await component.probe.pending_work()
    assert work.verdict is Verdict.UNKNOWN  # no scheduler answer in a fake: never idle

    endpoint = served_endpoint(dynamo.runtime)
    received, _ = await endpoint.call({"chunks": [{"token_ids": [1]}, {
        "token_ids": [2], "finish_reason": "stop"}]}, FakeContext("r1"))
    assert len(received) == 2 and gate.outcomes().completed == 1
    await endpoint.call({"chunks": [{"token_ids": [], "finish_reason": "cancelled"}]},
                        FakeContext("r2", stopped=True))
    assert gate.outcomes().client_gone == 1

    loop = asyncio.get_running_loop()
    assert [sig for sig, _ in running.component.kept_out] == [signal.SIGTERM]
    assert engine.sigterm_handler not in [
        h._callback for h in getattr(loop, "_signal_handlers", {}).values()]
    assert not [c for c in dynamo.calls if c[0] in ("dynamo's helper", "deferred handlers")]

    gate.close("draining")
    with pytest.raises(WorkerUnavailable, match="draining"):
        await endpoint.call({"chunks": [{"finish_reason": "stop"}]}, FakeContext("r3"))
    assert "r3" not in modules["handlers"].DecodeWorkerHandler.started
    await running.stop()
    assert running.task.done() and running.task.exception() is None
    assert engine.shut_down  # handler.cleanup() in Dynamo's own finally


async def test_a_prefill_worker_gets_the_prefill_probe_and_counts_what_the_engine_did(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake dynamo.sglang prefill worker (role from ``worker_type``), fake engine. The
    bootstrap chunk comes before the prefill runs: the outcome is the engine's final
    ``meta_info`` (through the hooked ``_consume_results``), never that chunk; an aborted
    prefill ends its stream with no further chunk and is lost (before: completed).
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_sglang_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    modules = fake_sglang(dynamo, FakeSglangEngine(), worker_type=WorkerType.Prefill)
    running = await start()
    assert running.component.role is Role.PREFILL
    assert running.component.probe.role is Role.PREFILL
    endpoint = served_endpoint(dynamo.runtime)
    done = {"meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 3}}
    aborted = {"meta_info": {"finish_reason": {"type": "abort", "message": "aborted"}}}
    for results, context in [([{"meta_info": {}}, done], FakeContext("p1")),
                             ([aborted], FakeContext("p2")),
                             ([aborted], FakeContext("p3", stopped=True)),
                             ([], FakeContext("p4"))]:  # never finished
        await endpoint.call({"results": results}, context)
    assert modules["handlers"].PrefillWorkerHandler.started == ["p1", "p2", "p3", "p4"]
    assert running.component.gate.outcomes().to_dict() == {
        "completed": 1, "lost": 2, "client_gone": 1, "rejected": 0}
    await running.stop()


def test_a_missing_engine_end_method_is_a_config_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake dynamo.sglang whose prefill handler lost ``_consume_results``: refused,
    named, nothing replaced (its outcome could not be read).
    Real: tests/integration/dynamo/test_contract_sglang.py (the real method)."""
    dynamo = FakeDynamo(monkeypatch)
    modules = fake_sglang(dynamo, FakeSglangEngine())
    del modules["handlers"].PrefillWorkerHandler._consume_results
    with pytest.raises(ConfigError) as info:
        SglangComponent(AdmissionGate()).install()
    assert "PrefillWorkerHandler._consume_results" in str(info.value)
    assert not hasattr(modules["handlers"].PrefillWorkerHandler.generate, "__wrapped__")


@pytest.mark.parametrize("engine_registered,worker_type,reason", [
    (False, WorkerType.Aggregated, "cannot read the engine"),
    (True, "encode", "role is unknown"),
])
async def test_an_engine_or_role_quiesce_cannot_read_is_unknown_while_serving(
        monkeypatch: pytest.MonkeyPatch, engine_registered: bool, worker_type: Any,
        reason: str) -> None:
    """Fake dynamo.sglang handing the registration no engine (quiesce's SGLang probe
    refuses None) or a worker type quiesce does not know: UNKNOWN with the reason.
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_sglang_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    fake_sglang(dynamo, FakeSglangEngine(), worker_type=worker_type,
                engine_registered=engine_registered)
    running = await start()
    work = await running.component.probe.pending_work()
    assert work.verdict is Verdict.UNKNOWN and reason in work.reasons[0]
    await running.stop()


@pytest.mark.parametrize("flag", OTHER_FLAGS)
async def test_a_worker_kind_quiesce_does_not_wrap_is_refused_before_the_engine(
        monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    """Fake dynamo.sglang parsing ``--<kind>``: those workers serve through code the hooks
    do not reach, so they are refused before any engine is built.
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_sglang_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    fake_sglang(dynamo, FakeSglangEngine(), **{flag: True})
    component = SglangComponent(AdmissionGate())
    component.install()
    with pytest.raises(ConfigError) as info:
        await component.run([f"--{flag.replace('_', '-')}"])
    assert flag.replace("_", "-") in str(info.value)
    assert not [c for c in dynamo.calls if c[0] == "engine built"]


async def test_gateway_mode_is_refused_and_the_engine_stopped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake dynamo.sglang in gateway mode: its children would serve outside quiesce.
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_sglang_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    engine = FakeSglangEngine()
    fake_sglang(dynamo, engine, gateway=True)
    component = SglangComponent(AdmissionGate())
    component.install()
    with pytest.raises(ConfigError, match="gateway"):
        await component.run([])
    assert engine.shut_down and ("gateway children", 2) not in dynamo.calls


# -- discovery and control --------------------------------------------------------------

async def test_the_model_card_comes_off_first_and_back_without_dynamos_engine_shutdown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake dynamo.sglang: unregister takes the card off, then the instance; register
    brings them back with ``register_model``'s own arguments. A failed re-registration
    leaves the engine running (``register_model_with_readiness_gate`` would stop it).
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_sglang_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    engine = FakeSglangEngine()
    fake_sglang(dynamo, engine)
    running = await start()
    component = running.component
    endpoint = served_endpoint(dynamo.runtime)
    discovery = ModelCardDiscovery(DynamoDiscovery(component.endpoints, registered=True),
                                   lambda: component.model)
    discovery.served(card=True)
    await discovery.unregister()
    assert dynamo.calls[-1] == ("unregister_model", endpoint) and endpoint.log == ["unregister"]
    first = [c for c in dynamo.calls if c[0] == "register_model"]
    await discovery.register()
    again = [c for c in dynamo.calls if c[0] == "register_model"]
    assert len(again) == 2 and again[1] == first[0] and endpoint.log[-1] == "register"
    dynamo.fail_registration = True
    await discovery.unregister()
    with pytest.raises(Exception, match="register the model"):
        await discovery.register()
    assert not engine.shut_down and discovery.registration_error is not None
    await running.stop()


async def test_abort_all_aborts_in_sglang_and_ends_dynamos_streams(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake dynamo.sglang and fake TokenizerManager: the forced path.
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_sglang_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    engine = FakeSglangEngine()
    fake_sglang(dynamo, engine)
    running = await start()
    release = asyncio.Event()
    stream = asyncio.create_task(served_endpoint(dynamo.runtime).call(
        {"wait": release, "chunks": [{"finish_reason": "cancelled"}]}, FakeContext("s1")))
    await until(lambda: running.component.gate.inflight == 1)
    engine.tokenizer_manager.rid_to_state["s1"] = object()
    aborted = await running.component.control.abort_all("budget ran out")
    assert aborted == 1 and engine.aborted == [{"abort_all": True}]
    assert running.component.shutdown_event is not None
    assert running.component.shutdown_event.is_set()
    release.set()
    await stream
    assert running.component.gate.outcomes().lost == 1
    await running.stop()


async def test_a_signal_before_the_model_card_cancels_the_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake dynamo.sglang whose registration never returns: shutdown before serving
    cancels the worker task (Dynamo's own cleanup stops the engine).
    Real: tests/gpu/test_dynamo_components.py::test_dynamo_sglang_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    engine = FakeSglangEngine()
    modules = fake_sglang(dynamo, engine)
    hang = asyncio.Event()

    async def never(*args: Any, **kwargs: Any) -> None:
        await hang.wait()

    modules["register"].register_model = never  # type: ignore[attr-defined]
    component = SglangComponent(AdmissionGate(accepting=False))
    component.install()
    task = asyncio.create_task(component.run([]))
    await until(lambda: bool(component.endpoints))
    assert not component.serving
    assert (await component.probe.pending_work()).verdict is Verdict.QUIESCENT
    await asyncio.wait_for(component.control.shutdown(), 5)
    assert task.cancelled() and engine.shut_down and dynamo.runtime.stopped.is_set()
