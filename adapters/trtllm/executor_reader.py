"""Read one ``PyExecutor``'s pending work, in the process that owns it.

Runs wherever the executor lives: the worker's own process (single-process worker), or
each Ray worker through :mod:`.ray_extension`. :func:`read_py_executor` returns plain
data (a dict of ints, strings and lists) so that the answer crosses a Ray call as is;
:func:`to_pending_work` turns one or more answers into a
:class:`~quiesce.probe.PendingWork`.

What is read, and why only this way (the executor loop thread mutates all of it while
we read, and the probe must never change engine state):

- ``active_requests`` (a list): copied with one ``list()`` call, which is atomic under
  the GIL for a list, then counted. Attention-DP dummies (``is_attention_dp_dummy is
  True``) are padding, not work; a request without the flag counts as work (safe).
  A generation request whose state is named ``DISAGG_GENERATION_INIT`` or
  ``DISAGG_GENERATION_TRANS_IN_PROGRESS`` is waiting for remote KV (``kv_recvs_awaited``);
  every other one is ``running``. States are compared by member name, never by value.
- the waiting queue: ``len(PyExecutor.waiting_queue)``, or on older builds
  ``ExecutorRequestQueue.get_waiting_queue_size()`` (itself a ``len()``).
- the request queue: ``ExecutorRequestQueue.get_request_queue_size()`` (``qsize()``).
- context requests whose KV is in transfer (``kv_sends_held``), which TensorRT-LLM drops
  from ``active_requests`` once their prefill finished:
  ``len(async_transfer_manager.requests_in_transfer())`` (the manager hands out its live
  dict, so only ``len()`` is safe: iterating it from this thread can raise "dictionary
  changed size during iteration"), or on older builds
  ``len(ctx_in_transmission_requests)`` (a list, later a dict).
  The KV cache transceiver's status checks (``check_context_transfer_status`` and
  relatives) are never called: they reap finished transfers (a side effect the
  executor loop relies on seeing itself) and can block up to the sender-future timeout.

Each read is a handful of attribute lookups and ``len()`` calls (a few microseconds); it
takes no lock, so it never stalls the executor loop.

Any missing attribute or exception is recorded in ``errors`` with the names tried; the
probe then reports UNKNOWN (fail closed). ``layout`` names which known layout each
value came from (see :mod:`.layouts`).

The idle-loop gap of 1.2-era builds: when the loop has no active and no waiting
requests it blocks on the request queue and stops polling transfers, so a transfer that
finished stays in the tracker until the next request (or cancel, or shutdown) arrives.
The count errs high (busy), never low; the drain's own budget bounds the wait. The
answer flags it (``idle_transfer_gap``) so that status can say why a drain waits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from quiesce.probe import UNKNOWN, Count, Detail, PendingWork, Role

from .layouts import (
    CTX_IN_TRANSMISSION,
    GEN_AWAITING_KV_STATES,
    QUEUED_BY_METHOD,
    QUEUED_BY_QUEUE,
    TRANSFER_MANAGER,
    WAITING_ON_EXECUTOR,
    WAITING_ON_REQUEST_QUEUE,
)

READING_VERSION: Final = 1
COUNTS: Final = ("running", "gen_awaiting_kv", "waiting", "queued", "ctx_in_transfer")
IDLE_GAP_NOTE: Final = (
    "context transfers counted while the executor loop is idle: on TensorRT-LLM 1.2-era "
    "builds a finished transfer is reaped only when the next request arrives; the drain "
    "budget bounds this wait")


def state_name(state: object) -> str | None:
    """The ``LlmRequestState`` member name of ``state`` (``"DISAGG_GENERATION_INIT"``), from
    its ``name`` or its text (``"LlmRequestState.X"``); a C++-style ``kX`` prefix is
    dropped. None where it cannot be told."""
    name = getattr(state, "name", None)
    if not isinstance(name, str):
        text = str(state) if state is not None else ""
        name = text.rsplit(".", 1)[-1] if text else None
    if not name:
        return None
    if len(name) > 1 and name[0] == "k" and name[1].isupper():
        name = name[1:]
    return name


def _first(executor: Any, ways: Sequence[tuple[str, Callable[[Any], int]]], what: str,
           errors: list[str], layout: dict[str, str]) -> int | None:
    """The first way that reads: ``(label, read)`` pairs tried in order."""
    problems = []
    for label, read in ways:
        try:
            value = read(executor)
        except AttributeError as exc:
            problems.append(f"{label}: {exc}")
            continue
        except Exception as exc:  # an engine-side failure: not an alternative layout
            errors.append(f"{what}: {label} raised {type(exc).__name__}: {exc}")
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            errors.append(f"{what}: {label} gave {value!r}, not a count")
            return None
        layout[what] = label
        return value
    errors.append(f"{what}: no known layout matches ({'; '.join(problems)})")
    return None


_WAITING: Final = (
    (WAITING_ON_EXECUTOR, lambda e: len(e.waiting_queue)),
    (WAITING_ON_REQUEST_QUEUE, lambda e: e.executor_request_queue.get_waiting_queue_size()),
)
_QUEUED: Final = (
    (QUEUED_BY_METHOD, lambda e: e.executor_request_queue.get_request_queue_size()),
    (QUEUED_BY_QUEUE, lambda e: e.executor_request_queue.request_queue.qsize()),
)
_CTX: Final = (
    (TRANSFER_MANAGER, lambda e: len(e.async_transfer_manager.requests_in_transfer())),
    (CTX_IN_TRANSMISSION, lambda e: len(e.ctx_in_transmission_requests)),
)


def read_py_executor(executor: Any) -> dict[str, Any]:
    """Pending work of one ``PyExecutor`` as plain data. Never raises.

    Keys: ``version``; the counts in :data:`COUNTS` (an int, or None when unreadable);
    ``attention_dp_dummies``; ``layout`` (what -> layout label); ``errors`` (list of str);
    ``is_shutdown`` (bool or None); ``idle_transfer_gap`` (bool).
    """
    errors: list[str] = []
    layout: dict[str, str] = {}
    out: dict[str, Any] = {"version": READING_VERSION, "layout": layout, "errors": errors}
    try:
        active = list(executor.active_requests)
    except Exception as exc:
        errors.append(f"active_requests: {type(exc).__name__}: {exc}")
        out.update(running=None, gen_awaiting_kv=None, attention_dp_dummies=0)
    else:
        dummies = awaiting = 0
        for request in active:
            if getattr(request, "is_attention_dp_dummy", False) is True:
                dummies += 1
            elif state_name(getattr(request, "state", None)) in GEN_AWAITING_KV_STATES:
                awaiting += 1
        out.update(running=len(active) - dummies - awaiting, gen_awaiting_kv=awaiting,
                   attention_dp_dummies=dummies)
    out["waiting"] = _first(executor, _WAITING, "waiting", errors, layout)
    out["queued"] = _first(executor, _QUEUED, "queued", errors, layout)
    out["ctx_in_transfer"] = _first(executor, _CTX, "ctx_in_transfer", errors, layout)
    shutdown = getattr(executor, "is_shutdown", None)
    out["is_shutdown"] = shutdown if isinstance(shutdown, bool) else None
    idle = (out["running"] == 0 and out["gen_awaiting_kv"] == 0 and out["waiting"] == 0
            and out["queued"] == 0)
    out["idle_transfer_gap"] = bool(idle and (out["ctx_in_transfer"] or 0) > 0)
    return out


def _malformed(reading: object) -> str | None:
    """Why ``reading`` is not an answer of :func:`read_py_executor`, or None."""
    if not isinstance(reading, dict):
        return f"answered {type(reading).__name__}, not a reading"
    if reading.get("version") != READING_VERSION:
        return f"reading version {reading.get('version')!r}, expected {READING_VERSION}"
    for name in COUNTS:
        value = reading.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            return f"{name} is {value!r}, not a count"
    if not isinstance(reading.get("errors"), list):
        return "no error list"
    return None


def to_pending_work(role: Role, source: str, readings: Sequence[object], *,
                    sum_ranks: bool = True) -> PendingWork:
    """One snapshot from the readings of every rank (one reading: one executor).

    ``sum_ranks``: ranks hold disjoint work (attention DP) and their counts add up;
    otherwise (tensor/pipeline parallel ranks see the same requests) the largest count
    is taken. Either way every rank must be idle for the snapshot to be. A malformed
    reading or any rank's error makes the snapshot UNKNOWN unless a rank shows work.
    """
    if not readings:
        return PendingWork.unknown(role, source, "no executor answered")
    errors: list[str] = []
    totals: dict[str, Count] = {}
    valid: list[dict[str, Any]] = []
    for rank, reading in enumerate(readings):
        prefix = f"rank {rank}: " if len(readings) > 1 else ""
        problem = _malformed(reading)
        if problem is not None or not isinstance(reading, dict):
            errors.append(f"{prefix}{problem}")
            continue
        valid.append(reading)
        errors.extend(prefix + str(e) for e in reading["errors"])
    for name in COUNTS:
        values = [r.get(name) for r in valid]
        known = [v for v in values if isinstance(v, int)]
        if len(known) < len(readings):
            totals[name] = max(known) if known and max(known) > 0 else UNKNOWN
        else:
            totals[name] = sum(known) if sum_ranks else max(known, default=0)
    details: dict[str, Detail] = {"ranks": len(readings)}
    for reading in valid:
        for what, label in reading["layout"].items():
            details.setdefault(f"layout.{what}", label)
    dummies = sum(int(r.get("attention_dp_dummies") or 0) for r in valid)
    if dummies:
        details["attention_dp_dummies"] = dummies
    if any(r.get("is_shutdown") is True for r in valid):
        details["executor_shut_down"] = True
        errors.append("the executor is shut down: its counts no longer change")
    if any(r.get("idle_transfer_gap") for r in valid):
        details["note"] = IDLE_GAP_NOTE
    return PendingWork(role=role, source=source, waiting=totals["waiting"],
                       running=totals["running"], kv_sends_held=totals["ctx_in_transfer"],
                       kv_recvs_awaited=totals["gen_awaiting_kv"],
                       queues={"request_queue": totals["queued"]},
                       errors=tuple(errors), details=details)
