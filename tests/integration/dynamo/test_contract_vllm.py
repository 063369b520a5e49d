"""Contract: the worker kinds ``quiesce dynamo vllm`` refuses are the ones the installed
ai-dynamo's real ``dynamo.vllm`` (1.6.1) serves through code its hooks do not reach, read
from the fields the refusal reads; and the prefill chunk is what
:func:`~quiesce.adapters.dynamo.outcomes.vllm_prefill_outcome` reads.

Evidence level: Dynamo's real module source (read with ``ast``: tests/integration/dynamo/
dynamo_source.py, nothing of ``dynamo.vllm`` imported in this process) and, for the last
test, the real worker parsing its real arguments in a child process (the tiny model on
the CPU). The refusal with a fake Dynamo is tests/unit/test_dynamo_components_vllm.py;
that the hooks install on the real ``dynamo.vllm`` is
tests/integration/dynamo/test_contract_trtllm.py::test_the_vllm_component_installs_on_the_real_dynamo_vllm.
Runs in .venv-dynamo.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from quiesce.adapters.dynamo.vllm_component import MODE, OTHER_WORKERS, VllmComponent
from quiesce.admission import AdmissionGate
from tests.integration.dynamo.dynamo_source import (
    awaited,
    calls_of,
    class_def,
    function,
    imported_from,
    module_level_names,
    parse,
    yields,
)
from tests.integration.dynamo.processes import dynamo_env

MAIN = "dynamo.vllm.main"
FACTORY = "dynamo.vllm.worker_factory"


def _config_fields_tested(func: ast.AST) -> set[str]:
    """Attributes ``X`` read as ``config.X`` in the ``if`` tests of ``func``."""
    return {sub.attr for node in ast.walk(func) if isinstance(node, ast.If)
            for sub in ast.walk(node.test)
            if isinstance(sub, ast.Attribute) and ast.unparse(sub.value) == "config"}


def _modes_compared(func: ast.AST) -> set[str]:
    """Members ``M`` of ``DisaggregationMode.M`` that ``config.disaggregation_mode`` is
    compared with in the ``if`` tests of ``func``."""
    return {sub.attr for node in ast.walk(func) if isinstance(node, ast.If)
            for sub in ast.walk(node.test) if isinstance(sub, ast.Attribute)
            and ast.unparse(sub.value) == "DisaggregationMode"}


def _keys(display: ast.Dict) -> dict[str, str]:
    """A dict literal's constant keys and the source text of their values."""
    return {k.value: ast.unparse(v) for k, v in zip(display.keys, display.values,
                                                    strict=True)
            if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def test_each_hooked_name_of_main_is_looked_up_by_the_worker_at_call_time() -> None:
    tree = parse(MAIN)
    worker = function(tree, "worker")
    used = {n.id for n in ast.walk(worker) if isinstance(n, ast.Name)}
    for hook in VllmComponent(AdmissionGate()).hooks():
        assert hook.module == MAIN
        assert hook.name in module_level_names(tree), f"{MAIN} has no {hook.name}"
        assert hook.name in used, f"{MAIN}.worker does not use {hook.name}"


def test_the_worker_awaits_the_parse_first_and_reads_the_config_it_returns() -> None:
    tree = parse(MAIN)
    worker = function(tree, "worker")
    (call,) = calls_of(worker, "parse_args_with_model_fetch")
    assert awaited(worker, call)
    assign = next(n for n in ast.walk(worker) if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Await) and n.value.value is call)
    assert [ast.unparse(t) for t in assign.targets] == ["config"]
    assert imported_from(tree, "parse_args_with_model_fetch") == "args"
    assert isinstance(function(parse("dynamo.vllm.args"), "parse_args_with_model_fetch"),
                      ast.AsyncFunctionDef)


def test_the_worker_kinds_refused_are_exactly_those_sent_elsewhere() -> None:
    """``WorkerFactory.create`` dispatches on these config fields before the LLM worker
    (``_create_decode_worker``/``_create_prefill_worker``), and ``main.worker`` returns
    early for ``headless``: a new kind fails this test."""
    create = function(class_def(parse(FACTORY), "WorkerFactory"), "create")
    fields = _config_fields_tested(create)
    assert fields == {"realtime", "embedding_worker", "classify_worker", MODE}
    assert _modes_compared(create) == {"ENCODE", "PREFILL"}
    assert "headless" in _config_fields_tested(function(parse(MAIN), "worker"))
    assert calls_of(function(parse(MAIN), "worker"), "run_dynamo_headless")
    assert set(OTHER_WORKERS) == fields - {MODE} | {"headless"}
    called = {ast.unparse(c.func) for c in ast.walk(create) if isinstance(c, ast.Call)}
    assert {"self._create_decode_worker", "self._create_prefill_worker",
            "self._create_multimodal_encode_worker"} <= called


def test_the_fields_read_are_dynamos_config_fields() -> None:
    """Each field the refusal reads is declared on ``DynamoVllmConfig`` (what ``Config``
    inherits), and ``DisaggregationMode.ENCODE`` is the member named ``encode``."""
    config = class_def(parse("dynamo.vllm.backend_args"), "DynamoVllmConfig")
    declared = {n.target.id for n in config.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {*OTHER_WORKERS, MODE} <= declared
    assert "DynamoVllmConfig" in [ast.unparse(b) for b in
                                  class_def(parse("dynamo.vllm.args"), "Config").bases]
    from dynamo.common.constants import DisaggregationMode  # type: ignore[import-not-found, unused-ignore]

    assert {m.name.lower() for m in DisaggregationMode} == {"aggregated", "prefill",
                                                           "decode", "encode"}


def test_the_encode_worker_registers_without_the_hooked_registration() -> None:
    """Why the encode worker cannot just run: it registers its card with
    ``register_model`` (not the hooked ``register_vllm_model``) and builds no engine, so
    the component would read it idle ("never served") while it serves."""
    encode = function(class_def(parse(FACTORY), "WorkerFactory"),
                      "_create_multimodal_encode_worker")
    assert calls_of(encode, "register_model")
    assert not [c for c in ast.walk(encode) if isinstance(c, ast.Call)
                and ast.unparse(c.func) in ("self.register_vllm_model",
                                            "self.setup_vllm_engine")]


@pytest.mark.parametrize("kind,named", [
    (["--disaggregation-mode", "encode"], "--disaggregation-mode encode"),
    (["--realtime"], "--realtime"),
])
def test_the_real_worker_refuses_a_kind_before_it_serves(tiny_model: Path, tmp_path: Path,
                                                         kind: list[str], named: str) -> None:
    """``quiesce dynamo vllm`` on the real ``dynamo.vllm``: exit 2 naming the kind, no
    ``ready`` line (no engine, no card)."""
    store = tmp_path / "store"
    store.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "quiesce", "dynamo", "vllm", "--admin-port", "0", "--",
         "--model", str(tiny_model), "--discovery-backend", "file", "--enforce-eager",
         "--max-model-len", "512", "--dtype", "float32", *kind],
        capture_output=True, text=True, timeout=300, check=False, env=dynamo_env(store))
    assert done.returncode == 2, done.stderr[-3000:]
    (refusal,) = [line for line in done.stderr.splitlines()
                  if line.startswith("quiesce dynamo vllm: args: ")] or [done.stderr[-3000:]]
    assert named in refusal and '"event": "ready"' not in done.stdout, refusal


def test_a_prefill_chunk_carries_its_token_and_kv_parameters_without_a_finish_reason(
        ) -> None:
    """What :func:`~quiesce.adapters.dynamo.outcomes.vllm_prefill_outcome` reads: the
    prefill handler caps the request at one token (``max_tokens`` = ``min_tokens`` = 1),
    so a prefill the engine ran has that token, an aborted one has none; each chunk
    carries ``token_ids`` and ``disaggregated_params`` (``kv_transfer_params`` inside,
    from ``_build_disaggregated_params``) and never a finish reason."""
    handler = class_def(parse("dynamo.vllm.handlers"), "PrefillWorkerHandler")
    token_mode = function(handler, "_generate_token_mode")
    assert [ast.unparse(y) for y in yields(token_mode) if y is not None] == ["output"]
    (chunk,) = [_keys(n.value) for n in ast.walk(token_mode) if isinstance(n, ast.AnnAssign)
                and ast.unparse(n.target) == "output" and isinstance(n.value, ast.Dict)]
    assert {"token_ids", "disaggregated_params"} <= set(chunk)
    assert "finish_reason" not in chunk and chunk["token_ids"] == "list(token_ids)"
    (caps,) = [_keys(d) for d in ast.walk(token_mode)
               if isinstance(d, ast.Dict) and "max_tokens" in _keys(d)]
    assert (caps["max_tokens"], caps["min_tokens"]) == ("1", "1")
    build = function(handler, "_build_disaggregated_params")
    assert any(isinstance(n, ast.Subscript) and ast.unparse(n) ==
               "disaggregated_params['kv_transfer_params']" for n in ast.walk(build))
    assert calls_of(function(handler, "generate"), "_translate_vllm_client_errors")
