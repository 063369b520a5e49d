"""After an abort, a prefill KV write still in flight: the probe and the forced path.

The sequence, on SGLang 0.5.23's real code (:mod:`.shells`): a prefill request's KV is
being written to decode (a real ``MooncakeKVSender`` on a real ``MooncakeKVManager``,
room ``Transferring`` with chunks outstanding); the real ``Scheduler.abort_request``
aborts it (its sender's real ``abort()`` marks the room ``Failed``); the sender's real
``poll()`` then reads ``Failed`` at once (only ``Success`` is held back for outstanding
chunks), so the scheduler drops the request (its failure branch, done here as
``process_disagg_prefill_inflight_queue`` does: out of the inflight queue, out of
``rid_to_state``). SGLang's own ``is_fully_idle()`` is then true while the transfer
thread still writes the room's chunks and owes decode an ABORT_ACK. What stands in: the
transfer thread (the test updates the manager's bookkeeping as it does) and the ZMQ hop
(:func:`.shells.tokenizer_manager`).
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from tests.integration.sglang import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import AckTarget
from sglang.srt.managers.io_struct import AbortReq

from quiesce.adapters.sglang import SglangEngineControl, SglangProbe
from quiesce.probe import Role, Verdict
from tests.integration.sglang import shells

pytestmark = pytest.mark.usefixtures("hooked")
ROOM = 4242


def aborted_mid_transfer() -> tuple[Any, Any, Any]:
    """(scheduler, tokenizer manager, kv manager) after the abort sequence above."""
    s = shells.scheduler("prefill")
    s.enable_continuous_input_polling = False
    manager = s.disagg_prefill_bootstrap_queue.kv_manager
    req = shells.req()
    req.disagg_kv_sender = shells.kv_sender(manager, ROOM)
    s.disagg_prefill_inflight_queue.append(req)
    tm = shells.tokenizer_manager([s])
    tm.rid_to_state[req.rid] = object()
    assert s.is_fully_idle() is False

    s.abort_request(AbortReq(rid=req.rid))
    assert req.disagg_kv_sender.poll() == KVPoll.Failed
    s.disagg_prefill_inflight_queue.remove(req)  # the scheduler's failure branch
    del tm.rid_to_state[req.rid]
    assert s.is_fully_idle() is True  # SGLang's own expression: nothing left
    assert manager._staging_outstanding[ROOM] == 2  # the transfer thread still writes
    return s, tm, manager


async def test_kv_still_written_after_an_abort_is_busy() -> None:
    _, tm, manager = aborted_mid_transfer()
    work = await SglangProbe(tm, Role.PREFILL).pending_work()
    assert work.verdict is Verdict.BUSY, work.summary()
    assert work.queues["kv_writes_outstanding"] == 1
    # decode aborted too: it waits for this rank's ABORT_ACK before freeing its pages
    manager.register_deferred_ack_target(ROOM, AckTarget("127.0.0.1", 1, 1))
    # the transfer thread finishes the room's chunks (mooncake conn's bookkeeping)
    manager._staging_outstanding[ROOM] -= 2
    manager._staging_outstanding.pop(ROOM)
    work = await SglangProbe(tm, Role.PREFILL).pending_work()
    assert work.verdict is Verdict.BUSY and work.queues["kv_abort_acks_owed"] == 1
    manager._send_multipart_locked = lambda *a, **k: None  # the ZMQ socket to decode
    manager._maybe_ack_drained_abort(ROOM)  # SGLang's own: sends the ACK, forgets it
    assert (await SglangProbe(tm, Role.PREFILL).pending_work()).verdict is Verdict.QUIESCENT


async def test_the_forced_path_counts_writes_still_open_as_abandoned() -> None:
    _, tm, _ = aborted_mid_transfer()
    sent: list[bool] = []
    tm.abort_request = lambda rid="", abort_all=False: sent.append(abort_all)
    control = SglangEngineControl(types.SimpleNamespace(tokenizer_manager=tm), "prefill",
                                  abort_settle_s=0.05)
    # no request is tracked any more, yet one room is still being written: one loss
    assert await control.abort_all("budget") == 1 and control.abandoned == 1
    assert sent == []  # nothing to abort in the scheduler: nothing sent


async def test_the_forced_path_waits_for_the_writes_to_end() -> None:
    _, tm, manager = aborted_mid_transfer()
    control = SglangEngineControl(types.SimpleNamespace(tokenizer_manager=tm), "prefill",
                                  abort_settle_s=30.0)
    # the transfer thread finishes the room while abort_all waits
    asyncio.get_running_loop().call_later(0.01, manager._staging_outstanding.pop, ROOM)
    assert await control.abort_all("budget") == 0 and control.abandoned == 0
    assert ROOM not in manager._staging_outstanding
