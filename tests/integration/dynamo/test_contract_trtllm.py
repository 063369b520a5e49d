"""Contract: what ``quiesce dynamo trtllm`` hooks is in the installed ai-dynamo's real
``dynamo.trtllm`` (1.6.1), with the signatures and call sites the hooks rely on.

Evidence level: Dynamo's real module source, engine absent (TensorRT-LLM cannot be
installed here). ``dynamo.trtllm.main`` does not import without TensorRT-LLM, so its files
are read with ``ast`` (tests/integration/dynamo/dynamo_source.py); what imports without
it (Dynamo's graceful-shutdown helper, ``dynamo.trtllm.constants``, ``dynamo.llm``) is
imported and inspected. The hooks' behaviour with the engine faked is
tests/unit/test_dynamo_components_trtllm.py; the real worker with the real engine is
tests/gpu/test_dynamo_components.py (GPU, not run here). Runs in .venv-dynamo.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from quiesce.adapters.dynamo.component import CARD_ENDPOINT, DynamoComponent
from quiesce.adapters.dynamo.gated import finish_outcome
from quiesce.adapters.dynamo.gated_push import gated_push
from quiesce.adapters.dynamo.trtllm_component import LLM_MODALITIES, ROLES, TrtllmComponent
from quiesce.admission import AdmissionGate
from quiesce.errors import ConfigError
from tests.integration.dynamo.dynamo_source import (
    Function,
    arg_name,
    awaited,
    calls_of,
    class_def,
    decorators,
    function,
    imported_from,
    module_level_names,
    parameters,
    parse,
)

COMPONENT = TrtllmComponent(AdmissionGate())
HOOKS = [(h.module, h.name) for h in COMPONENT.hooks()]
CALLERS = {
    ("dynamo.trtllm.main", "parse_args"): ["worker"],
    ("dynamo.trtllm.main", "install_signal_handlers"): ["worker"],
    ("dynamo.trtllm.workers.llm_worker", "get_llm_engine"): ["init_llm_worker"],
    ("dynamo.trtllm.workers.llm_worker", "register_model"): ["init_llm_worker"],
}
"""Each hooked name, and the functions of its module that call it by its bare name."""


def test_the_table_covers_every_hook() -> None:
    assert sorted(CALLERS) == sorted(HOOKS)


@pytest.mark.parametrize("module,name", HOOKS, ids=str)
def test_each_hooked_name_is_a_module_global_its_callers_look_up_at_call_time(
        module: str, name: str) -> None:
    tree = parse(module)
    assert name in module_level_names(tree), f"{module} has no module-level {name}"
    for caller in CALLERS[(module, name)]:
        assert calls_of(function(tree, caller), name), f"{module}.{caller} calls no {name}"


def test_parse_args_is_called_not_awaited_and_returns_the_fields_checked() -> None:
    main = parse("dynamo.trtllm.main")
    worker = function(main, "worker")
    (call,) = calls_of(worker, "parse_args")
    assert not awaited(worker, call)
    assert imported_from(main, "parse_args") == "dynamo.trtllm.args"
    assert isinstance(function(parse("dynamo.trtllm.args"), "parse_args"), ast.FunctionDef)
    config = class_def(parse("dynamo.trtllm.args"), "Config")
    assert "DynamoTrtllmConfig" in [ast.unparse(b) for b in config.bases]
    base = class_def(parse("dynamo.trtllm.backend_args"), "DynamoTrtllmConfig")
    fields = {n.target.id: ast.unparse(n.annotation) for n in ast.walk(base)
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert fields["modality"] == "Modality"
    assert fields["disaggregation_mode"] == "DisaggregationMode"


def test_the_recorder_takes_dynamos_helper_parameters_and_main_passes_them() -> None:
    """``main.install_signal_handlers`` is Dynamo's common helper (also dynamo.vllm's)."""
    from dynamo.common.utils.graceful_shutdown import install_signal_handlers  # type: ignore[import-not-found, unused-ignore]

    real = inspect.signature(install_signal_handlers).parameters
    ours = inspect.signature(COMPONENT.record_shutdown).parameters
    assert [(p.name, p.kind) for p in real.values()] == \
        [(p.name, p.kind) for p in ours.values()]
    main = parse("dynamo.trtllm.main")
    assert imported_from(main, "install_signal_handlers") == \
        "dynamo.common.utils.graceful_shutdown"
    (call,) = calls_of(function(main, "worker"), "install_signal_handlers")
    assert [arg_name(call, i) for i in range(4)] == [
        "loop", "runtime", "shutdown_endpoints", "shutdown_event"]


def test_the_engine_hook_wraps_dynamos_async_context_manager() -> None:
    """``get_llm_engine(engine_args, disaggregation_mode, component_gauges)`` is an
    ``asynccontextmanager`` yielding a ``TensorRTLLMEngine`` with ``llm`` (raises until
    initialized), ``_llm`` and ``disaggregation_mode``; ``init_llm_worker`` enters it."""
    worker = parse("dynamo.trtllm.workers.llm_worker")
    assert imported_from(worker, "get_llm_engine") == "dynamo.trtllm.engine"
    (call,) = calls_of(function(worker, "init_llm_worker"), "get_llm_engine")
    assert (arg_name(call, 0), arg_name(call, 1)) == ("engine_args",
                                                      "config.disaggregation_mode")
    entered = [n for n in ast.walk(function(worker, "init_llm_worker"))
               if isinstance(n, ast.AsyncWith) and n.items[0].context_expr is call]
    assert len(entered) == 1
    engine = parse("dynamo.trtllm.engine")
    get = function(engine, "get_llm_engine")
    assert decorators(get) == ["asynccontextmanager"]
    assert parameters(get)[0] == ["engine_args", "disaggregation_mode", "component_gauges"]
    cls = class_def(engine, "TensorRTLLMEngine")
    llm = function(cls, "llm")
    assert decorators(llm) == ["property"]
    assert any(isinstance(n, ast.Raise) for n in ast.walk(llm))
    assigned = {ast.unparse(t) for n in ast.walk(function(cls, "__init__"))
                if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])}
    assert {"self._llm", "self.disaggregation_mode"} <= assigned


def test_the_model_card_call_passes_the_endpoint_where_the_hook_reads_it() -> None:
    worker = parse("dynamo.trtllm.workers.llm_worker")
    assert imported_from(worker, "register_model") == "dynamo.llm"
    (call,) = calls_of(function(worker, "init_llm_worker"), "register_model")
    at, keyword = CARD_ENDPOINT
    assert arg_name(call, at) == "endpoint"
    assert awaited(function(worker, "init_llm_worker"), call)
    from dynamo.llm import register_model  # type: ignore[import-not-found, unused-ignore]

    assert list(inspect.signature(register_model).parameters)[at] == keyword


def _dispatch() -> Function:
    push = function(parse("dynamo.trtllm.request_handlers.push_egress"), "push_egress_capable")
    return function(push, "dispatch")


def _params(func: Function) -> list[str]:
    args = func.args
    return ([a.arg for a in args.posonlyargs + args.args]
            + ([f"*{args.vararg.arg}"] if args.vararg else [])
            + [a.arg for a in args.kwonlyargs]
            + ([f"**{args.kwarg.arg}"] if args.kwarg else []))


@pytest.mark.parametrize("module,cls", [
    ("dynamo.trtllm.request_handlers.aggregated_handler", "AggregatedHandler"),
    ("dynamo.trtllm.request_handlers.handlers", "PrefillHandler"),
    ("dynamo.trtllm.request_handlers.handlers", "DecodeHandler")])
def test_each_gated_handler_is_a_push_egress_dispatcher(module: str, cls: str) -> None:
    """The component gates these with ``push=True``: each ``generate`` is decorated with
    ``push_egress_capable`` (outermost), and its dispatcher takes what
    :func:`gated_push`'s wrapper takes, so the runtime's signature probe still finds
    ``response_sender``."""
    assert (module, cls) in {(h.module, h.cls) for h in COMPONENT.handlers() if h.push}
    generate = function(class_def(parse(module), cls), "generate")
    assert decorators(generate)[0] == "push_egress_capable"
    assert parameters(generate)[0] == ["self", "request", "context"]

    async def stand_in(self: Any, request: Any, context: Any = None,
                       response_sender: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
        yield request

    wrapped = gated_push(stand_in, AdmissionGate(), outcome=finish_outcome)
    ours = [("**" if p.kind is p.VAR_KEYWORD else "") + p.name
            for p in inspect.signature(wrapped, follow_wrapped=False).parameters.values()]
    assert ours == _params(_dispatch())
    deletes = [n for n in ast.walk(function(parse(
        "dynamo.trtllm.request_handlers.push_egress"), "push_egress_capable"))
        if isinstance(n, ast.Delete)]
    assert [ast.unparse(t) for d in deletes for t in d.targets] == ["dispatch.__wrapped__"]


def test_the_handler_factory_serves_the_gated_classes_per_mode() -> None:
    factory = class_def(parse("dynamo.trtllm.request_handlers.handlers"),
                        "RequestHandlerFactory")
    (table,) = [n.value for n in ast.walk(function(factory, "__init__"))
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)]
    served = {ast.unparse(k).strip("'\""): ast.unparse(v)
              for k, v in zip(table.keys, table.values, strict=True) if k is not None}
    assert served == {"prefill": "PrefillHandler", "decode": "DecodeHandler",
                      "encode": "EncodeHandler", "prefill_and_decode": "AggregatedHandler"}
    assert set(served) - {"encode"} == set(ROLES)  # encode is refused at parse time


def test_the_modes_and_modalities_accepted_are_dynamos_llm_worker() -> None:
    from dynamo.trtllm.constants import DisaggregationMode, Modality  # type: ignore[import-not-found, unused-ignore]

    assert {m.value for m in DisaggregationMode} == set(ROLES) | {"encode"}
    assert {m.value for m in Modality if Modality.is_llm(m)} == set(LLM_MODALITIES)
    assert not any(Modality.is_diffusion(m) for m in Modality if m.value in LLM_MODALITIES)


def test_without_tensorrt_llm_install_is_a_config_error_and_the_cli_exits_2() -> None:
    """The real ``dynamo.trtllm.main`` here, without TensorRT-LLM: refused with what to
    install."""
    with pytest.raises(ConfigError) as info:
        TrtllmComponent(AdmissionGate()).install()
    assert "tensorrt_llm" in str(info.value) and "ai-dynamo[trtllm]" in str(info.value)
    done = subprocess.run([sys.executable, "-m", "quiesce", "dynamo", "trtllm", "--",
                           "--model-path", "m"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("quiesce dynamo trtllm: ")
    assert "dynamo.trtllm cannot be imported (No module named 'tensorrt_llm')" in done.stderr


def test_the_vllm_component_installs_on_the_real_dynamo_vllm() -> None:
    """The shared base, on the one engine present here: every hooked name of the real
    ``dynamo.vllm`` found and replaced (in a child process: the replacement is global)."""
    code = ("from quiesce.adapters.dynamo.components import VllmComponent\n"
            "from quiesce.admission import AdmissionGate\n"
            "import dynamo.vllm.main as m, dynamo.vllm.handlers as h\n"
            "originals = [m.parse_args_with_model_fetch, m.install_signal_handlers, "
            "m.setup_vllm_engine, m.register_vllm_model]\n"
            "VllmComponent(AdmissionGate()).install()\n"
            "now = [m.parse_args_with_model_fetch, m.install_signal_handlers, "
            "m.setup_vllm_engine, m.register_vllm_model]\n"
            "assert all(a is not b for a, b in zip(originals, now))\n"
            "assert h.DecodeWorkerHandler.generate.__quiesce_gated__\n"
            "assert h.PrefillWorkerHandler.generate.__quiesce_gated__\n"
            "print('installed')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0 and "installed" in done.stdout, done.stderr[-3000:]
    assert issubclass(TrtllmComponent, DynamoComponent)
