"""The real ``Scheduler.is_fully_idle`` and quiesce's scheduler-side reader, per queue.

Each test sets one queue of a real scheduler (:mod:`.shells`) and checks three things:
SGLang's own ``is_fully_idle()`` (defaults), quiesce's :func:`read_scheduler_state`, and
the verdict the probe derives from it (:func:`states_work`). The health-check and
ignore-waiting variants are called too, to pin down why the adapter never uses them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.sglang import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

from sglang.srt.runtime_context import get_parallel

from quiesce.adapters.sglang import scheduler_state
from quiesce.adapters.sglang.scheduler_rpc import states_work
from quiesce.adapters.sglang.scheduler_state import (
    STATE_KEY,
    read_scheduler_state,
)
from quiesce.probe import Role, Verdict
from tests.integration.sglang import shells

ROLE = {"null": Role.AGGREGATED, "prefill": Role.PREFILL, "decode": Role.DECODE}


@pytest.fixture(autouse=True)
def one_pipeline_stage() -> Iterator[None]:
    # is_fully_idle reads the published parallel config (pp_size), the state its ranks; no
    # scheduler process published one here, so the test states it, as SGLang's own unit
    # tests do.
    with get_parallel().override(pp_size=1, pp_rank=0, tp_rank=0, dp_rank=None):
        yield


def verdict(s: Any, mode: str) -> Verdict:
    return states_work([{STATE_KEY: read_scheduler_state(s)}], ROLE[mode],
                       expected_ranks=1).verdict


@pytest.mark.parametrize("mode", ["null", "prefill", "decode"])
def test_empty_scheduler_is_quiescent(mode: str) -> None:
    s = shells.scheduler(mode)
    assert s.is_fully_idle() is True
    state = read_scheduler_state(s)
    assert state["is_fully_idle"] is True and state["mode"] == mode
    assert not any(state["counts"].values()) and not any(state["uncovered"].values())
    assert verdict(s, mode) is Verdict.QUIESCENT


@pytest.mark.parametrize("mode", ["null", "prefill", "decode"])
def test_waiting_request_is_busy(mode: str) -> None:
    s = shells.scheduler(mode)
    s.waiting_queue.append(shells.req())
    assert s.is_fully_idle() is False
    work = states_work([{STATE_KEY: read_scheduler_state(s)}], ROLE[mode], expected_ranks=1)
    assert work.verdict is Verdict.BUSY and work.waiting == 1
    # ignore_waiting (pause/flush) ignores a waiting request that holds no KV: never used
    assert s.is_fully_idle(ignore_waiting=True) is True


def test_running_batch_and_chunked_prefill_are_busy() -> None:
    s = shells.scheduler("null")
    s.running_batch.reqs.append(shells.req())
    assert s.is_fully_idle() is False and verdict(s, "null") is Verdict.BUSY
    s = shells.scheduler("null")
    s.chunked_req = shells.req()
    assert s.is_fully_idle() is False and verdict(s, "null") is Verdict.BUSY


def test_grammar_queue_is_busy_but_hidden_from_the_health_check_variant() -> None:
    s = shells.scheduler("null")
    s.grammar_manager.grammar_queue.append(shells.req())
    assert s.is_fully_idle() is False
    assert s.is_fully_idle(for_health_check=True) is True
    assert verdict(s, "null") is Verdict.BUSY


def test_prefill_bootstrap_queue_is_busy() -> None:
    s = shells.scheduler("prefill")
    s.disagg_prefill_bootstrap_queue.queue.append(shells.req())
    assert s.is_fully_idle() is False
    assert s.is_fully_idle(for_health_check=True) is True  # why it is never used
    work = states_work([{STATE_KEY: read_scheduler_state(s)}], Role.PREFILL, expected_ranks=1)
    assert work.verdict is Verdict.BUSY and work.waiting == 1


def test_prefill_inflight_kv_transfer_is_busy() -> None:
    s = shells.scheduler("prefill")
    s.disagg_prefill_inflight_queue.append(shells.req())
    assert s.is_fully_idle() is False
    # the health-check variant calls a prefill worker whose KV is still being pulled idle
    assert s.is_fully_idle(for_health_check=True) is True
    work = states_work([{STATE_KEY: read_scheduler_state(s)}], Role.PREFILL, expected_ranks=1)
    assert work.verdict is Verdict.BUSY and work.kv_sends_held == 1


@pytest.mark.parametrize("queue", ["prealloc", "transfer"])
def test_decode_waiting_for_kv_is_busy(queue: str) -> None:
    s = shells.scheduler("decode")
    if queue == "prealloc":
        s.disagg_decode_prealloc_queue.queue.append(shells.decode_req())
    else:
        s.disagg_decode_transfer_queue.add(shells.decode_req())  # SGLang's own add()
    assert s.is_fully_idle() is False
    assert s.is_fully_idle(for_health_check=True) is True  # why it is never used
    work = states_work([{STATE_KEY: read_scheduler_state(s)}], Role.DECODE, expected_ranks=1)
    assert work.verdict is Verdict.BUSY and work.kv_recvs_awaited == 1


def test_decode_retracted_queue_is_busy() -> None:
    s = shells.scheduler("decode")
    s.disagg_decode_prealloc_queue.retracted_queue.append(shells.req())
    assert s.is_fully_idle() is False
    work = states_work([{STATE_KEY: read_scheduler_state(s)}], Role.DECODE, expected_ranks=1)
    assert work.verdict is Verdict.BUSY and work.waiting == 1


def test_decode_deferred_kv_release_is_busy() -> None:
    s = shells.scheduler("decode")
    shells.defer_release(s)
    assert s.disagg_decode_transfer_queue.has_pending_deferred_releases() is True
    assert s.is_fully_idle() is False
    work = states_work([{STATE_KEY: read_scheduler_state(s)}], Role.DECODE, expected_ranks=1)
    assert work.verdict is Verdict.BUSY and work.queues["decode_deferred_releases"] == 1


def test_queues_is_fully_idle_does_not_cover_still_count() -> None:
    s = shells.scheduler("decode")
    s.disagg_decode_prealloc_queue.held_rebootstrap_reqs.append(shells.req())
    assert s.is_fully_idle() is True  # SGLang's expression does not look there
    work = states_work([{STATE_KEY: read_scheduler_state(s)}], Role.DECODE, expected_ranks=1)
    assert work.verdict is Verdict.BUSY and work.queues["decode_held_rebootstrap"] == 1

    s = shells.scheduler("null")
    s._deferred_input_requests.append(object())
    assert s.is_fully_idle() is True
    assert verdict(s, "null") is Verdict.BUSY


def test_last_batch_not_empty_is_busy_through_is_fully_idle_alone() -> None:
    # a queue the reader does not count: only SGLang's own verdict sees it
    s = shells.scheduler("null")
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    batch = ScheduleBatch(reqs=[shells.req()], batch_is_full=False)
    s.last_batch = batch
    assert s.is_fully_idle() is False
    work = states_work([{STATE_KEY: read_scheduler_state(s)}], Role.AGGREGATED,
                       expected_ranks=1)
    assert work.total == 0 and work.engine_has_work is True and work.verdict is Verdict.BUSY


@pytest.mark.parametrize(("mode", "attribute"), [
    ("prefill", "disagg_prefill_inflight_queue"),
    ("prefill", "disagg_prefill_bootstrap_queue"),
    ("decode", "disagg_decode_transfer_queue"),
    ("null", "waiting_queue"),
    ("null", "_deferred_input_requests"),
    ("null", "grammar_manager"),
])
def test_drift_an_attribute_removed_is_unknown(mode: str, attribute: str) -> None:
    s = shells.scheduler(mode)
    delattr(s, attribute)
    state = read_scheduler_state(s)
    assert attribute in state["error"] or "grammar_queue" in state["error"]
    work = states_work([{STATE_KEY: state}], ROLE[mode], expected_ranks=1)
    assert work.verdict is Verdict.UNKNOWN
    assert "could not read its state" in work.reasons[0]


def test_drift_a_queue_none_in_its_mode_is_unknown() -> None:
    s = shells.scheduler("prefill")
    s.disagg_prefill_inflight_queue = None  # what a NULL-mode scheduler has
    assert verdict(s, "prefill") is Verdict.UNKNOWN


def test_old_grammar_queue_name_is_counted_but_0_5_23_needs_the_new_one() -> None:
    s = shells.scheduler("null")
    del s.grammar_manager
    s.grammar_queue = [shells.req()]  # Scheduler.grammar_queue, up to 0.5.3
    counts, _ = scheduler_state._counts(s, "null")
    assert counts["grammar"] == 1
    # 0.5.23's own is_fully_idle reads grammar_manager: the answer is an error, UNKNOWN
    assert "grammar_manager" in read_scheduler_state(s)["error"]


def test_a_scheduler_without_is_fully_idle_is_unknown() -> None:
    state = read_scheduler_state(object())
    assert "is_fully_idle" in state["error"]
    assert states_work([{STATE_KEY: state}], Role.AGGREGATED,
                       expected_ranks=1).verdict is Verdict.UNKNOWN


@pytest.mark.parametrize(("mode", "role"), [("decode", Role.PREFILL), ("null", Role.PREFILL),
                                            ("prefill", Role.AGGREGATED)])
def test_a_scheduler_in_another_mode_than_the_role_is_unknown(mode: str, role: Role) -> None:
    work = states_work([{STATE_KEY: read_scheduler_state(shells.scheduler(mode))}], role,
                       expected_ranks=1)
    assert work.verdict is Verdict.UNKNOWN and "mode" in work.reasons[0]
