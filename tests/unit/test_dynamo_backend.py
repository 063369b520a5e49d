"""The reference worker's Dynamo backend pieces (quiesce.adapters.dynamo.backend,
.token_handler, .model_card) without Dynamo: its settings, the model directory it reads,
the request it parses, the handler over the real simulated engine, and the discovery of
a model card and its instances.

Where Dynamo itself would be, FAKES stand in: Dynamo's two exception types (a module in
``sys.modules``), its request ``Context`` and the card/instance calls. The real runtime
and frontend run in tests/integration/dynamo/test_reference_backend.py."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from quiesce.adapters.dynamo.backend import DynamoBackendConfig, endpoint_path
from quiesce.adapters.dynamo.gated import finish_outcome, gated
from quiesce.adapters.dynamo.model_card import ModelCardDiscovery
from quiesce.adapters.dynamo.token_handler import (
    has_chat_template,
    output_token,
    request_of,
    token_handler,
)
from quiesce.adapters.sim import SimConfig, SimServing
from quiesce.admission import AdmissionGate
from quiesce.budget import Deadline
from quiesce.discovery import DiscoveryUnavailable
from quiesce.drain import DrainConfig
from quiesce.errors import ConfigError, RequestRejected
from quiesce.lifecycle import Lifecycle
from quiesce.shutdown import EXIT_CLEAN, Shutdown, ShutdownPolicy
from tests.unit.lifecycle_harness import ScriptedDiscovery


class EngineShutdown(Exception):
    """FAKE of ``dynamo.llm.exceptions.EngineShutdown``."""


class InvalidArgument(Exception):
    """FAKE of ``dynamo.llm.exceptions.InvalidArgument``."""


@pytest.fixture
def dynamo_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    module = ModuleType("dynamo.llm.exceptions")
    module.EngineShutdown = EngineShutdown  # type: ignore[attr-defined]
    module.InvalidArgument = InvalidArgument  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dynamo.llm.exceptions", module)


class FakeContext:
    """FAKE of Dynamo's request ``Context``: its id, and the client's stop."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._stopped = asyncio.get_running_loop().create_future()

    def id(self) -> str:
        return self.request_id

    def is_stopped(self) -> bool:
        return self._stopped.done()

    def async_killed_or_stopped(self) -> asyncio.Future[bool]:
        return self._stopped

    def stop(self) -> None:
        self._stopped.set_result(True)


# -- settings and the model directory ------------------------------------------------


def test_an_endpoint_is_three_names_with_or_without_dyn() -> None:
    assert endpoint_path("dyn://ns.backend.generate") == "ns.backend.generate"
    assert endpoint_path("a-b.c_d.e1") == "a-b.c_d.e1"
    for bad in ("a.b", "a.b.c.d", "a..c", "a.b.c d", ""):
        with pytest.raises(ConfigError) as raised:
            endpoint_path(bad)
        assert raised.value.field == "dynamo_endpoint"


@pytest.mark.parametrize("changes,field", [
    ({"discovery_backend": "zookeeper"}, "dynamo_discovery_backend"),
    ({"request_plane": "udp"}, "dynamo_request_plane"),
    ({"served_model_name": " "}, "served_model_name"),
    ({"endpoint": "x.y"}, "dynamo_endpoint"),
    ({"rpc_timeout_s": 0}, "rpc_timeout_s"),
])
def test_a_bad_backend_setting_names_its_option(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as raised:
        DynamoBackendConfig(**{"model_path": "/m", "served_model_name": "m", **changes})
    assert raised.value.field == field


def _model(directory: Path, vocab: object, *, specials: tuple[int, ...] = (),
           config: dict[str, Any] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    added = [{"id": i, "content": f"<{i}>", "special": True} for i in specials]
    (directory / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": added, "model": {"vocab": vocab}}))
    (directory / "config.json").write_text(json.dumps(config or {}))
    return directory


def test_the_output_token_is_the_first_ordinary_id(tmp_path: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3, "a": 4}
    model = _model(tmp_path / "m", vocab, specials=(0,), config={"bos_token_id": 1,
                                                                 "eos_token_id": [2]})
    assert output_token(model) == 3
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert output_token(model) == 4
    unigram = _model(tmp_path / "u", [["<unk>", 0.0], ["x", -1.0]], specials=(0,))
    assert output_token(unigram) == 1


@pytest.mark.parametrize("write", ["nothing", "no-vocab", "only-specials", "bad-json"])
def test_a_model_without_a_usable_tokenizer_is_refused(tmp_path: Path, write: str) -> None:
    model = tmp_path / "m"
    model.mkdir()
    if write == "no-vocab":
        (model / "tokenizer.json").write_text("{}")
    elif write == "only-specials":
        _model(model, {"<unk>": 0}, specials=(0,))
    elif write == "bad-json":
        (model / "tokenizer.json").write_text("{oops")
    with pytest.raises(ConfigError) as raised:
        output_token(model)
    assert raised.value.field == "model"


def test_the_chat_surface_needs_a_chat_template(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", {"a": 0})
    assert not has_chat_template(model)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    assert has_chat_template(model)


# -- the request ------------------------------------------------------------------------


def test_a_preprocessed_request_gives_the_prompt_and_the_stop_conditions() -> None:
    prompt, sampling = request_of({"token_ids": [5, 6, 7], "stop_conditions": {
        "max_tokens": 9, "min_tokens": None, "ignore_eos": True}})
    assert prompt == (5, 6, 7)
    assert (sampling.max_tokens, sampling.min_tokens, sampling.ignore_eos) == (9, 0, True)
    assert request_of({"token_ids": []})[1].max_tokens is None  # the engine's default


@pytest.mark.parametrize("request_body", [
    None, {"token_ids": "abc"}, {"token_ids": [1, "2"]},
    {"token_ids": [1], "stop_conditions": {"max_tokens": 0}},
    {"token_ids": [1], "stop_conditions": {"max_tokens": -3}},
    {"token_ids": [1], "stop_conditions": {"max_tokens": True}},
    {"token_ids": [1], "stop_conditions": "x"},
])
def test_a_request_that_is_not_a_preprocessed_request_is_rejected(request_body: object) -> None:
    with pytest.raises(RequestRejected):
        request_of(request_body)


# -- the handler over the real simulated engine -------------------------------------------


def _handler(serving: SimServing, shutdown: asyncio.Event) -> Any:
    return token_handler(serving.stream, serving.engine.abort, 42, shutdown)


async def _serving() -> SimServing:
    serving = SimServing(SimConfig(decode_step_s=0.005))
    await serving.start()
    return serving


@pytest.mark.usefixtures("dynamo_errors")
async def test_a_stream_yields_dynamos_chunks_with_the_usage_last() -> None:
    serving = await _serving()
    generate = _handler(serving, asyncio.Event())
    request = {"token_ids": [1, 2], "stop_conditions": {"max_tokens": 4}}
    chunks = [chunk async for chunk in generate(request, FakeContext("r1"))]
    assert [c["token_ids"] for c in chunks] == [[42]] * 4
    assert all("finish_reason" not in c for c in chunks[:-1])
    assert chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["completion_usage"] == {"prompt_tokens": 2, "completion_tokens": 4,
                                              "total_tokens": 6}
    await serving.engine.shutdown()


@pytest.mark.usefixtures("dynamo_errors")
async def test_a_client_stop_aborts_the_request_and_ends_cancelled() -> None:
    serving = await _serving()
    generate = _handler(serving, asyncio.Event())
    context = FakeContext("r2")
    chunks = []
    async for chunk in generate({"token_ids": [1], "stop_conditions": {"max_tokens": 500}},
                                context):
        chunks.append(chunk)
        if len(chunks) == 2:
            context.stop()
    # the engine aborted it (a stream it finished would end "length"), and let it go
    assert chunks[-1] == {"index": 0, "token_ids": [], "finish_reason": "cancelled"}
    assert all("finish_reason" not in c for c in chunks[:-1])
    assert not serving.engine.holds("r2")
    await serving.engine.shutdown()


@pytest.mark.usefixtures("dynamo_errors")
async def test_the_shutdown_event_aborts_and_raises_dynamos_engine_shutdown() -> None:
    serving = await _serving()
    shutdown = asyncio.Event()
    generate = _handler(serving, shutdown)
    seen = 0
    with pytest.raises(EngineShutdown):
        async for _ in generate({"token_ids": [1], "stop_conditions": {"max_tokens": 500}},
                                FakeContext("r3")):
            seen += 1
            if seen == 2:
                shutdown.set()
    # EngineShutdown is raised only for a request the engine aborted (it would else end
    # "length"); the engine let it go
    assert seen >= 2 and not serving.engine.holds("r3")
    await serving.engine.shutdown()


@pytest.mark.usefixtures("dynamo_errors")
async def test_a_refused_request_is_dynamos_invalid_argument() -> None:
    serving = await _serving()
    generate = _handler(serving, asyncio.Event())
    with pytest.raises(InvalidArgument):
        async for _ in generate({"token_ids": "nope"}, FakeContext("r4")):
            pass
    await serving.engine.shutdown()


@pytest.mark.usefixtures("dynamo_errors")
async def test_a_malformed_request_during_a_drain_is_rejected_and_the_drain_ends_drained(
        ) -> None:
    """The handler gated as ``quiesce serve --dynamo`` serves it; a request that is not a
    ``PreprocessedRequest`` arrives while the drain unregisters (the gate still open): it
    is the client's bad request (Dynamo's ``InvalidArgument``, HTTP 400), counted
    rejected, so the shutdown still ends drained, exit 0 (before: lost, exit 5)."""
    serving = await _serving()
    gate = AdmissionGate()
    discovery = ScriptedDiscovery()
    discovery.unregister_gate = asyncio.Event()
    lifecycle = Lifecycle(gate=gate, probe=serving.probe, discovery=discovery,
                          config=DrainConfig(router_grace_s=0.0, poll_base_s=0.001,
                                             poll_cap_s=0.004, probe_timeout_s=0.5))
    await lifecycle.start()
    shutdown = Shutdown(lifecycle, serving.control, ShutdownPolicy(10.0, 2.0))
    handler = gated(_handler(serving, asyncio.Event()), gate, outcome=finish_outcome)
    running = asyncio.create_task(shutdown.run())
    await asyncio.wait_for(discovery.unregister_entered.wait(), 5)
    with pytest.raises(InvalidArgument):
        async for _ in handler({"token_ids": "nope"}, FakeContext("bad")):
            pass
    discovery.unregister_gate.set()
    report = await asyncio.wait_for(running, 10)
    assert report.requests.rejected == 1 and report.requests.lost == 0, report.to_dict()
    assert report.outcome == "drained" and report.exit_code == EXIT_CLEAN, report.to_dict()


def test_the_handler_needs_dynamo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dynamo.llm.exceptions", None)
    with pytest.raises(ConfigError) as raised:
        token_handler(lambda *a: None, lambda rid: None, 0, asyncio.Event())  # type: ignore[arg-type]
    assert raised.value.field == "dynamo"


# -- discovery: the model card and the instances --------------------------------------


class FakeCard:
    """FAKE of the model card's register/unregister (Dynamo's register_model)."""

    def __init__(self, calls: list[str], fail: bool = False) -> None:
        self.calls = calls
        self.fail = fail

    async def register(self) -> None:
        self.calls.append("card+")
        if self.fail:
            raise RuntimeError("store down")

    async def unregister(self) -> None:
        self.calls.append("card-")
        if self.fail:
            raise RuntimeError("store down")


class FakeInstances:
    """FAKE of the instances' DynamoDiscovery."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.registered = False
        self.registration_error: str | None = None

    def served(self) -> None:
        self.registered = True

    async def register(self, deadline: Deadline | None = None) -> None:
        self.calls.append("instances+")
        self.registered = True

    async def unregister(self, deadline: Deadline | None = None) -> None:
        self.calls.append("instances-")
        self.registered = False


async def test_the_card_goes_first_both_ways_and_only_when_needed() -> None:
    calls: list[str] = []
    card = FakeCard(calls)
    discovery = ModelCardDiscovery(FakeInstances(calls), lambda: card)
    assert not discovery.registered
    await discovery.register()
    await discovery.register()  # idempotent: the card is listed already
    assert discovery.registered
    await discovery.unregister()
    await discovery.unregister()
    assert not discovery.registered
    assert calls == ["card+", "instances+", "instances+", "card-", "instances-",
                     "instances-"]


async def test_a_worker_that_registered_itself_is_not_registered_twice() -> None:
    calls: list[str] = []
    card = FakeCard(calls)
    discovery = ModelCardDiscovery(FakeInstances(calls), lambda: card)
    discovery.served(card=True)
    assert discovery.registered
    await discovery.register()
    assert calls == ["instances+"]


async def test_without_a_card_only_the_instances_count() -> None:
    calls: list[str] = []
    discovery = ModelCardDiscovery(FakeInstances(calls), lambda: None)
    await discovery.register()
    await discovery.unregister()
    assert calls == ["instances+", "instances-"]


async def test_a_failed_card_call_leaves_the_state_unknown() -> None:
    calls: list[str] = []
    card = FakeCard(calls)
    instances = FakeInstances(calls)
    discovery = ModelCardDiscovery(instances, lambda: card)
    await discovery.register()
    card.fail = True
    with pytest.raises(DiscoveryUnavailable):
        await discovery.unregister()
    assert discovery.registered and "store down" in (discovery.registration_error or "")
    assert instances.registered  # the instances were not touched: still routable
    card.fail = False
    await discovery.unregister()  # unknown: tried again
    assert not discovery.registered and discovery.registration_error is None


async def test_a_card_call_that_hangs_is_bounded() -> None:
    class Hanging(FakeCard):
        async def unregister(self) -> None:
            await asyncio.sleep(10)

    calls: list[str] = []
    discovery = ModelCardDiscovery(FakeInstances(calls), lambda: Hanging(calls),
                                   rpc_timeout_s=0.05)
    discovery.served(card=True)
    with pytest.raises(DiscoveryUnavailable):
        await discovery.unregister()
    assert "timed out" in (discovery.registration_error or "")
