"""``SglangProbe`` end to end through SGLang's real main-process and scheduler code.

The path of one read: the real ``TokenizerManager.get_internal_state`` → a real
``FanOutCommunicator`` → (the ZMQ hop, in-process here) → each DP rank's real
``Scheduler.get_internal_state`` with quiesce's hook applied by SGLang's ``HookRegistry``
→ the real ``is_fully_idle`` → back through ``handle_recv``; ANDed with the real
TokenizerManager's ``rid_to_state`` and SGLang's real shared-memory load snapshot.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.sglang import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

from sglang.srt.managers.load_snapshot import (
    DisaggregationMetrics,
    LoadSnapshot,
    QueueMetrics,
    ShmLoadSnapshotReader,
    ShmLoadSnapshotWriter,
)

from quiesce.adapters.sglang import SglangProbe, probe_factory
from quiesce.errors import ConfigError
from quiesce.probe import Role, Verdict, observe
from quiesce.registry import probe_for
from tests.integration.sglang import shells

pytestmark = pytest.mark.usefixtures("hooked")


def probe(tm: Any, role: Role, **options: Any) -> SglangProbe:
    return SglangProbe(tm, role, **options)


async def test_idle_prefill_pair_of_dp_ranks_is_quiescent() -> None:
    tm = shells.tokenizer_manager([shells.scheduler("prefill"), shells.scheduler("prefill")])
    work = await probe(tm, Role.PREFILL).pending_work()
    assert work.verdict is Verdict.QUIESCENT, work.summary()
    assert work.details["sglang.scheduler.dp_ranks"] == 2


async def test_kv_in_flight_on_one_dp_rank_is_busy() -> None:
    busy = shells.scheduler("prefill")
    busy.disagg_prefill_inflight_queue.append(shells.req())
    tm = shells.tokenizer_manager([shells.scheduler("prefill"), busy])
    work = await probe(tm, Role.PREFILL).pending_work()
    assert work.verdict is Verdict.BUSY and work.kv_sends_held == 1


async def test_a_request_only_the_tokenizer_manager_knows_is_busy() -> None:
    tm = shells.tokenizer_manager([shells.scheduler("decode")])
    tm.rid_to_state["on-its-way"] = object()  # sent, not yet received by the scheduler
    work = await probe(tm, Role.DECODE).pending_work()
    assert work.verdict is Verdict.BUSY and work.queues["tokenizer_requests"] == 1


async def test_decode_deferred_release_only_the_scheduler_sees_is_busy() -> None:
    s = shells.scheduler("decode")
    shells.defer_release(s)
    tm = shells.tokenizer_manager([s])  # rid_to_state empty: the request already ended
    work = await probe(tm, Role.DECODE).pending_work()
    assert work.verdict is Verdict.BUSY
    main_only = await probe(tm, Role.DECODE, scheduler=False).pending_work()
    assert main_only.queues["tokenizer_requests"] == 0  # the weaker signal misses it


async def test_a_short_rank_list_is_unknown() -> None:
    tm = shells.tokenizer_manager([shells.scheduler("null")], dp_size=2)
    work = await probe(tm, Role.AGGREGATED).pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("DP rank(s) [1] did not answer" in r for r in work.reasons)


async def test_without_the_hook_the_answer_lacks_the_state_and_is_unknown() -> None:
    import inspect

    from sglang.srt.managers.scheduler import Scheduler

    s = shells.scheduler("null")
    # SGLang's own method without any hook (an Engine started earlier in this process ran
    # load_plugins(), which hooked the class too)
    s.get_internal_state = inspect.unwrap(Scheduler.get_internal_state).__get__(s)
    work = await probe(shells.tokenizer_manager([s]), Role.AGGREGATED).pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("plugin is not loaded" in r for r in work.reasons)


async def test_a_scheduler_that_does_not_answer_is_unknown_and_not_cancelled() -> None:
    tm = shells.tokenizer_manager([shells.scheduler("null")])
    comm = tm.get_internal_state_communicator
    sent: list[Any] = []
    real_send = comm._send
    comm._send = sent.append  # the request goes nowhere: a hung (or long-stepping) scheduler
    p = probe(tm, Role.AGGREGATED, scheduler_timeout_s=0.05)
    work = await p.pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("did not answer get_internal_state within 0.05s" in r for r in work.reasons)
    # the second read joins the call in flight instead of sending another
    work = await p.pending_work()
    assert work.verdict is Verdict.UNKNOWN and len(sent) == 1
    # the scheduler answers at last: the next read gets it (it postdates that read)
    real_send(sent[0])
    await asyncio.sleep(0.01)
    comm._send = real_send
    assert (await p.pending_work()).verdict is Verdict.QUIESCENT


async def test_with_the_load_snapshot_every_signal_must_agree(tmp_path: Path) -> None:
    path = tmp_path / "loads.shm"
    writer = ShmLoadSnapshotWriter(str(path), 1, 0)
    try:
        writer.write(LoadSnapshot(
            timestamp=time.time(), dp_rank=0, num_waiting_reqs=1,
            disaggregation=DisaggregationMetrics(mode="prefill"),
            queues=QueueMetrics(waiting=1, grammar=0, paused=0, retracted=0,
                                prealloc_ready=0)))
        tm = shells.tokenizer_manager([shells.scheduler("prefill")],
                                      reader=ShmLoadSnapshotReader(str(path), 1))
        p = probe(tm, Role.PREFILL)
        assert "sglang.load_snapshot" in p.source
        work = await p.pending_work()
        assert work.verdict is Verdict.BUSY and work.waiting == 1  # the snapshot disagrees
        assert p.main_process_work().verdict is Verdict.BUSY
    finally:
        writer.close()


async def test_snapshot_required_but_absent_is_unknown() -> None:
    tm = shells.tokenizer_manager([shells.scheduler("null")])
    work = await probe(tm, Role.AGGREGATED, snapshot=True).pending_work()
    assert work.verdict is Verdict.UNKNOWN


async def test_an_untested_version_is_unknown_unless_allowed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from quiesce.adapters.sglang import probe as probe_module

    monkeypatch.setattr(probe_module, "installed_sglang_version", lambda: "0.6.0")
    tm = shells.tokenizer_manager([shells.scheduler("null")])
    work = await probe(tm, Role.AGGREGATED).pending_work()
    assert work.verdict is Verdict.UNKNOWN and any("0.6.0" in r for r in work.reasons)
    allowed = probe(tm, Role.AGGREGATED, allow_untested_version=True)
    assert await allowed.is_quiescent() is True


async def test_registry_and_engine_forms() -> None:
    tm = shells.tokenizer_manager([shells.scheduler("decode")])
    engine = type("Engine", (), {"tokenizer_manager": tm})()
    p = probe_for("sglang", engine, role="decode")
    assert isinstance(p, SglangProbe) and p.tokenizer_manager is tm
    assert (await observe(p)).verdict is Verdict.QUIESCENT
    assert isinstance(probe_factory(tm, role=Role.DECODE), SglangProbe)


@pytest.mark.parametrize("bad", [{"scheduler_timeout_s": 0}, {"snapshot_max_age_s": -1.0},
                                 {"scheduler_timeout_s": True}])
def test_bad_options_raise_config_error(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        SglangProbe(shells.tokenizer_manager([]), Role.AGGREGATED, **bad)
    with pytest.raises(ConfigError, match="role"):
        SglangProbe(shells.tokenizer_manager([]), "sideways")
