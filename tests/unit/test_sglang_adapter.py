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
from quiesce.adapters.sglang.idle_fingerprint import TESTED_IDLE_FINGERPRINTS
from quiesce.adapters.sglang.plugin import HOOK_TARGET, register_hook
from quiesce.adapters.sglang.scheduler_rpc import states_work
from quiesce.adapters.sglang.scheduler_state import (
    SCHEMA,
    STATE_KEY,
    add_state_to_internal_state,
)
from quiesce.adapters.sglang.serving import SglangServing, sampling_params
from quiesce.adapters.sglang.topology import dp_ranks_of, topology_problem
from quiesce.errors import ConfigError, RequestAborted, RequestRejected
from quiesce.generation import Sampling


def state(dp: int = 0, **overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"schema": SCHEMA, "is_fully_idle": True, "mode": "null",
                            "counts": {"waiting": 0, "running": 0, "chunked": 0, "grammar": 0},
                            "uncovered": {"deferred_inputs": 0}, "engine_paused": False,
                            "rank": {"dp": dp, "pp": 0, "pp_size": 1, "tp": 0},
                            "idle_fingerprint": TESTED_IDLE_FINGERPRINTS["0.5.23"],
                            "answered_at": 1.0}
    return {**base, **overrides}


def test_import_needs_no_sglang_and_the_factory_names_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_probe, "installed_sglang_version", lambda: None)
    with pytest.raises(EngineNotInstalled, match=r"quiesce\[sglang\]"):
        probe_factory(object())


def test_states_work_ands_every_rank() -> None:
    answers = [{STATE_KEY: state(0)}, {STATE_KEY: state(1, is_fully_idle=False)}]
    work = states_work(answers, Role.AGGREGATED, expected_ranks=2)
    assert work.verdict is Verdict.BUSY and work.engine_has_work is True
    idle = [{STATE_KEY: state(1)}, {STATE_KEY: state(0)}]  # any order
    assert states_work(idle, Role.AGGREGATED, expected_ranks=2).verdict is Verdict.QUIESCENT


def test_answers_are_keyed_by_rank() -> None:
    doubled = [{STATE_KEY: state(0)}, {STATE_KEY: state(0, answered_at=2.0)}]
    work = states_work(doubled, Role.AGGREGATED, expected_ranks=2)
    assert work.verdict is Verdict.UNKNOWN and "DP rank(s) [1] did not answer" in work.reasons[0]
    # a rank answering twice with all present counts once, with its latest answer
    three = [*doubled, {STATE_KEY: state(1)}]
    work = states_work(three, Role.AGGREGATED, expected_ranks=2)
    assert work.verdict is Verdict.QUIESCENT and work.details["dp_ranks"] == 2
    stray = [{STATE_KEY: state(5)}]
    assert "names DP rank 5" in states_work(stray, Role.AGGREGATED,
                                            expected_ranks=1).reasons[0]


def test_layout_is_resolved_dp_times_attention_dp_and_pp_blinds_disaggregation() -> None:
    tm = types.SimpleNamespace(server_args=types.SimpleNamespace(dp_size=1, attn_dp_size=4))
    assert dp_ranks_of(tm) == 4
    assert dp_ranks_of(types.SimpleNamespace(server_args=types.SimpleNamespace(dp_size=3))) == 3
    assert dp_ranks_of(types.SimpleNamespace(server_args=None)) is None
    pp = types.SimpleNamespace(server_args=types.SimpleNamespace(dp_size=1, pp_size=2))
    assert topology_problem(pp, Role.AGGREGATED) is None
    for role in (Role.PREFILL, Role.DECODE):
        assert "pipeline parallelism (pp_size=2)" in str(topology_problem(pp, role))
    staged = state(mode="prefill", rank={"dp": 0, "pp": 0, "pp_size": 2, "tp": 0})
    work = states_work([{STATE_KEY: staged}], Role.PREFILL, expected_ranks=1)
    assert work.verdict is Verdict.UNKNOWN and "only pipeline stage 0" in work.reasons[0]


@pytest.mark.parametrize(("answer", "reason"), [
    ({}, "plugin is not loaded"),
    ({STATE_KEY: state(schema=SCHEMA + 1)}, "schema"),
    ({STATE_KEY: {"schema": SCHEMA, "error": "StateDrift: x"}}, "could not read"),
    ({STATE_KEY: state(is_fully_idle="yes")}, "malformed"),
    ({STATE_KEY: state(answered_at=0.5)}, "predates"),
    ({STATE_KEY: state(idle_fingerprint="0" * 16)}, "not one this adapter was tested"),
    ({STATE_KEY: state(rank=None)}, "no pipeline size"),
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


async def test_prefill_abort_all_without_readable_state_counts_only_requests(
        caplog: pytest.LogCaptureFixture) -> None:
    manager = FakeTokenizerManager([])  # no get_internal_state: the plugin's state unreadable
    manager.rid_to_state.update(a=1)
    control = SglangEngineControl(types.SimpleNamespace(tokenizer_manager=manager), "prefill",
                                  abort_settle_s=0.01)
    assert await control.abort_all("budget") == 1 and control.abandoned == 0
    assert "unaccounted" in caplog.text
    with pytest.raises(ConfigError, match="abort_settle_s"):
        SglangEngineControl(object(), abort_settle_s=0)
