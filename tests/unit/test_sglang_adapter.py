"""The SGLang adapter's decision logic without SGLang (the core environment lacks it).

Fakes here stand in only for what this environment does not have: the same paths run
against SGLang's real code in tests/integration/sglang (its own virtual environment), and
against a real prefill/decode pair in tests/gpu/test_sglang.py on an H200.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest

from quiesce import EngineNotInstalled, Role, Verdict
from quiesce.adapters.sglang import SglangEngineControl, SglangProbe, probe_factory
from quiesce.adapters.sglang import probe as sglang_probe
from quiesce.adapters.sglang.frontend import snapshot_work
from quiesce.adapters.sglang.plugin import HOOK_TARGET, register_hook
from quiesce.adapters.sglang.scheduler_rpc import states_work
from quiesce.adapters.sglang.scheduler_state import STATE_KEY, add_state_to_internal_state
from quiesce.adapters.sglang.serving import SglangServing, sampling_params
from quiesce.errors import RequestAborted, RequestRejected
from quiesce.generation import Sampling


def state(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"schema": 1, "is_fully_idle": True, "mode": "null",
                            "counts": {"waiting": 0, "running": 0, "chunked": 0, "grammar": 0},
                            "uncovered": {"deferred_inputs": 0}, "engine_paused": False,
                            "answered_at": 1.0}
    return {**base, **overrides}


def test_import_needs_no_sglang_and_the_factory_names_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_probe, "installed_sglang_version", lambda: None)
    with pytest.raises(EngineNotInstalled, match=r"quiesce\[sglang\]"):
        probe_factory(object())


def test_states_work_ands_every_rank() -> None:
    answers = [{STATE_KEY: state()}, {STATE_KEY: state(is_fully_idle=False)}]
    work = states_work(answers, Role.AGGREGATED, expected_ranks=2)
    assert work.verdict is Verdict.BUSY and work.engine_has_work is True
    assert states_work(answers[:1] * 2, Role.AGGREGATED,
                       expected_ranks=2).verdict is Verdict.QUIESCENT


@pytest.mark.parametrize(("answer", "reason"), [
    ({}, "plugin is not loaded"),
    ({STATE_KEY: state(schema=2)}, "schema"),
    ({STATE_KEY: {"schema": 1, "error": "StateDrift: x"}}, "could not read"),
    ({STATE_KEY: state(is_fully_idle="yes")}, "malformed"),
    ({STATE_KEY: state(answered_at=0.5)}, "predates"),
    ("not a dict", "plugin is not loaded"),
])
def test_states_work_fails_closed(answer: Any, reason: str) -> None:
    work = states_work([answer], Role.AGGREGATED, expected_ranks=1, not_before=1.0)
    assert work.verdict is Verdict.UNKNOWN and reason in work.reasons[0]


def test_uncovered_queues_make_it_busy_even_when_sglang_says_idle() -> None:
    answer = {STATE_KEY: state(uncovered={"deferred_inputs": 2})}
    work = states_work([answer], Role.AGGREGATED, expected_ranks=1)
    assert work.verdict is Verdict.BUSY and work.queues["deferred_inputs"] == 2


def load(rank: int, *, mode: str = "null", stamp: float = 100.0, running: int = 0) -> Any:
    disagg = types.SimpleNamespace(mode=mode, prefill_inflight_queue_reqs=0,
                                   decode_prealloc_queue_reqs=0, decode_transfer_queue_reqs=0)
    return types.SimpleNamespace(dp_rank=rank, timestamp=stamp, num_running_reqs=running,
                                 num_waiting_reqs=0, disaggregation=disagg,
                                 queues=types.SimpleNamespace(grammar=0))


def test_snapshot_work_rules() -> None:
    ok = snapshot_work([load(0), load(1)], Role.AGGREGATED, expected_ranks=2, max_age_s=5,
                       now=101.0)
    assert ok.verdict is Verdict.QUIESCENT
    busy = snapshot_work([load(0, running=3)], Role.AGGREGATED, expected_ranks=1,
                         max_age_s=5, now=101.0)
    assert busy.verdict is Verdict.BUSY and busy.running == 3
    stale = snapshot_work([load(0)], Role.AGGREGATED, expected_ranks=1, max_age_s=5,
                          now=200.0)
    assert stale.verdict is Verdict.UNKNOWN and "stale" in stale.reasons[0]
    broken = snapshot_work([types.SimpleNamespace(dp_rank=0)], Role.AGGREGATED,
                           expected_ranks=1, max_age_s=5, now=101.0)
    assert broken.verdict is Verdict.UNKNOWN and "malformed" in broken.reasons[0]


class FakeRegistry:
    def __init__(self) -> None:
        self.hooks: list[tuple[str, Any, Any]] = []

    def register(self, target: str, hook: Any, hook_type: Any) -> None:
        self.hooks.append((target, hook, hook_type))


def test_register_hook_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from quiesce.adapters.sglang import plugin

    monkeypatch.setattr(plugin, "_registered", [])
    registry = FakeRegistry()
    kinds = types.SimpleNamespace(AFTER="after")
    assert register_hook(registry, kinds) is True
    assert register_hook(registry, kinds) is False
    assert registry.hooks == [(HOOK_TARGET, add_state_to_internal_state, "after")]


def test_the_hook_never_raises_into_sglang() -> None:
    output = types.SimpleNamespace(internal_state={})
    add_state_to_internal_state(output, object())  # a scheduler it cannot read
    assert "error" in output.internal_state[STATE_KEY]
    add_state_to_internal_state(types.SimpleNamespace(), object())  # no dict: left alone


class FakeTokenizerManager:
    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs
        self.rid_to_state: dict[str, Any] = {}
        self.server_args = types.SimpleNamespace(dp_size=1, tokenizer_worker_num=1)
        self.incremental_streaming_output = False
        self.aborted: list[Any] = []
        self.closed = False

    async def generate_request(self, obj: Any, request: Any) -> AsyncIterator[Any]:
        try:
            for out in self.outputs:
                if isinstance(out, BaseException):
                    raise out
                yield out
                await asyncio.sleep(0)
        finally:
            self.closed = True

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(abort_all)


def out(text: str, tokens: int, reason: Any = None) -> dict[str, Any]:
    return {"text": text, "meta_info": {"completion_tokens": tokens, "prompt_tokens": 3,
                                        "finish_reason": reason}}


def serving(outputs: list[Any]) -> tuple[SglangServing, FakeTokenizerManager]:
    manager = FakeTokenizerManager(outputs)
    s = SglangServing("/models/tiny")
    s.engine = types.SimpleNamespace(tokenizer_manager=manager)
    return s, manager


async def collect(s: SglangServing) -> list[Any]:
    return [d async for d in s._deltas(object(), "r1")]


async def test_cumulative_stream_becomes_deltas_and_completes() -> None:
    s, _ = serving([out("He", 1), out("Hello", 2), out("Hello!", 3, {"type": "length"})])
    deltas = await collect(s)
    assert [(d.text, d.tokens, d.finish_reason) for d in deltas] == [
        ("He", 1, None), ("llo", 1, None), ("!", 1, "length")]
    assert deltas[-1].prompt_tokens == 3


@pytest.mark.parametrize(("outputs", "error"), [
    ([out("", 0, {"type": "abort", "status_code": 400, "message": "too long"})],
     RequestRejected),
    ([out("a", 1), out("a", 1, {"type": "abort", "status_code": 400})], RequestAborted),
    ([out("", 0, {"type": "abort", "message": "Abort all"})], RequestAborted),
    ([out("", 0, {"type": "abort", "status_code": 500})], RequestAborted),
    ([ValueError("The input is longer than the context")], RequestRejected),
    ([out("a", 1), ValueError("late")], RequestAborted),
    ([RuntimeError("scheduler gone")], RequestAborted),
    ([out("a", 1)], RequestAborted),  # the stream ended without a finish reason
])
async def test_endings_map_to_outcomes(outputs: list[Any], error: type[Exception]) -> None:
    s, _ = serving(outputs)
    with pytest.raises(error):
        await collect(s)


async def test_a_closed_stream_closes_sglangs_generator() -> None:
    s, manager = serving([out("a", 1), out("ab", 2), out("abc", 3, {"type": "stop"})])
    stream = s._deltas(object(), "r1")
    await anext(stream)
    await stream.aclose()  # the client left
    assert manager.closed is True  # SGLang's generate_request saw it and aborts the rid


def test_sampling_names_and_bad_kv_params() -> None:
    params = sampling_params(Sampling(max_tokens=8, min_tokens=1, seed=7, temperature=0.0))
    assert params["max_new_tokens"] == 8 and params["min_new_tokens"] == 1
    assert params["sampling_seed"] == 7 and params["temperature"] == 0.0
    assert "max_tokens" not in params
    s = SglangServing("/models/tiny", "prefill", served_model_name="tiny", max_model_len=64)
    assert s.model_names == ("tiny", "/models/tiny")
    assert s.engine_kwargs()["disaggregation_mode"] == "prefill"
    assert s.engine_kwargs()["context_length"] == 64
    with pytest.raises(RuntimeError, match="start"):
        _ = s.probe


async def test_abort_all_counts_and_sends_one_abort() -> None:
    manager = FakeTokenizerManager([])
    control = SglangEngineControl(types.SimpleNamespace(tokenizer_manager=manager))
    assert await control.abort_all("budget") == 0 and manager.aborted == []
    manager.rid_to_state.update(a=1, b=2)
    assert await control.abort_all("budget") == 2 and manager.aborted == [True]


def test_rid_to_state_alone_never_proves_quiescence() -> None:
    manager = FakeTokenizerManager([])
    p = SglangProbe(manager, Role.AGGREGATED, scheduler=False, snapshot=False,
                    allow_untested_version=True)
    assert p.source == "sglang.rid_to_state"
    work = p.main_process_work()  # it counts requests, not the counters a role needs
    assert work.verdict is Verdict.UNKNOWN and "waiting, running" in work.reasons[0]
    manager.rid_to_state["r"] = object()
    assert p.main_process_work().verdict is Verdict.BUSY
