"""TensorRT-LLM serving and control, against a FAKE ``tensorrt_llm`` module.

TensorRT-LLM cannot be installed here (no reachable wheel; it needs CUDA to import), so
a stand-in module with ``LLM``, ``SamplingParams``, ``DisaggregatedParams`` and
``CacheTransceiverConfig`` is put in ``sys.modules``: it mirrors only the LLM API
surface the adapter calls (``generate_async`` streaming ``RequestOutput``s with cumulative
``text``/``token_ids`` and a ``finish_reason``, ``abort()``, ``_executor._results``). The
tests prove the adapter's mapping of request outcomes (completed / lost / rejected /
client gone, through the real OpenAI face and admission gate), parameters passed
through, ``abort_all`` and the signal-handler check. The real engine is covered by
tests/gpu/test_trtllm.py (ci/gpu/trtllm.sh on an H200).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import importlib.machinery
import json
import os
import signal
import sys
import threading
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

import httpx
import pytest

from quiesce.adapters.trtllm import TrtllmEngineControl
from quiesce.adapters.trtllm.probe import InProcessProbe
from quiesce.adapters.trtllm.serving import (
    OPAQUE_KEY,
    TrtllmServing,
    disaggregated_kwargs,
    restore_signal_handlers,
    transfer_params_out,
)
from quiesce.admission import AdmissionGate
from quiesce.errors import ConfigError, EngineNotInstalled, RequestRejected
from quiesce.generation import Sampling
from quiesce.probe import Role, Verdict, observe
from quiesce.serve.openai_api import create_completions_app


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    disaggregated_params: Any = None


@dataclasses.dataclass
class Output:
    outputs: list[Completion]
    prompt_token_ids: list[int]


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("top_k", 0) > 1024:  # a limit of the engine, not of the API
            raise ValueError("top_k larger than the sampler supports")
        self.kwargs = kwargs


class DisaggregatedParams:
    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


class Result:
    """One request's ``RequestOutput``: scripted by its prompt."""

    def __init__(self, llm: FakeLLM, request_id: int, prompt: str, params: Any,
                 disagg: Any) -> None:
        self.llm, self.request_id, self.prompt = llm, request_id, prompt
        self.params, self.disagg = params, disagg
        self.aborted = False
        llm._executor._results[request_id] = self

    def abort(self) -> None:
        self.aborted = True
        self.llm.aborted.append(self.request_id)

    def __aiter__(self) -> AsyncIterator[Output]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[Output]:
        try:
            if self.prompt == "cancelled":
                yield Output([Completion("", [], "cancelled")], [1])
                return
            if self.prompt == "hang":
                yield Output([Completion(" a", [5])], [1])
                await asyncio.Event().wait()
            # Like TensorRT-LLM (GenerationResult._handle_sequence): a context-only request
            # ends NOT_FINISHED, reported as 'not_finished'; "not_finished" scripts that
            # reason on a request that is not context-only (the engine never should).
            context_only = getattr(self.disagg, "request_type", None) == "context_only"
            last_reason = "not_finished" if context_only or self.prompt == "not_finished" \
                else "length"
            for n in range(1, 4):
                if self.prompt == "fails" and n == 2:
                    raise RuntimeError("Executor worker returned error")  # RequestError-like
                handle = DisaggregatedParams(request_type="context_only", ctx_request_id=7,
                                             opaque_state=b"\x00kv", first_gen_tokens=[5])
                yield Output([Completion(" t" * n, list(range(n)),
                                         last_reason if n == 3 else None,
                                         handle if n == 3 else None)], [1, 2])
        finally:
            self.llm._executor._results.pop(self.request_id, None)


class FakeLLM:
    built: ClassVar[list[FakeLLM]] = []

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.model, self.kwargs = model, kwargs
        self.args = types.SimpleNamespace(max_seq_len=kwargs.get("max_seq_len", 64))
        self._executor = type("GenerationExecutorWorker", (), {})()
        self._executor.engine = types.SimpleNamespace(
            active_requests=[], waiting_queue=[], is_shutdown=False,
            executor_request_queue=types.SimpleNamespace(get_request_queue_size=lambda: 0),
            async_transfer_manager=types.SimpleNamespace(requests_in_transfer=dict))
        self._executor._results = {}
        self.tokenizer = types.SimpleNamespace(encode=lambda text: text.split())
        self.aborted: list[int] = []
        self.submitted: list[Result] = []
        self.shut_down = False
        FakeLLM.built.append(self)

    def generate_async(self, prompt: Any, sampling_params: Any, streaming: bool,
                       disaggregated_params: Any = None) -> Result:
        assert streaming
        if prompt == "too long":
            raise ValueError("prompt length exceeds max_num_tokens")
        if prompt == "dead":
            raise RuntimeError("executor is shut down")
        result = Result(self, len(self.submitted), prompt, sampling_params,
                        disaggregated_params)
        self.submitted.append(result)
        return result

    def shutdown(self) -> None:
        self.shut_down = True


@pytest.fixture
def fake_trtllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A stand-in ``tensorrt_llm`` (and the submodules the adapter imports)."""
    root = types.ModuleType("tensorrt_llm")
    root.__spec__ = importlib.machinery.ModuleSpec("tensorrt_llm", None)
    root.LLM = FakeLLM  # type: ignore[attr-defined]
    root.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.CacheTransceiverConfig = lambda **kw: ("transceiver", kw)  # type: ignore[attr-defined]
    disagg = types.ModuleType("tensorrt_llm.disaggregated_params")
    disagg.DisaggregatedParams = DisaggregatedParams  # type: ignore[attr-defined]
    for module in (root, llmapi, disagg):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.delenv("TLLM_WORKER_USE_SINGLE_PROCESS", raising=False)
    FakeLLM.built.clear()
    yield root


async def started(role: Role = Role.AGGREGATED, **kwargs: Any) -> TrtllmServing:
    serving = TrtllmServing("/models/tiny", role, **kwargs)
    await serving.start()
    return serving


async def test_start_builds_the_single_process_layout(fake_trtllm: types.ModuleType) -> None:
    serving = await started(Role.PREFILL, max_model_len=32, gpu_memory_fraction=0.3,
                            kv_cache_config={"enable_block_reuse": False})
    llm = FakeLLM.built[-1]
    assert os.environ["TLLM_WORKER_USE_SINGLE_PROCESS"] == "1"
    assert llm.kwargs == {"disable_overlap_scheduler": True, "max_seq_len": 32,
                          "kv_cache_config": {"enable_block_reuse": False,
                                              "free_gpu_memory_fraction": 0.3},
                          "cache_transceiver_config": ("transceiver", {"backend": "DEFAULT"})}
    assert isinstance(serving.probe, InProcessProbe)
    assert serving.model_names == ("tiny", "/models/tiny")
    assert (await observe(serving.probe)).verdict is Verdict.QUIESCENT


async def test_start_without_tensorrt_llm_names_the_extra() -> None:
    with pytest.raises(EngineNotInstalled, match=r"quiesce\[trtllm\]"):
        await TrtllmServing("/models/tiny").start()


def test_bad_configuration_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="max_model_len"):
        TrtllmServing("/m", max_model_len=0)
    with pytest.raises(ConfigError, match="cache_transceiver_config"):
        TrtllmServing("/m", cache_transceiver_config="NIXL")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        TrtllmServing("/m", gpu_memory_fraction=1.5)


async def test_signal_handlers_replaced_at_import_are_put_back(
        fake_trtllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    ours = signal.getsignal(signal.SIGTERM)

    class Importing(types.ModuleType):
        @property
        def LLM(self) -> type[FakeLLM]:
            signal.signal(signal.SIGTERM, lambda *a: None)  # an engine's own handler
            return FakeLLM

    module = Importing("tensorrt_llm")
    module.__spec__ = fake_trtllm.__spec__
    module.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt_llm", module)
    try:
        await started()
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, ours)


def test_restore_reports_what_changed() -> None:
    ours = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert restore_signal_handlers({signal.SIGINT: ours}) == ["SIGINT"]
        assert signal.getsignal(signal.SIGINT) is ours
        assert restore_signal_handlers({signal.SIGINT: ours}) == []
    finally:
        signal.signal(signal.SIGINT, ours)


# -- request outcomes through the real OpenAI face and admission gate --------------------

class Face:
    def __init__(self, serving: TrtllmServing) -> None:
        self.gate = AdmissionGate()
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_completions_app(serving, self.gate)),
            base_url="http://test", timeout=30)

    async def events(self, prompt: str, **body: Any) -> list[Any]:
        """Every event of a stream, to its end (a 200 may hold an error event)."""
        answer = await self.client.post("/v1/completions", json={
            "model": "tiny", "prompt": prompt, "stream": True, "max_tokens": 3, **body})
        return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
                for line in answer.text.splitlines() if line.startswith("data: ")]


async def test_outcomes_map_onto_completed_lost_and_rejected(
        fake_trtllm: types.ModuleType) -> None:
    face = Face(await started())
    done = await face.events("hello")
    assert done[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in done[:-1] if e.get("choices")) == " t t t"
    for prompt in ("cancelled", "fails", "dead", "not_finished"):
        events = await face.events(prompt)
        assert events[-1]["error"]["outcome"] == "lost", (prompt, events)
    events = await face.events("too long")
    assert events[-1]["error"]["outcome"] == "rejected"
    answer = await face.client.post("/v1/completions", json={
        "model": "tiny", "prompt": "hello", "top_k": 5000})
    assert answer.status_code == 400
    outcomes = face.gate.outcomes()
    assert (outcomes.completed, outcomes.lost, outcomes.rejected) == (1, 4, 2)
    await face.client.aclose()


async def test_a_client_that_leaves_aborts_its_request(fake_trtllm: types.ModuleType) -> None:
    serving = await started()
    deltas = serving.stream("hang", Sampling(max_tokens=3), "r1", {})
    first = await deltas.__anext__()
    assert first.text == " a" and first.tokens == 1
    await deltas.aclose()  # type: ignore[attr-defined]
    assert FakeLLM.built[-1].aborted == [0]


async def test_a_request_that_ended_is_not_aborted(fake_trtllm: types.ModuleType) -> None:
    serving = await started()
    pieces = [d async for d in serving.stream("hello", Sampling(max_tokens=3), "r1", {})]
    assert [p.tokens for p in pieces] == [1, 1, 1]
    assert pieces[-1].prompt_tokens == 2 and pieces[-1].finish_reason == "length"
    assert FakeLLM.built[-1].aborted == []


async def test_max_tokens_over_the_context_is_rejected_at_once(
        fake_trtllm: types.ModuleType) -> None:
    serving = await started(max_model_len=8)
    with pytest.raises(RequestRejected, match="context length"):
        serving.stream("hello", Sampling(max_tokens=9), "r1", {})
    deltas = serving.stream("one two three", Sampling(max_tokens=None), "r2", {})
    await deltas.__anext__()
    assert FakeLLM.built[-1].submitted[-1].params.kwargs["max_tokens"] == 5  # 8 - 3
    await deltas.aclose()  # type: ignore[attr-defined]


# -- disaggregated parameters passed through ---------------------------------------------

async def test_prefill_hands_the_decoder_its_params(fake_trtllm: types.ModuleType) -> None:
    serving = await started(Role.PREFILL)
    pieces = [d async for d in serving.stream("hello", Sampling(max_tokens=3), "r1", {})]
    submitted = FakeLLM.built[-1].submitted[-1]
    assert submitted.disagg.request_type == "context_only"
    assert submitted.params.kwargs["max_tokens"] == 1  # asked for 3: prefill only
    assert pieces[-1].finish_reason == "length"  # the engine said 'not_finished'
    handle = pieces[-1].kv_transfer_params
    assert handle == {"request_type": "generation_only", "first_gen_tokens": [5],
                      "ctx_request_id": 7, OPAQUE_KEY: base64.b64encode(b"\x00kv").decode()}
    json.dumps(handle)  # travels in the OpenAI answer
    assert disaggregated_kwargs(handle, Role.DECODE) == {
        "request_type": "generation_only", "first_gen_tokens": [5], "ctx_request_id": 7,
        "opaque_state": b"\x00kv"}


async def test_a_prefill_request_is_completed_not_lost(fake_trtllm: types.ModuleType) -> None:
    """FAKE engine ending the context-only request with 'not_finished' as TensorRT-LLM
    does; tests/gpu/test_trtllm.py's context/generation pair covers the real one."""
    face = Face(await started(Role.PREFILL))
    answer = await face.client.post("/v1/completions", json={
        "model": "tiny", "prompt": "hello", "max_tokens": 3})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["kv_transfer_params"]["request_type"] == "generation_only"
    outcomes = face.gate.outcomes()
    assert (outcomes.completed, outcomes.lost) == (1, 0)
    await face.client.aclose()


def test_disaggregated_params_are_checked() -> None:
    assert disaggregated_kwargs({}, Role.AGGREGATED) is None
    assert disaggregated_kwargs({}, Role.PREFILL) == {"request_type": "context_only"}
    with pytest.raises(RequestRejected, match="unknown field"):
        disaggregated_kwargs({"do_remote_decode": True}, Role.PREFILL)
    with pytest.raises(RequestRejected, match="not base64"):
        disaggregated_kwargs({OPAQUE_KEY: "***"}, Role.DECODE)
    with pytest.raises(RequestRejected, match="request_type"):
        disaggregated_kwargs({"request_type": "both"}, Role.DECODE)
    assert transfer_params_out(None) is None


# -- control -----------------------------------------------------------------------------

async def test_abort_all_aborts_every_unfinished_request(fake_trtllm: types.ModuleType) -> None:
    llm = FakeLLM("/m")
    for prompt in ("a", "b"):
        llm.generate_async(prompt, None, streaming=True)
    plain = types.SimpleNamespace()  # a result without abort(): the executor aborts it
    llm._executor._results[9] = plain
    llm._executor.abort_request = llm.aborted.append
    assert await TrtllmEngineControl(llm).abort_all("budget") == 3
    assert sorted(llm.aborted) == [0, 1, 9]


async def test_abort_all_retries_a_map_that_changes_and_fails_on_drift() -> None:
    class Changing(dict[int, Any]):
        tries = 0

        def items(self) -> Any:
            Changing.tries += 1
            if Changing.tries == 1:
                raise RuntimeError("dictionary changed size during iteration")
            return super().items()

    executor = type("GenerationExecutorWorker", (), {})()
    executor._results = Changing({1: types.SimpleNamespace(abort=lambda: None)})
    assert await TrtllmEngineControl(types.SimpleNamespace(_executor=executor)).abort_all(
        "x") == 1
    del executor._results
    with pytest.raises(LookupError, match="_results"):
        await TrtllmEngineControl(types.SimpleNamespace(_executor=executor)).abort_all("x")


async def test_abort_all_runs_off_the_event_loop_and_counts_abandoned_kv(
        fake_trtllm: types.ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    """FAKE: ``abort()`` blocks like a Ray ``ray.get``; the single-process executor holds two
    context requests in KV transfer. tests/gpu/test_trtllm.py covers the real engine."""
    llm = FakeLLM("/m")
    llm._executor.engine.async_transfer_manager = types.SimpleNamespace(
        requests_in_transfer=lambda: {1: "ctx", 2: "ctx"})
    loop_thread = threading.get_ident()
    threads: list[int] = []

    class Blocking:
        def abort(self) -> None:
            threads.append(threading.get_ident())

    llm._executor._results.update({10: Blocking(), 11: Blocking()})
    with caplog.at_level("WARNING", logger="quiesce.adapters.trtllm.control"):
        assert await TrtllmEngineControl(llm).abort_all("budget") == 4  # 2 aborted + 2 held
    assert len(threads) == 2 and loop_thread not in threads
    assert "abandoning KV of 2 context request(s)" in caplog.text


async def test_abort_all_stops_at_the_callers_deadline() -> None:
    release = threading.Event()
    done: list[int] = []

    class Hung:
        def __init__(self, n: int) -> None:
            self.n = n

        def abort(self) -> None:
            release.wait(5)
            done.append(self.n)

    executor = type("GenerationExecutorProxy", (), {})()
    executor._results = {n: Hung(n) for n in range(3)}
    control = TrtllmEngineControl(types.SimpleNamespace(_executor=executor))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(control.abort_all("x"), 0.05)
    release.set()
    for _ in range(100):
        await asyncio.sleep(0.01)
    assert done == [0]  # the loop noticed the deadline after the abort in progress


async def test_shutdown_runs_the_llms_own(fake_trtllm: types.ModuleType) -> None:
    serving = await started()
    await serving.control.shutdown()
    assert FakeLLM.built[-1].shut_down


def test_nothing_before_start() -> None:
    serving = TrtllmServing("/m")
    with pytest.raises(RuntimeError, match="start"):
        serving.probe  # noqa: B018
    with pytest.raises(RuntimeError, match="start"):
        serving.control  # noqa: B018

