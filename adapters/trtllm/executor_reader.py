"""Read one ``PyExecutor``'s pending work, in the process that owns it.

Runs wherever the executor lives: the worker's own process (single-process worker), or
each Ray worker through :mod:`.ray_extension`. :func:`read_py_executor` returns plain
data (a dict of ints, strings and lists) so that the answer crosses a Ray call as is;
:func:`to_pending_work` turns one or more answers into a
:class:`~quiesce.probe.PendingWork`.

What is read, and why only this way (the executor loop thread mutates all of it while
we read, and the probe must never change engine state):

Read in flow order (request queue → waiting queue → active → in transfer), and a zero
is accepted only when confirmed across an executor iteration (:class:`ZeroConfirmation`).

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

import asyncio
import time
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

READING_VERSION: Final = 2
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


_ITERATION: Final[tuple[Callable[[Any], Any], ...]] = (
    lambda e: e.iter_counter,  # PyExecutor (2026: incremented at the top of each loop pass)
    lambda e: e.model_engine.iter_counter,  # older builds count on the model engine
)


def _iteration(executor: Any) -> int | None:
    """The executor loop's iteration counter, or None where no known one is readable."""
    for read in _ITERATION:
        try:
            value = read(executor)
        except Exception:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _parked(executor: Any) -> bool:
    """Whether a thread (the executor loop) is blocked in the request queue's ``get()``:
    ``len(request_queue.not_empty._waiters)`` of the stdlib ``queue.Queue``. False where
    it cannot be told (fail closed)."""
    try:
        waiters = executor.executor_request_queue.request_queue.not_empty._waiters
        return len(waiters) > 0
    except Exception:
        return False


def read_py_executor(executor: Any) -> dict[str, Any]:
    """Pending work of one ``PyExecutor`` as plain data. Never raises.

    Read in the order a request flows (request queue → waiting queue → active →
    in transfer), so that a request moving forward between two reads is seen in the later
    place; a request the executor holds between two places (taken from one, not yet put
    in the next) or a list it rebuilds (``clear()`` then ``extend()``) can still give a
    transient zero, which is why a zero must be confirmed (:class:`ZeroConfirmation`).

    Keys: ``version``; the counts in :data:`COUNTS` (an int, or None when unreadable);
    ``attention_dp_dummies``; ``layout`` (what -> layout label); ``errors`` (list of str);
    ``is_shutdown`` (bool or None); ``idle_transfer_gap`` (bool); ``iter_before`` and
    ``iter_after`` (the iteration counter around the reading, or None); ``parked`` (the
    loop was blocked on an empty request queue after the reading, with the counter
    unchanged since before it).
    """
    errors: list[str] = []
    layout: dict[str, str] = {}
    out: dict[str, Any] = {"version": READING_VERSION, "layout": layout, "errors": errors}
    out["iter_before"] = _iteration(executor)
    out["queued"] = _first(executor, _QUEUED, "queued", errors, layout)
    out["waiting"] = _first(executor, _WAITING, "waiting", errors, layout)
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
    out["ctx_in_transfer"] = _first(executor, _CTX, "ctx_in_transfer", errors, layout)
    parked = _parked(executor)
    out["iter_after"] = _iteration(executor)
    out["parked"] = bool(parked and out["iter_before"] is not None
                         and out["iter_before"] == out["iter_after"])
    shutdown = getattr(executor, "is_shutdown", None)
    out["is_shutdown"] = shutdown if isinstance(shutdown, bool) else None
    idle = (out["running"] == 0 and out["gen_awaiting_kv"] == 0 and out["waiting"] == 0
            and out["queued"] == 0)
    out["idle_transfer_gap"] = bool(idle and (out["ctx_in_transfer"] or 0) > 0)
    return out


def all_zero(reading: dict[str, Any]) -> bool:
    """Every count known and zero, and no error: a reading that claims idle."""
    return not reading.get("errors") and all(reading.get(name) == 0 for name in COUNTS)


class ZeroConfirmation:
    """Accepts an all-zero reading only when it is confirmed (fail closed otherwise).

    One instance per executor, kept across reads (the probe's, or the Ray worker's).
    An all-zero reading is **confirmed** when

    - an earlier all-zero reading ended before an executor iteration began that had begun
      before this reading (``previous.iter_after < current.iter_before``): the loop went
      round between the two, so a request it held between two places at the first
      reading was put down before the second; or
    - the loop was **parked** after this reading (blocked in the request queue's
      ``get()``, the counter unchanged since before the reading): it held nothing in
      hand during the reading and had nothing to schedule. This is how an idle loop that
      blocks on its request queue (1.2-era) is confirmed without its counter moving.

    Without a readable counter, a second all-zero reading taken after a short wait
    (:data:`CONFIRM_WAIT_S`, during which the executor thread takes the GIL) confirms it:
    a weaker guarantee, since it assumes the loop puts down what it holds within that
    wait (true of the Python steps between two places; not if the loop is stuck there).
    """

    def __init__(self) -> None:
        self._last_zero_end: int | None = None

    def check(self, reading: dict[str, Any], *, previous_without_counter: bool = False
              ) -> str | None:
        """None when ``reading`` is confirmed (or not all zero); else why it is not.
        ``previous_without_counter``: an all-zero reading without a counter was taken just
        before this one, after the wait (the weaker confirmation)."""
        if not all_zero(reading):
            self._last_zero_end = None
            return None
        before, after = reading.get("iter_before"), reading.get("iter_after")
        if before is None or after is None:
            if previous_without_counter:
                return None
            return ("an all-zero reading is not confirmed yet: no executor iteration "
                    "counter is readable, a second reading must agree")
        last, self._last_zero_end = self._last_zero_end, after
        if reading.get("parked") is True:
            return None
        if last is not None and last < before:
            return None
        return ("an all-zero reading is not confirmed yet: the executor loop has not "
                "gone round since the last all-zero reading (a request it holds between "
                "two queues is in none of them)")


CONFIRM_WAIT_S: Final = 0.002
"""The awaited wait before a second reading where no iteration counter is readable."""


def _second_reading(executor: Any, first: dict[str, Any], confirm: ZeroConfirmation
                    ) -> dict[str, Any]:
    second = read_py_executor(executor)
    weak = first.get("iter_before") is None and second.get("iter_before") is None
    second["unconfirmed"] = confirm.check(second, previous_without_counter=weak)
    return second


async def read_confirmed(executor: Any, confirm: ZeroConfirmation) -> dict[str, Any]:
    """:func:`read_py_executor`, with ``unconfirmed`` set (None, or why a zero is not
    confirmed). An unconfirmed zero is read once more after an awaited
    :data:`CONFIRM_WAIT_S` (the event loop is never blocked); the cost is a few
    microseconds, plus that wait only when the engine reads zero."""
    first = read_py_executor(executor)
    first["unconfirmed"] = confirm.check(first)
    if first["unconfirmed"] is None:
        return first
    await asyncio.sleep(CONFIRM_WAIT_S)
    return _second_reading(executor, first, confirm)


def read_confirmed_blocking(executor: Any, confirm: ZeroConfirmation) -> dict[str, Any]:
    """:func:`read_confirmed` for a thread that may block briefly (a Ray actor's)."""
    first = read_py_executor(executor)
    first["unconfirmed"] = confirm.check(first)
    if first["unconfirmed"] is None:
        return first
    time.sleep(CONFIRM_WAIT_S)
    return _second_reading(executor, first, confirm)


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


def _unconfirmed(readings: Sequence[dict[str, Any]]) -> str | None:
    """Every rank reads zero: None when at least one (the leader, which alone takes
    requests from the request queue) confirmed it across an iteration, else why not."""
    reasons = [r.get("unconfirmed", "the reading says nothing of confirmation")
               for r in readings]
    return None if not all(reasons) else str(reasons[0])


def _details(valid: Sequence[dict[str, Any]], ranks: int, errors: list[str]
             ) -> dict[str, Detail]:
    details: dict[str, Detail] = {"ranks": ranks}
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
    return details


def to_pending_work(role: Role, source: str, readings: Sequence[object], *,
                    sum_ranks: bool = True) -> PendingWork:
    """One snapshot from the readings of every rank (one reading: one executor).

    ``sum_ranks``: ranks hold disjoint work (attention DP) and their counts add up;
    otherwise (tensor/pipeline parallel ranks see the same requests) the largest count
    is taken. Either way every rank must be idle for the snapshot to be. A malformed
    reading or any rank's error makes the snapshot UNKNOWN unless a rank shows work.
    An all-zero snapshot also needs one rank's zero confirmed (its ``unconfirmed`` is
    None, see :class:`ZeroConfirmation`); otherwise it is UNKNOWN with the reason.
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
    details = _details(valid, len(readings), errors)
    if not errors and len(valid) == len(readings) and all(totals[n] == 0 for n in COUNTS):
        unconfirmed = _unconfirmed(valid)
        if unconfirmed is None:
            details["zero_confirmed"] = True
        else:
            errors.append(unconfirmed)
    return PendingWork(role=role, source=source, waiting=totals["waiting"],
                       running=totals["running"], kv_sends_held=totals["ctx_in_transfer"],
                       kv_recvs_awaited=totals["gen_awaiting_kv"],
                       queues={"request_queue": totals["queued"]},
                       errors=tuple(errors), details=details)
