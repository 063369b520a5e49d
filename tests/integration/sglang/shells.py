"""Real SGLang objects with the state a test sets, without a model, a GPU or processes.

A scheduler here is a real ``sglang.srt.managers.scheduler.Scheduler`` made with
``object.__new__`` (its constructor loads a model) and given the attributes that its own
``is_fully_idle`` and quiesce's reader use, each a real SGLang object: a real
``ScheduleBatch``, ``GrammarManager``, ``DllmManager``, ``PrefillBootstrapQueue``,
``DecodePreallocQueue`` and ``DecodeTransferQueue`` (also made without their
constructors, which need a KV pool) holding real ``Req`` / ``DecodeRequest`` objects, and
on prefill a real ``MooncakeKVManager`` (made without its constructor, which binds ZMQ
sockets and registers with a bootstrap server) with its own room bookkeeping.
Every method called on them is SGLang's own code. What stands in: the KV sender/receiver
of a request (``None`` where the code under test only counts requests; a real
``MooncakeKVSender`` on that manager in :func:`kv_sender`), the RDMA transfer thread
(a test changes the manager's bookkeeping as that thread does) and, in
:func:`tokenizer_manager`, the ZMQ hop between the TokenizerManager and the scheduler
(the request is handed to the scheduler's real handler in-process, under the rank SGLang
would have published in that scheduler's process).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from array import array
from types import SimpleNamespace
from typing import Any

from sglang.srt.constrained.grammar_manager import GrammarManager
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.decode import (
    DecodePreallocQueue,
    DecodeRequest,
    DecodeTransferQueue,
)
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVSender
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.dllm.mixin.scheduler import DllmManager
from sglang.srt.managers.communicator import FanOutCommunicator
from sglang.srt.managers.io_struct import GetInternalStateReqOutput
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.observability.trace import TraceNullContext
from sglang.srt.runtime_context import get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams

MODES = {"null": DisaggregationMode.NULL, "prefill": DisaggregationMode.PREFILL,
         "decode": DisaggregationMode.DECODE}
_rids = itertools.count()


def req() -> Req:
    """A real SGLang request (no KV held)."""
    return Req(f"r{next(_rids)}", "hello", array("i", [1, 2, 3]),
               SamplingParams(max_new_tokens=4))


def decode_req() -> DecodeRequest:
    """A real decode-side request wrapper; its KV receiver stands in as None."""
    return DecodeRequest(req=req(), kv_receiver=None)


def _bare(cls: type, **attrs: Any) -> Any:
    obj: Any = object.__new__(cls)
    for name, value in attrs.items():
        setattr(obj, name, value)
    return obj


class _InternalState:
    """Stands in for the scheduler's ``InternalState`` component, whose real answer reads
    the model runner's memory: the hook under test only adds a key to the answer."""

    def get_internal_state(self, recv_req: Any) -> GetInternalStateReqOutput:
        return GetInternalStateReqOutput(internal_state={"component": "stand-in"})


def kv_manager(*, defer_decode_allocation: bool = False) -> Any:
    """A real prefill ``MooncakeKVManager`` with no room in flight (the bookkeeping its
    ``CommonKVManager.__init__`` sets up; no sockets, no transfer threads)."""
    return _bare(MooncakeKVManager, request_status={}, failure_records={},
                 failure_lock=threading.Lock(),
                 _staging_outstanding=collections.defaultdict(int),
                 _deferred_ack_targets={}, _deferred_ack_poisoned_rooms=set(),
                 defer_decode_allocation=defer_decode_allocation, deferred_bootstrap=None)


def kv_sender(manager: Any, room: int) -> Any:
    """A real ``MooncakeKVSender`` for ``room`` on ``manager``, its KV being written: the
    room ``Transferring`` with two chunks outstanding (as the transfer thread leaves it)."""
    manager.update_status(room, KVPoll.Bootstrapping)  # SGLang's own room opening
    manager.update_status(room, KVPoll.Transferring)
    manager._staging_outstanding[room] += 2
    return _bare(MooncakeKVSender, kv_mgr=manager, bootstrap_room=room, conclude_state=None,
                 trace_ctx=TraceNullContext(), _owns_bootstrap_room=True)


def scheduler(mode: str = "null") -> Any:
    """An empty real ``Scheduler`` in disaggregation ``mode`` (null, prefill or decode)."""
    s = _bare(Scheduler)
    s.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    s.chunked_req = None
    s.dllm_manager = _bare(DllmManager, dllm_config=None, staging_queue=[])
    s.last_batch = None
    s.enable_overlap = False
    s.result_queue = collections.deque()
    s.waiting_queue = []
    s._engine_paused = False
    s._deferred_input_requests = []
    s.disaggregation_mode = MODES[mode]
    s.grammar_manager = _bare(GrammarManager, grammar_queue=[])
    s.enable_hisparse = s.enable_hierarchical_cache = s.enable_lmcache = False
    s.decode_offload_manager = None
    s.mm_receiver = None
    s.dllm_config = None
    s.disagg_prefill_bootstrap_queue = s.disagg_prefill_inflight_queue = None
    s.disagg_decode_prealloc_queue = s.disagg_decode_transfer_queue = None
    s.internal_state = _InternalState()
    if mode == "prefill":
        s.disagg_prefill_bootstrap_queue = _bare(PrefillBootstrapQueue, queue=[], scheduler=s,
                                                 kv_manager=kv_manager())
        s.disagg_prefill_inflight_queue = []
    elif mode == "decode":
        s.disagg_decode_prealloc_queue = _bare(DecodePreallocQueue, queue=[],
                                               retracted_queue=[], pending_reqs=[],
                                               held_rebootstrap_reqs=[], scheduler=s)
        s.disagg_decode_transfer_queue = _bare(DecodeTransferQueue, queue=[],
                                               _deferred_releases=[], scheduler=s)
    return s


def defer_release(s: Any) -> None:
    """Put one aborted transfer's KV on the decode transfer queue's deferred releases, in
    the entry shape ``DecodeTransferQueue._defer_release`` appends."""
    now = time.monotonic()
    s.disagg_decode_transfer_queue._deferred_releases.append(
        (decode_req(), now, now + 30.0, 0, 1))


def tokenizer_manager(schedulers: list[Any], *, dp_size: int | None = None,
                      reader: Any = None, tokenizer_worker_num: int = 1,
                      server_args: Any = None, dp_ranks: list[int] | None = None,
                      pp_size: int = 1) -> Any:
    """A real ``TokenizerManager`` (made without its constructor) wired to ``schedulers``.

    Its real ``get_internal_state`` goes through a real ``FanOutCommunicator`` whose
    fan-out is the number of schedulers; the send hands the request to each scheduler's
    real ``get_internal_state`` on the next loop turn (the ZMQ hop), under the parallel
    ranks its process would have published (DP rank ``dp_ranks[i]``, default ``i``;
    pipeline stage 0 of ``pp_size``), and the answers come back through ``handle_recv``.
    ``server_args``: a real (resolved) ``ServerArgs``; default a stand-in with
    ``dp_size`` (default: one per scheduler) and ``tokenizer_worker_num``.
    """
    tm = _bare(TokenizerManager)
    tm.rid_to_state = {}
    tm.server_args = server_args if server_args is not None else SimpleNamespace(
        dp_size=dp_size or len(schedulers), tokenizer_worker_num=tokenizer_worker_num)
    tm.load_snapshot_reader = reader
    tm.event_loop = object()  # the handle loop "exists": no real ZMQ sockets needed
    ranks = dp_ranks if dp_ranks is not None else list(range(len(schedulers)))

    def send(recv_req: Any) -> None:
        def deliver() -> None:
            for s, rank in zip(schedulers, ranks, strict=True):
                with get_parallel().override(dp_rank=rank, pp_rank=0, pp_size=pp_size,
                                             tp_rank=0):
                    out = s.get_internal_state(recv_req)
                comm.handle_recv(out)
        asyncio.get_running_loop().call_soon(deliver)

    comm = FanOutCommunicator(send, len(schedulers))
    tm.get_internal_state_communicator = comm
    return tm
