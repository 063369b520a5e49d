"""The vLLM probe's decision logic, against a fake AsyncLLM.

The fake only stands in for what this machine's core environment lacks (vLLM lives in
its own virtual environment); the real engine is covered by
tests/integration/vllm/test_vllm_probe.py on the CPU and tests/gpu/test_vllm.py on an H200.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from quiesce import EngineNotInstalled, Role, Verdict
from quiesce.adapters.vllm import VllmProbe, probe_factory
from quiesce.adapters.vllm import probe as vllm_probe
from quiesce.adapters.vllm.plugin import register
from quiesce.adapters.vllm.utilities import quiesce_snapshot


def snapshot(**overrides: Any) -> dict[str, Any]:
    base = {"version": 1, "waiting": 0, "running": 0, "kv_sends_held": 0,
            "kv_recvs_awaited": 0, "connector_push_work": 0, "unflushed_finished": 0,
            "has_work": False}
    return {**base, **overrides}


class FakeClient:
    """A fake EngineCore client: answers utility calls from a script."""

    def __init__(self, answers: dict[str, Any], dp: int = 1) -> None:
        self.answers = answers
        self.dp = dp
        self.calls: list[str] = []

    async def call_utility_all_async(self, method: str) -> list[Any]:
        self.calls.append(method)
        answer = self.answers.get(method)
        if isinstance(answer, Exception):
            raise answer
        if answer is None:
            raise Exception(f"'EngineCoreProc' object has no attribute '{method}'")
        return list(answer)


def fake_engine(client: Any, unfinished: int = 0, dp: int = 1) -> Any:
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
        data_parallel_size_local=dp, data_parallel_size=dp))
    frontend = types.SimpleNamespace(get_num_unfinished_requests=lambda: unfinished)
    return types.SimpleNamespace(engine_core=client, output_processor=frontend,
                                 vllm_config=config)


@pytest.fixture(autouse=True)
def tested_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_probe, "installed_vllm_version", lambda: "0.32.0")


async def test_snapshot_counts_are_summed_over_dp_engines() -> None:
    client = FakeClient({"quiesce_snapshot": [snapshot(kv_sends_held=2, has_work=True),
                                              snapshot(running=1, has_work=True)]})
    work = await VllmProbe(fake_engine(client, dp=2), Role.PREFILL).pending_work()
    assert work.verdict is Verdict.BUSY
    assert (work.kv_sends_held, work.running) == (2, 1)
    client.answers["quiesce_snapshot"] = [snapshot(), snapshot()]
    assert (await VllmProbe(fake_engine(client, dp=2), Role.PREFILL).pending_work()).is_quiescent


async def test_missing_dp_answers_are_unknown() -> None:
    client = FakeClient({"quiesce_snapshot": [snapshot()]})
    work = await VllmProbe(fake_engine(client, dp=2), Role.PREFILL).pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("1 of 2 DP engines" in r for r in work.reasons)


async def test_unreadable_dp_size_is_unknown() -> None:
    client = FakeClient({"quiesce_snapshot": [snapshot()]})
    engine = fake_engine(client)
    engine.vllm_config = None
    work = await VllmProbe(engine, Role.PREFILL).pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("number of DP engines" in r for r in work.reasons)


async def test_frontend_request_not_yet_at_the_engine_is_busy() -> None:
    client = FakeClient({"quiesce_snapshot": [snapshot()]})
    work = await VllmProbe(fake_engine(client, unfinished=1), Role.PREFILL).pending_work()
    assert work.verdict is Verdict.BUSY
    assert work.queues["frontend_unfinished"] == 1


async def test_falls_back_to_has_work_without_the_plugin_and_stays_there() -> None:
    client = FakeClient({"has_work": [False]})
    probe = VllmProbe(fake_engine(client), Role.PREFILL)
    work = await probe.pending_work()
    assert work.is_quiescent
    assert work.details["vllm.engine_core.signal"] == "has_work"
    client.answers["has_work"] = [True]
    work = await probe.pending_work()
    assert work.verdict is Verdict.BUSY
    assert client.calls == ["quiesce_snapshot", "has_work", "has_work"]


async def test_required_plugin_missing_is_unknown() -> None:
    client = FakeClient({"has_work": [False]})
    work = await VllmProbe(fake_engine(client), Role.PREFILL, detailed=True).pending_work()
    assert work.verdict is Verdict.UNKNOWN


async def test_shutdown_rejection_is_unknown_with_advice() -> None:
    client = FakeClient({"quiesce_snapshot": Exception("Server shutting down")})
    work = await VllmProbe(fake_engine(client), Role.PREFILL).pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("read the probe before" in r for r in work.reasons)


@pytest.mark.parametrize("answer", [[{"version": 1, "error": "AttributeError: x"}],
                                    [{"version": 1}], ["yes"]])
async def test_failed_or_malformed_snapshots_are_unknown(answer: list[Any]) -> None:
    client = FakeClient({"quiesce_snapshot": answer})
    assert (await VllmProbe(fake_engine(client), Role.PREFILL).pending_work()
            ).verdict is Verdict.UNKNOWN


async def test_has_work_that_is_not_boolean_is_unknown() -> None:
    client = FakeClient({"has_work": [1]})
    work = await VllmProbe(fake_engine(client), Role.AGGREGATED, detailed=False).pending_work()
    assert work.verdict is Verdict.UNKNOWN


async def test_untested_version_fails_closed_unless_allowed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_probe, "installed_vllm_version", lambda: "0.99.1")
    client = FakeClient({"quiesce_snapshot": [snapshot()]})
    work = await VllmProbe(fake_engine(client), Role.PREFILL).pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("outside the versions" in r for r in work.reasons)
    allowed = VllmProbe(fake_engine(client), Role.PREFILL, allow_untested_version=True)
    assert (await allowed.pending_work()).is_quiescent
    busy = FakeClient({"quiesce_snapshot": [snapshot(running=2, has_work=True)]})
    assert (await VllmProbe(fake_engine(busy), Role.PREFILL).pending_work()
            ).verdict is Verdict.BUSY


def test_factory_without_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_probe, "installed_vllm_version", lambda: None)
    with pytest.raises(EngineNotInstalled, match=r"quiesce\[vllm\]"):
        probe_factory(object())


def test_plugin_snapshot_reports_drift_instead_of_raising() -> None:
    answer = quiesce_snapshot(types.SimpleNamespace())
    assert "error" in answer
    register()  # without vLLM installed: a no-op, never an error


class FakeClient031:
    """vLLM 0.31's ``DPLBAsyncMPClient`` shape: no ``call_utility_all_async``; its
    ``call_utility_async`` asks every engine but answers for the first only; the
    per-engine ``_call_utility_async(method, *args, engine=...)`` and ``core_engines``."""

    def __init__(self, answers: dict[bytes, dict[str, Any]]) -> None:
        self.answers = answers
        self.core_engines = list(answers)
        self.calls: list[tuple[str, bytes]] = []

    async def _call_utility_async(self, method: str, *args: Any, engine: bytes) -> Any:
        self.calls.append((method, engine))
        answer = self.answers[engine].get(method)
        if answer is None:
            raise Exception(f"'EngineCoreProc' object has no attribute '{method}'")
        return answer

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        answers = [await self._call_utility_async(method, *args, engine=e)
                   for e in self.core_engines]
        return answers[0]


async def test_without_call_utility_all_every_dp_engine_is_asked() -> None:
    """0.31: KV held on the second engine only; engine 0 alone would say idle."""
    client = FakeClient031({b"\x00\x00": {"quiesce_snapshot": snapshot()},
                            b"\x01\x00": {"quiesce_snapshot": snapshot(kv_sends_held=1)}})
    probe = VllmProbe(fake_engine(client, dp=2), Role.PREFILL, board=False)
    work = await probe.pending_work()
    assert work.verdict is Verdict.BUSY, work.summary()
    assert work.kv_sends_held == 1
    assert work.details["vllm.engine_core.dp_engines"] == 2
    assert sorted(engine for _, engine in client.calls) == [b"\x00\x00", b"\x01\x00"]
    assert (await client.call_utility_async("quiesce_snapshot"))["kv_sends_held"] == 0


async def test_without_call_utility_all_a_short_engine_list_stays_unknown() -> None:
    client = FakeClient031({b"\x00\x00": {"quiesce_snapshot": snapshot()}})
    work = await VllmProbe(fake_engine(client, dp=2), Role.PREFILL,
                           board=False).pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("1 of 2 DP engines" in r for r in work.reasons), work.reasons


async def test_a_dp_client_that_cannot_fan_out_is_unknown() -> None:
    class Client:
        async def call_utility_async(self, method: str, *args: Any) -> Any:
            return snapshot()

    work = await VllmProbe(fake_engine(Client(), dp=2), Role.PREFILL,
                           board=False).pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("cannot call a utility on every DP engine" in r for r in work.reasons)
