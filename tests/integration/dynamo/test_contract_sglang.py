"""Contract: what ``quiesce dynamo sglang`` hooks is in the installed ai-dynamo's real
``dynamo.sglang`` (1.6.1), with the signatures and call sites the hooks rely on.

Evidence level: Dynamo's real module source, engine absent. ``dynamo.sglang.main`` does
not import without SGLang, so its files are read with ``ast`` (tests/integration/dynamo/
dynamo_source.py); what imports without SGLang (the shutdown helper, ``dynamo.llm``) is
imported and inspected. The hooks' behaviour with the engine faked is
tests/unit/test_dynamo_components_sglang.py; the real worker with the real engine is
tests/gpu/test_dynamo_components.py (GPU, not run here). Runs in .venv-dynamo.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys

import pytest

from quiesce.adapters.dynamo.component import CARD_ENDPOINT
from quiesce.adapters.dynamo.sglang_component import (
    OTHER_WORKERS,
    SglangComponent,
    role_of_worker_type,
)
from quiesce.admission import AdmissionGate
from quiesce.errors import ConfigError
from quiesce.probe import Role
from tests.integration.dynamo.dynamo_source import (
    arg_name,
    attribute_calls,
    awaited,
    calls_of,
    class_def,
    decorators,
    dict_displays,
    dict_literal,
    dynamo_args_flags,
    function,
    imported_from,
    keywords,
    module_level_names,
    parameters,
    parse,
    yields,
)

HOOKS = [(h.module, h.name) for h in SglangComponent(AdmissionGate()).hooks()]
CALLERS = {
    ("dynamo.sglang.main", "parse_args"): ["worker"],
    ("dynamo.sglang.main", "install_graceful_shutdown"): ["worker"],
    ("dynamo.sglang.init_llm", "register_model_with_readiness_gate"): ["init_decode",
                                                                       "init_prefill"],
    ("dynamo.sglang.register", "register_model"): ["_register_model_with_runtime_config"],
    ("dynamo.sglang.init_llm", "serve_via_gateway_children"): ["init_decode", "init_prefill"],
}
"""Each hooked name, and the functions of its module that call it by its bare name."""


def test_the_table_covers_every_hook() -> None:
    assert sorted(CALLERS) == sorted(HOOKS)


@pytest.mark.parametrize("module,name", HOOKS, ids=str)
def test_each_hooked_name_is_a_module_global_its_callers_look_up_at_call_time(
        module: str, name: str) -> None:
    """Replacing ``module.name`` reaches Dynamo only if its callers look the name up in
    that module's globals when they call it (a bare name), as these do."""
    tree = parse(module)
    assert name in module_level_names(tree), f"{module} has no module-level {name}"
    for caller in CALLERS[(module, name)]:
        assert calls_of(function(tree, caller), name), f"{module}.{caller} calls no {name}"


def test_the_worker_awaits_parse_args_and_keeps_what_the_shutdown_helper_returns() -> None:
    worker = function(parse("dynamo.sglang.main"), "worker")
    (parse_call,) = calls_of(worker, "parse_args")
    assert awaited(worker, parse_call)
    assert isinstance(function(parse("dynamo.sglang.args"), "parse_args"),
                      ast.AsyncFunctionDef)
    (helper_call,) = calls_of(worker, "install_graceful_shutdown")
    assert [arg_name(helper_call, i) for i in range(4)] == [
        "loop", "runtime", "shutdown_endpoints", "shutdown_event"]
    assert imported_from(parse("dynamo.sglang.main"), "install_graceful_shutdown") \
        == "dynamo.sglang.shutdown"


def test_the_recorder_takes_the_real_helpers_parameters() -> None:
    from dynamo.sglang.shutdown import install_graceful_shutdown  # type: ignore[import-not-found, unused-ignore]

    real = inspect.signature(install_graceful_shutdown).parameters
    ours = inspect.signature(SglangComponent(AdmissionGate())._record_graceful).parameters
    assert [(p.name, p.kind) for p in real.values()] == \
        [(p.name, p.kind) for p in ours.values()]


def test_the_registration_hands_over_the_engine_the_endpoint_and_the_worker_type() -> None:
    """The readiness hook reads ``engine`` (first argument) and ``worker_type`` (keyword);
    the card hook reads the endpoint as ``register_model``'s third argument."""
    init_llm = parse("dynamo.sglang.init_llm")
    for caller in ("init_decode", "init_prefill"):
        (call,) = calls_of(function(init_llm, caller), "register_model_with_readiness_gate")
        assert (arg_name(call, 0), arg_name(call, 1)) == ("engine", "generate_endpoint")
        assert "worker_type" in keywords(call)
    register = parse("dynamo.sglang.register")
    positional, keyword_only = parameters(function(register,
                                                   "register_model_with_readiness_gate"))
    assert positional[0] == "engine" and "worker_type" in keyword_only
    (call,) = calls_of(function(register, "_register_model_with_runtime_config"),
                       "register_model")
    at, keyword = CARD_ENDPOINT
    assert arg_name(call, at) == "endpoint"
    assert imported_from(register, "register_model") == "dynamo.llm"
    from dynamo.llm import register_model  # type: ignore[import-not-found, unused-ignore]

    assert list(inspect.signature(register_model).parameters)[at] == keyword


def test_the_worker_kinds_refused_are_exactly_those_main_sends_elsewhere() -> None:
    """``main.worker`` dispatches on these ``config.dynamo_args`` flags before falling
    through to ``init_decode``/``init_prefill``: a new kind fails this test."""
    worker = function(parse("dynamo.sglang.main"), "worker")
    assert dynamo_args_flags(worker) - {"dump_config_to"} == set(OTHER_WORKERS)
    assert calls_of(worker, "init_decode") and calls_of(worker, "init_prefill")


@pytest.mark.parametrize("cls,module", [
    ("DecodeWorkerHandler", "dynamo.sglang.request_handlers.llm.decode_handler"),
    ("PrefillWorkerHandler", "dynamo.sglang.request_handlers.llm.prefill_handler")])
def test_each_gated_handler_serves_an_async_generator_of_request_and_context(
        cls: str, module: str) -> None:
    """Pull path (no push-egress decorator): :func:`gated` sees every chunk."""
    generate = function(class_def(parse(module), cls), "generate")
    assert isinstance(generate, ast.AsyncFunctionDef) and list(yields(generate))
    assert parameters(generate)[0] == ["self", "request", "context"]
    assert decorators(generate) == []
    assert cls in dict_literal(parse("dynamo.sglang.request_handlers"), "_EXPORTS")
    init_llm = parse("dynamo.sglang.init_llm")
    assert calls_of(init_llm, cls), f"init_llm builds no {cls}"
    served = [c for c in attribute_calls(init_llm, "serve_endpoint")
              if arg_name(c, 0) == "handler.generate"]
    assert len(served) == 2  # init_decode and init_prefill


def test_the_prefill_outcome_is_what_consume_results_returns_not_the_bootstrap_chunk(
        ) -> None:
    """The prefill handler yields its bootstrap chunk (no finish reason) *before* the
    prefill runs, then awaits ``self._consume_results(results, submitted_request_id,
    context)``, which returns the final ``meta_info`` or None: what the component's
    ``EngineEnd`` wraps (the context is its last argument) and
    :func:`~quiesce.adapters.dynamo.outcomes.sglang_final_outcome` reads."""
    handler = class_def(parse("dynamo.sglang.request_handlers.llm.prefill_handler"),
                        "PrefillWorkerHandler")
    generate = function(handler, "generate")
    (bootstrap,) = [y for y in yields(generate) if isinstance(y, ast.Dict) and any(
        isinstance(k, ast.Constant) and k.value == "disaggregated_params" for k in y.keys)]
    (handoff,) = [d for d in dict_displays(generate) if "disaggregated_params" in d]
    assert handoff["finish_reason"] == "None"
    (call,) = attribute_calls(generate, "_consume_results")
    assert ast.unparse(call.func) == "self._consume_results"
    assert [ast.unparse(a) for a in call.args] == ["results", "submitted_request_id", "context"]
    assert bootstrap.lineno < call.lineno  # handed over before the prefill ran
    (component_end,) = [h.engine_end for h in SglangComponent(AdmissionGate()).handlers()
                        if h.engine_end is not None]
    consume = function(handler, component_end.method)
    assert isinstance(consume, ast.AsyncFunctionDef)
    assert parameters(consume)[0] == ["self", "results", "submitted_request_id", "context"]
    returned = {ast.unparse(r.value) for r in ast.walk(consume)
                if isinstance(r, ast.Return) and r.value is not None}
    assert returned == {"None", "final_meta_info"}


def test_dynamos_worker_types_name_the_roles_the_probe_takes() -> None:
    from dynamo.llm import WorkerType  # type: ignore[import-not-found, unused-ignore]
    from dynamo.llm.exceptions import WorkerUnavailable  # type: ignore[import-not-found, unused-ignore]

    assert [role_of_worker_type(WorkerType.Aggregated), role_of_worker_type(WorkerType.Prefill),
            role_of_worker_type(WorkerType.Decode)] == [Role.AGGREGATED, Role.PREFILL,
                                                        Role.DECODE]
    assert role_of_worker_type(WorkerType.Encode) is None  # UNKNOWN, never guessed
    assert issubclass(WorkerUnavailable, Exception)


def test_without_sglang_install_is_a_config_error_and_the_cli_exits_2() -> None:
    """The real ``dynamo.sglang.main`` here, without SGLang: refused with what to install."""
    with pytest.raises(ConfigError) as info:
        SglangComponent(AdmissionGate()).install()
    assert "sglang" in str(info.value) and "ai-dynamo[sglang]" in str(info.value)
    done = subprocess.run([sys.executable, "-m", "quiesce", "dynamo", "sglang", "--",
                           "--model-path", "m"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("quiesce dynamo sglang: ")
    assert "dynamo.sglang cannot be imported (No module named 'sglang')" in done.stderr

