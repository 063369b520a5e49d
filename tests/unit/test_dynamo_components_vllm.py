"""``quiesce dynamo vllm``'s worker-kind refusal, against a FAKE ``dynamo.vllm``.

The tests here run quiesce's real :class:`VllmComponent` against fake modules that mirror
ai-dynamo 1.6.1's ``dynamo.vllm`` control flow as far as the refusal sees it
(tests/unit/dynamo_fakes.py): ``main.worker`` awaits ``parse_args_with_model_fetch``,
returns at once for ``--headless``, and ``WorkerFactory.create`` sends ``--realtime``,
``--embedding-worker``, ``--classify-worker`` and ``--disaggregation-mode encode`` to
handler classes no hook reaches (the encode worker registers with ``register_model`` and
builds no engine); the LLM worker builds its engine with ``setup_vllm_engine``. A fake,
not Dynamo, and no vLLM. That the real ``dynamo.vllm`` dispatches on exactly these
config fields is checked against the installed ai-dynamo by
tests/integration/dynamo/test_contract_vllm.py; the real worker with the real engine is
tests/integration/dynamo/test_vllm_worker.py (vLLM on the CPU, in .venv-dynamo) and
tests/gpu/test_dynamo_components.py::test_dynamo_vllm_drains_under_load (GPU).
"""

from __future__ import annotations

import asyncio
import enum
from types import SimpleNamespace
from typing import Any

import pytest

from quiesce.adapters.dynamo.vllm_component import VllmComponent, refuse_other_workers
from quiesce.admission import AdmissionGate
from quiesce.errors import ConfigError
from tests.unit.dynamo_fakes import FakeDynamo, FakeEngine, chunks_handler

KINDS = {"--realtime": "realtime", "--embedding-worker": "embedding_worker",
         "--classify-worker": "classify_worker", "--headless": "headless"}


class Mode(enum.Enum):
    """Stands in for ``dynamo.common.constants.DisaggregationMode`` (1.6.1 values)."""

    AGGREGATED = "agg"
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"


def config_of(argv: list[str]) -> SimpleNamespace:
    """What dynamo.vllm's parser makes of ``argv`` (the fields the refusal reads)."""
    mode = argv[argv.index("--disaggregation-mode") + 1] if "--disaggregation-mode" in argv \
        else "agg"
    return SimpleNamespace(disaggregation_mode=Mode(mode),
                           **{field: flag in argv for flag, field in KINDS.items()})


def fake_vllm(dynamo: FakeDynamo) -> None:
    """``dynamo.vllm`` 1.6.1's ``main.worker`` as far as the refusal sees it (module
    docstring); records ``("served", kind)`` when a worker kind starts serving."""
    engine = FakeEngine()

    async def parse_args_with_model_fetch(argv: list[str]) -> Any:
        return config_of(argv)

    def setup_vllm_engine(config: Any, *args: Any, **kwargs: Any) -> Any:
        dynamo.calls.append(("engine built", config))
        return engine, None, None, None, None

    async def register_vllm_model(*args: Any, **kwargs: Any) -> None:
        dynamo.calls.append(("register_vllm_model", args))

    async def worker(argv: list[str] | None = None) -> None:
        config = await main.parse_args_with_model_fetch(argv)
        if config.headless:
            dynamo.calls.append(("served", "headless"))
            return
        main.install_signal_handlers(asyncio.get_running_loop(), dynamo.runtime, [],
                                     asyncio.Event())
        for field in ("realtime", "embedding_worker", "classify_worker"):
            if getattr(config, field):
                dynamo.calls.append(("served", field))
                return
        if config.disaggregation_mode is Mode.ENCODE:
            dynamo.calls.append(("served", "encode"))
            return
        main.setup_vllm_engine(config)
        await main.register_vllm_model(None, None, dynamo.runtime.endpoint("d.b.generate"))
        dynamo.calls.append(("served", "llm"))

    main = dynamo.module(
        "dynamo.vllm.main", worker=worker,
        parse_args_with_model_fetch=parse_args_with_model_fetch,
        install_signal_handlers=dynamo.helper("dynamo's helper"),
        setup_vllm_engine=setup_vllm_engine, register_vllm_model=register_vllm_model)
    dynamo.module("dynamo.vllm.handlers", DecodeWorkerHandler=chunks_handler(),
                  PrefillWorkerHandler=chunks_handler())


@pytest.mark.parametrize("argv,named", [
    (["--realtime"], "--realtime"),
    (["--embedding-worker"], "--embedding-worker"),
    (["--classify-worker"], "--classify-worker"),
    (["--headless"], "--headless"),
    (["--disaggregation-mode", "encode"], "--disaggregation-mode encode"),
])
async def test_a_worker_kind_quiesce_does_not_wrap_is_refused_before_it_serves(
        monkeypatch: pytest.MonkeyPatch, argv: list[str], named: str) -> None:
    """Fake dynamo.vllm parsing a kind served by handler classes no hook reaches: refused
    (ConfigError: exit 2) naming it, before any engine or endpoint.
    Real source: tests/integration/dynamo/test_contract_vllm.py (the fields it dispatches
    on); real worker: tests/gpu/test_dynamo_components.py::test_dynamo_vllm_drains_under_load."""
    dynamo = FakeDynamo(monkeypatch)
    fake_vllm(dynamo)
    component = VllmComponent(AdmissionGate(accepting=False))
    component.install()
    with pytest.raises(ConfigError) as info:
        await component.run(["--model", "m", *argv])
    assert named in str(info.value) and info.value.field == "args"
    assert not [c for c in dynamo.calls if c[0] in ("served", "engine built")], dynamo.calls
    assert not component.serving


@pytest.mark.parametrize("mode", ["agg", "prefill", "decode"])
async def test_the_llm_worker_runs_in_each_role(monkeypatch: pytest.MonkeyPatch,
                                                mode: str) -> None:
    """Fake dynamo.vllm: the LLM worker goes past the parse to its engine and its card.
    Real: tests/integration/dynamo/test_vllm_worker.py (vLLM on the CPU, .venv-dynamo)."""
    dynamo = FakeDynamo(monkeypatch)
    fake_vllm(dynamo)
    component = VllmComponent(AdmissionGate(accepting=False))
    component.install()
    await component.run(["--model", "m", "--disaggregation-mode", mode])
    assert ("served", "llm") in dynamo.calls and component.serving
    assert not [c for c in dynamo.calls if c[0] == "dynamo's helper"]


def test_a_config_without_a_field_read_fails_closed() -> None:
    """A Dynamo whose parsed config lost a field the refusal reads cannot say which
    worker it runs: refused, naming the field."""
    config = config_of([])
    del config.classify_worker
    with pytest.raises(ConfigError) as info:
        refuse_other_workers(config)
    assert "classify_worker" in str(info.value) and info.value.field == "dynamo"
    refuse_other_workers(config_of(["--disaggregation-mode", "decode"]))  # the LLM worker
