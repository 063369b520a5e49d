"""The SGLang signals the main process reads without asking the scheduler.

Runs in: the worker's main process (it holds SGLang's ``Engine`` and its
``TokenizerManager``), on the event loop; nothing here awaits.

- :func:`read_requests`: ``len(tokenizer_manager.rid_to_state)``, every request this
  TokenizerManager submitted and has not seen finish. It covers requests still in ZMQ
  transit to the scheduler, and on a prefill worker it stays non-empty until the KV
  transfer ended: the scheduler streams a prefill request's final output only after its
  KV sender polled ``Success`` or ``Failed`` (0.5.23, ``process_disagg_prefill_inflight_
  queue``). It is the signal SGLang's own SIGTERM drain waits on (``sigterm_watchdog``).
  It misses the decode side's deferred KV releases and HiCache operations, and with
  ``tokenizer_worker_num > 1`` (or requests entering through the gRPC servicer) this
  process sees only its own requests: then UNKNOWN. Cost: one ``len()`` (<1 µs).
- :func:`read_load_snapshot`: ``tokenizer_manager.load_snapshot_reader.read_all()``
  (0.5.21 and later), the shared-memory load snapshot each DP leader writes after every
  batch and on every idle loop iteration (``Scheduler.publish_load_snapshot``). Required:
  one slot per DP rank (resolved ``dp_size * attn_dp_size``, :mod:`.topology`: every
  attention-DP group leader publishes), each with a timestamp (a slot never published reads 0.0) no
  older than ``max_age_s``, and the disaggregation section in the mode that matches the
  role. Counts: running, waiting (on prefill with the bootstrap queue; on decode with the
  prealloc, transfer and retracted queues), prefill inflight (the KV sends held),
  decode prealloc + transfer (the KV receives awaited) and the grammar queue. A proxy:
  it lacks the chunked request, the last batch, overlap results and deferred releases,
  and SGLang does not publish while paused (the timestamp then ages: UNKNOWN). Cost:
  a shared-lock ``read`` of the mapped file and one msgspec decode per rank (µs).

Each returns a :class:`~quiesce.probe.PendingWork` and never raises: a missing attribute
(version drift), a short list of ranks or a stale slot is UNKNOWN with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from quiesce.probe import Count, PendingWork, Role

REQUESTS_SOURCE = "sglang.rid_to_state"
SNAPSHOT_SOURCE = "sglang.load_snapshot"
DEFAULT_SNAPSHOT_MAX_AGE_S = 5.0
MODE_OF_ROLE = {Role.AGGREGATED: "null", Role.PREFILL: "prefill", Role.DECODE: "decode"}


def server_args_of(tokenizer_manager: Any) -> Any:
    return getattr(tokenizer_manager, "server_args", None)


def read_requests(tokenizer_manager: Any, role: Role) -> PendingWork:
    """``rid_to_state`` as the queue ``tokenizer_requests`` (module docstring)."""
    workers = getattr(server_args_of(tokenizer_manager), "tokenizer_worker_num", 1)
    if workers != 1:
        return PendingWork.unknown(role, REQUESTS_SOURCE,
                                   f"tokenizer_worker_num is {workers!r}: this process's "
                                   "rid_to_state sees only its own requests")
    states = getattr(tokenizer_manager, "rid_to_state", None)
    if not isinstance(states, dict):
        return PendingWork.unknown(role, REQUESTS_SOURCE,
                                   "TokenizerManager has no rid_to_state dict (version drift)")
    return PendingWork(role=role, source=REQUESTS_SOURCE,
                       queues={"tokenizer_requests": len(states)})


def read_load_snapshot(tokenizer_manager: Any, role: Role, *, expected_ranks: int | None,
                       max_age_s: float = DEFAULT_SNAPSHOT_MAX_AGE_S,
                       clock: Callable[[], float] = time.time) -> PendingWork:
    """The shared-memory load snapshot of every DP rank (module docstring)."""
    reader = getattr(tokenizer_manager, "load_snapshot_reader", None)
    if reader is None or not callable(getattr(reader, "read_all", None)):
        return PendingWork.unknown(role, SNAPSHOT_SOURCE, "TokenizerManager has no "
                                   "load_snapshot_reader (SGLang before 0.5.21)")
    if expected_ranks is None:
        return PendingWork.unknown(role, SNAPSHOT_SOURCE,
                                   "cannot read the number of DP ranks (server_args.dp_size "
                                   "× attn_dp_size)")
    try:
        loads = list(reader.read_all())
    except Exception as exc:
        return PendingWork.unknown(role, SNAPSHOT_SOURCE,
                                   f"read_all failed ({type(exc).__name__}: {exc})")
    return snapshot_work(loads, role, expected_ranks=expected_ranks, max_age_s=max_age_s,
                         now=clock())


def _load_problem(load: Any, want_mode: str, now: float, max_age_s: float) -> str | None:
    """Why one rank's ``LoadSnapshot`` cannot be used, or None. Raises on drift."""
    rank, stamp = int(load.dp_rank), float(load.timestamp)
    if stamp <= 0.0:
        return f"DP rank {rank} has not published yet"
    age = now - stamp
    if age > max_age_s:
        return (f"DP rank {rank}'s snapshot is {age:.1f}s old (stale; a paused or hung "
                f"scheduler does not publish), limit {max_age_s}s")
    if load.disaggregation is None:
        return f"DP rank {rank}'s snapshot has no disaggregation section"
    if load.disaggregation.mode != want_mode:
        return (f"DP rank {rank} runs in mode {load.disaggregation.mode!r}, the probe's role "
                f"needs {want_mode!r}")
    if load.queues is None:
        return f"DP rank {rank}'s snapshot has no queues section"
    return None


def snapshot_work(loads: list[Any], role: Role, *, expected_ranks: int, max_age_s: float,
                  now: float) -> PendingWork:
    """Combine one ``LoadSnapshot`` per DP rank; UNKNOWN unless all are present and fresh."""
    if len(loads) != expected_ranks:
        return PendingWork.unknown(role, SNAPSHOT_SOURCE, f"{len(loads)} of {expected_ranks} "
                                   "DP ranks have published a load snapshot")
    want_mode = MODE_OF_ROLE[role]
    totals = dict.fromkeys(("running", "waiting", "kv_sends_held", "kv_recvs_awaited",
                            "grammar"), 0)
    oldest = now
    try:
        ranks = sorted(int(load.dp_rank) for load in loads)
        if ranks != list(range(expected_ranks)):
            return PendingWork.unknown(role, SNAPSHOT_SOURCE, f"the load snapshot's slots are "
                                       f"DP ranks {ranks}, expected 0..{expected_ranks - 1}")
        for load in loads:
            problem = _load_problem(load, want_mode, now, max_age_s)
            if problem is not None:
                return PendingWork.unknown(role, SNAPSHOT_SOURCE, problem)
            disagg = load.disaggregation
            oldest = min(oldest, float(load.timestamp))
            totals["running"] += int(load.num_running_reqs)
            totals["waiting"] += int(load.num_waiting_reqs)
            totals["kv_sends_held"] += int(disagg.prefill_inflight_queue_reqs)
            totals["kv_recvs_awaited"] += (int(disagg.decode_prealloc_queue_reqs)
                                           + int(disagg.decode_transfer_queue_reqs))
            totals["grammar"] += int(load.queues.grammar)
    except (AttributeError, TypeError, ValueError) as exc:  # drift in LoadSnapshot
        return PendingWork.unknown(role, SNAPSHOT_SOURCE,
                                   f"malformed load snapshot ({type(exc).__name__}: {exc})")
    grammar: Count = totals["grammar"]
    return PendingWork(role=role, source=SNAPSHOT_SOURCE, waiting=totals["waiting"],
                       running=totals["running"], kv_sends_held=totals["kv_sends_held"],
                       kv_recvs_awaited=totals["kv_recvs_awaited"], queues={"grammar": grammar},
                       details={"dp_ranks": len(loads), "age_s": round(now - oldest, 3)})


def main_process_work(tokenizer_manager: Any, role: Role, *, expected_ranks: int | None,
                      max_age_s: float = DEFAULT_SNAPSHOT_MAX_AGE_S) -> PendingWork:
    """``rid_to_state`` AND the load snapshot, as :meth:`PendingWork.merge` of
    :func:`read_requests` and :func:`read_load_snapshot` would give, in one pass.

    The common case (everything readable, every rank fresh) builds one snapshot instead
    of three: a few µs (``bench/sglang.py``). Anything unusual takes the two readers and
    the merge, so the reasons are theirs.
    """
    server_args = getattr(tokenizer_manager, "server_args", None)
    states = getattr(tokenizer_manager, "rid_to_state", None)
    reader = getattr(tokenizer_manager, "load_snapshot_reader", None)
    if (isinstance(states, dict) and expected_ranks is not None and reader is not None
            and getattr(server_args, "tokenizer_worker_num", 1) == 1):
        try:
            work = _fast(len(states), reader.read_all(), role, expected_ranks, max_age_s)
        except Exception:  # the slow path below says what went wrong
            work = None
        if work is not None:
            return work
    return PendingWork.merge(role, [
        read_requests(tokenizer_manager, role),
        read_load_snapshot(tokenizer_manager, role, expected_ranks=expected_ranks,
                           max_age_s=max_age_s)])


def _fast(requests: int, loads: list[Any], role: Role, expected_ranks: int,
          max_age_s: float) -> PendingWork | None:
    if len(loads) != expected_ranks:
        return None
    now, want_mode = time.time(), MODE_OF_ROLE[role]
    running = waiting = sends = recvs = grammar = 0
    for index, load in enumerate(loads):
        if load.dp_rank != index \
                or _load_problem(load, want_mode, now, max_age_s) is not None:
            return None
        disagg = load.disaggregation
        running += int(load.num_running_reqs)
        waiting += int(load.num_waiting_reqs)
        sends += int(disagg.prefill_inflight_queue_reqs)
        recvs += int(disagg.decode_prealloc_queue_reqs) + int(disagg.decode_transfer_queue_reqs)
        grammar += int(load.queues.grammar)
    return PendingWork(role=role, source=f"{REQUESTS_SOURCE}+{SNAPSHOT_SOURCE}",
                       waiting=waiting, running=running, kv_sends_held=sends,
                       kv_recvs_awaited=recvs,
                       queues={"tokenizer_requests": requests, "grammar": grammar},
                       details={f"{SNAPSHOT_SOURCE}.dp_ranks": len(loads)})
