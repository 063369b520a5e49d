"""What an SGLang scheduler still holds, read inside the scheduler process.

Runs in: every SGLang scheduler process (one per TP/PP rank), but only the one with
``pp_rank == attn_tp_rank == attn_cp_rank == 0`` of each DP rank receives control
requests and answers (0.5.23, ``Scheduler.init_ipc_channels``); called by quiesce's
plugin hook (:mod:`.plugin`) when the scheduler answers ``GetInternalStateReq``. That
handler runs on the scheduler's event-loop thread between two loop iterations, so every
queue read here is consistent with every other.

:func:`read_scheduler_state` returns a plain dict (msgpack-native, it crosses ZMQ):

- ``is_fully_idle``: ``Scheduler.is_fully_idle()`` **with its default arguments**. That is
  SGLang's own "no request and no KV transfer" expression (running batch, chunked prefill,
  last batch, overlap results, waiting queue, grammar queue, the prefill bootstrap and
  inflight queues, the decode prealloc, retracted and transfer queues, deferred KV
  releases of aborted transfers, decode offload, HiSparse and HiCache operations).
  Never ``for_health_check=True``: it skips the grammar queue and every disaggregation
  queue, so a prefill worker whose KV is still being pulled reads idle. Never
  ``ignore_waiting=True``: it is meant for pause and flush and ignores waiting requests
  that hold no KV (verified on 0.5.23 by the contract tests).
- ``uncovered``: what the scheduler process still owes that ``is_fully_idle`` does not
  look at, each a count: the decode prealloc queue's ``held_rebootstrap_reqs``
  (retracted requests parked while paused in retract mode);
  ``Scheduler._deferred_input_requests`` (inputs held at a pause boundary); multimodal
  requests waiting for an encoder worker (``mm_receiver.waiting_list``, EPD); decode
  KV offload's host-to-L3 backups (``decode_offload_manager.ongoing_backup``;
  ``is_fully_idle`` checks only ``ongoing_offload``); and on prefill the KV manager's
  rooms (:func:`kv_manager_work`): chunks still being written
  (``_staging_outstanding``; with the ``prefill_complete`` decode-allocation policy a
  room stays until the sender's ``clear()`` notified decode), ABORT_ACKs owed to decode
  for aborted rooms (``_deferred_ack_targets``) and rooms whose transfer can no longer
  prove it ended (``_deferred_ack_poisoned_rooms``). An aborted prefill request leaves
  the inflight queue at its next poll while the transfer thread may still be writing
  its chunks: only the KV manager still shows it.
- ``counts``: the queues by name, so status can say *why* (waiting, running, chunked,
  grammar, prefill bootstrap/inflight, decode prealloc/transfer/retracted, deferred
  releases). Informational: the verdict is ``is_fully_idle`` and ``uncovered``.
- ``rank``: which rank answered (``dp``, ``pp``, ``pp_size``, ``tp``, from SGLang's
  published ``get_parallel()``), so the main process keys answers by DP rank and sees a
  missing or doubled one; ``idle_fingerprint`` (:mod:`.idle_fingerprint`) of the
  ``is_fully_idle`` this process runs.
- ``mode`` (``null``/``prefill``/``decode``), ``engine_paused``, ``pid``, ``answered_at``
  (``time.time()``; the reader drops answers older than its call) and ``schema``.

Cost: a dozen ``len()`` calls, on prefill one copy of the KV manager's room dict, and
``is_fully_idle`` (~2 µs measured on 0.5.23, CPU); the first call per process also
fingerprints ``is_fully_idle`` (about 1 ms, once).

Missing: any attribute this module reads that the installed SGLang lacks (version drift),
or a disaggregation queue that is ``None`` in the mode that needs it, makes the answer
``{"schema": N, "error": "..."}``, which the probe turns into UNKNOWN. Never raises, never
changes scheduler state (no poll of a KV sender, no pause).
"""

from __future__ import annotations

import os
import time
from typing import Any

from .idle_fingerprint import idle_fingerprint

SCHEMA = 2
"""Version of the dict this module answers; the probe refuses any other."""
STATE_KEY = "quiesce"
"""The key under which the hook adds the state to the scheduler's internal state."""
_MISSING = object()


class StateDrift(LookupError):
    """An attribute the reader needs is missing: the installed SGLang differs."""


def _attr(obj: Any, *names: str) -> Any:
    """The first of ``names`` (dotted paths) present on ``obj``; StateDrift if none is."""
    for name in names:
        value: Any = obj
        for part in name.split("."):
            value = getattr(value, part, _MISSING)
            if value is _MISSING:
                break
        if value is not _MISSING:
            return value
    raise StateDrift(f"Scheduler has none of {', '.join(names)}")


def _queue(obj: Any, *names: str) -> int:
    value = _attr(obj, *names)
    if value is None:
        raise StateDrift(f"{names[0]} is None in this scheduler's mode")
    return len(value)


def _mode(scheduler: Any) -> str:
    mode = _attr(scheduler, "disaggregation_mode")
    text = str(getattr(mode, "value", mode)).lower()
    if text not in ("null", "prefill", "decode"):
        raise StateDrift(f"unknown disaggregation_mode {mode!r}")
    return text


def _counts(scheduler: Any, mode: str) -> tuple[dict[str, int], dict[str, int]]:
    """(counts, uncovered) for this scheduler in ``mode``. Raises StateDrift."""
    counts = {
        "waiting": _queue(scheduler, "waiting_queue"),
        "running": _queue(scheduler, "running_batch.reqs"),
        "chunked": 0 if _attr(scheduler, "chunked_req") is None else 1,
        # grammar_manager.grammar_queue since 0.5.10, Scheduler.grammar_queue before
        "grammar": _queue(scheduler, "grammar_manager.grammar_queue", "grammar_queue"),
    }
    uncovered = {"deferred_inputs": _queue(scheduler, "_deferred_input_requests")}
    receiver = _attr(scheduler, "mm_receiver")
    uncovered["mm_encoder_waiting"] = 0 if receiver is None else _queue(receiver,
                                                                        "waiting_list")
    if mode == "prefill":
        counts["prefill_bootstrap"] = _queue(scheduler, "disagg_prefill_bootstrap_queue.queue")
        counts["prefill_inflight"] = _queue(scheduler, "disagg_prefill_inflight_queue")
        uncovered.update(kv_manager_work(
            _attr(scheduler, "disagg_prefill_bootstrap_queue.kv_manager")))
    elif mode == "decode":
        prealloc = _attr(scheduler, "disagg_decode_prealloc_queue")
        transfer = _attr(scheduler, "disagg_decode_transfer_queue")
        if prealloc is None or transfer is None:
            raise StateDrift("the decode prealloc/transfer queues are None in decode mode")
        counts["decode_prealloc"] = _queue(prealloc, "queue")
        counts["decode_transfer"] = _queue(transfer, "queue")
        counts["decode_retracted"] = _queue(prealloc, "retracted_queue")
        counts["decode_deferred_releases"] = int(
            _attr(transfer, "num_pending_deferred_releases")())
        uncovered["decode_held_rebootstrap"] = _queue(prealloc, "held_rebootstrap_reqs")
        offload = _attr(scheduler, "decode_offload_manager")
        uncovered["decode_offload_backups"] = 0 if offload is None else _queue(
            offload, "ongoing_backup")
    return counts, uncovered


def kv_manager_work(manager: Any) -> dict[str, int]:
    """A prefill KV manager's rooms still owed to decode (module docstring). Raises
    StateDrift where the manager lacks the bookkeeping of SGLang's ``CommonKVManager``.

    Reads only: the dicts are the transfer threads' own, copied in one C-level step
    (no Python code runs meanwhile, so no thread switch) and never changed here.
    """
    if manager is None:
        raise StateDrift("the prefill bootstrap queue has no kv_manager")
    outstanding = dict(_attr(manager, "_staging_outstanding"))
    defer = bool(_attr(manager, "defer_decode_allocation"))
    writes = sum(1 for n in outstanding.values() if n > 0 or defer)
    return {"kv_writes_outstanding": writes,
            "kv_abort_acks_owed": len(_attr(manager, "_deferred_ack_targets")),
            "kv_rooms_poisoned": len(_attr(manager, "_deferred_ack_poisoned_rooms"))}


def _rank() -> dict[str, int]:
    """This process's place, from SGLang's published parallel config. Raises if absent."""
    from sglang.srt.runtime_context import get_parallel  # noqa: PLC0415 (scheduler only)

    parallel = get_parallel()
    dp = parallel.dp_rank
    return {"dp": 0 if dp is None else int(dp), "pp": int(parallel.pp_rank),
            "pp_size": int(parallel.pp_size), "tp": int(parallel.tp_rank)}


def read_scheduler_state(scheduler: Any) -> dict[str, Any]:
    """The scheduler's pending work as a plain dict (module docstring). Never raises."""
    try:
        is_fully_idle = _attr(scheduler, "is_fully_idle")
        mode = _mode(scheduler)
        counts, uncovered = _counts(scheduler, mode)
        # Defaults on purpose: see the module docstring (no health-check variant, no
        # ignore_waiting). Read last, after the counts, so a request that moved between
        # queues while we counted is still seen by SGLang's own expression.
        idle = bool(is_fully_idle())
        paused = bool(getattr(scheduler, "_engine_paused", False))
        rank = _rank()
        fingerprint = idle_fingerprint(type(scheduler))
    except Exception as exc:  # drift or a failing read: the probe says UNKNOWN, with why
        return {"schema": SCHEMA, "error": f"{type(exc).__name__}: {exc}", "pid": os.getpid(),
                "answered_at": time.time()}
    return {"schema": SCHEMA, "is_fully_idle": idle, "mode": mode, "counts": counts,
            "uncovered": uncovered, "engine_paused": paused, "rank": rank,
            "idle_fingerprint": fingerprint, "pid": os.getpid(), "answered_at": time.time()}


def add_state_to_internal_state(output: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``Scheduler.get_internal_state``: adds :data:`STATE_KEY` to the answer.

    ``output`` is SGLang's ``GetInternalStateReqOutput``; its ``internal_state`` dict is
    sent to the main process as is. Returns None, so SGLang keeps ``output`` (now with the
    key). Never raises: a failure to attach leaves the key out, which the probe reads as
    UNKNOWN.
    """
    try:
        state = getattr(output, "internal_state", None)
        if isinstance(state, dict):
            state[STATE_KEY] = read_scheduler_state(scheduler)
    except Exception:  # never break SGLang's own /server_info
        return
