"""Read one ``PyExecutor``'s pending work, in the process that owns it.

Runs wherever the executor lives: the worker's own process (single-process worker), or
each Ray worker through :mod:`.ray_extension`. :func:`read_py_executor` returns plain
data (a dict of ints, strings and lists) so that the answer crosses a Ray call as is;
:func:`to_pending_work` turns one or more answers into a
:class:`~quiesce.probe.PendingWork`.

What is read, and why only this way (the executor loop thread mutates all of it while
we read, and the probe must never change engine state):

Read in flow order (request queue → waiting queue → active → in transfer), and a zero
is accepted only when confirmed across an executor iteration
(:class:`~.zero_confirmation.ZeroConfirmation`).

- ``active_requests`` (a list): copied with one ``list()`` call, which is atomic under
  the GIL for a list, then counted. Attention-DP dummies (``is_attention_dp_dummy is
  True``) are padding, not work; a request without the flag counts as work (safe).
  A generation request whose state is named ``DISAGG_GENERATION_INIT`` or
  ``DISAGG_GENERATION_TRANS_IN_PROGRESS`` is waiting for remote KV (``kv_recvs_awaited``);
  every other one is ``running``. States are compared by member name, never by value.
- the waiting queue: ``len(PyExecutor.waiting_queue)``, or on older builds
  ``ExecutorRequestQueue.get_waiting_queue_size()`` (itself a ``len()``).
- the request queue: ``ExecutorRequestQueue.get_request_queue_size()`` (``qsize()``).
- requests parked behind a control sentinel: ``_handle_special_queue_items`` moves
  what was fetched after a control request into ``request_accumulated`` and the loop
  fetches them again only in a later pass, after the control action
  (``control_action_done``); ``len(request_accumulated)`` is counted
  (``parked_behind_control``), and so is ``len(control_requests)`` (a control action in
  flight is not quiescent). Both lists are read on ``PyExecutor`` (2026) and on
  ``ExecutorRequestQueue`` (mid-era) and added up. A build with no way to enqueue a
  control sentinel reads (0, 0); one with a way but no readable lists is UNKNOWN.
- context requests whose KV is in transfer (``kv_sends_held``), which TensorRT-LLM drops
  from ``active_requests`` once their prefill finished:
  ``len(async_transfer_manager.requests_in_transfer())`` (the manager hands out its live
  dict, so only ``len()`` is safe: iterating it from this thread can raise "dictionary
  changed size during iteration"), or on older builds
  ``len(ctx_in_transmission_requests)`` (a list, later a dict).
  The KV cache transceiver's status checks (``check_context_transfer_status`` and
  relatives) are never called: they reap finished transfers (a side effect the
  executor loop relies on seeing itself) and can block up to the sender-future timeout.
  On the older layout a KV connector's saves are in neither place
  (``_do_terminate_request`` keeps the KV when ``request_finished()`` says so, after
  the request left ``active_requests``): with ``kv_connector_manager`` set the reading
  carries an error (UNKNOWN, :data:`KV_CONNECTOR_OLD_LAYOUT`). The transfer-manager
  layout counts connector saves (``start_transfer``).
- ``is_shutdown``, and whether a shutdown was requested (the request queue's
  ``active`` is False only after ``enqueue_shutdown_request``; a fatal error sets
  ``is_shutdown`` and leaves it True), so that the reason says which.

Each read is a handful of attribute lookups and ``len()`` calls (a few microseconds); it
takes no lock, so it never stalls the executor loop.

Any missing attribute or exception is recorded in ``errors`` with the names tried; the
probe then reports UNKNOWN (fail closed). ``layout`` names which known layout each
value came from (see :mod:`.layouts`).

The idle-loop gap (1.2-era builds and main at 0004396 alike): when the loop has no
active and no waiting requests it blocks on the request queue (no timeout under MPI)
and stops polling transfers, so a transfer that finished stays in the tracker until the
next request (or cancel, or shutdown) arrives. The count errs high (busy), never low.
The answer flags it (``idle_transfer_gap``) so that status can say why a drain waits
(docs/trtllm.md: a prefill drain on these builds ends at its budget).
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

READING_VERSION: Final = 3
COUNTS: Final = ("running", "gen_awaiting_kv", "waiting", "queued", "ctx_in_transfer",
                 "parked_behind_control", "control_requests")
IDLE_GAP_NOTE: Final = (
    "context transfers counted while the executor loop is idle: TensorRT-LLM's idle wait "
    "ignores transfers (1.2-era builds and main at 0004396 alike), so a finished transfer "
    "is reaped only when the next request, cancel or shutdown wakes the loop; the drain "
    "budget bounds this wait (docs/trtllm.md)")
KV_CONNECTOR_OLD_LAYOUT: Final = (
    "a KV connector is configured (kv_connector_manager) on the older layout "
    "(ctx_in_transmission_requests): a request whose connector save is in flight has left "
    "active_requests and is not in ctx_in_transmission_requests, so no count shows it; "
    "this layout cannot tell when the connector released the KV")
_Ways = tuple[tuple[str, Callable[[Any], Any]], ...]
CONTROL_HOLDERS: Final[_Ways] = (("PyExecutor", lambda e: e),
                                 ("ExecutorRequestQueue", lambda e: e.executor_request_queue))
"""Where the control sentinel's lists live: on ``PyExecutor`` (2026) or on
``ExecutorRequestQueue`` (mid-era). Both are read and added up: a stale copy of the same
name on the other object can only add to the count (busy), never hide the live one."""
CONTROL_ENTRY_POINTS: Final[_Ways] = (
    ("PyExecutor.control_action", lambda e: e.control_action),
    ("ExecutorRequestQueue.enqueue_control_request",
     lambda e: e.executor_request_queue.enqueue_control_request),
    ("PyExecutor.enqueue_control_request", lambda e: e.enqueue_control_request))
"""Ways a control sentinel can be enqueued. A build with none of them cannot park
requests behind one; a build with one must have readable lists (else UNKNOWN)."""


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
    lambda e: e.iter_counter,  # PyExecutor (2026: incremented at the end of each loop pass)
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


def _control(executor: Any, errors: list[str], layout: dict[str, str]
             ) -> tuple[int | None, int | None]:
    """(requests parked behind a control sentinel, control sentinels pending): the lengths
    of ``request_accumulated`` and ``control_requests`` on every object that holds them.
    (0, 0) where the build has no way to enqueue a control sentinel; None where it has
    one but the lists cannot be read (drift: fail closed)."""
    parked = pending = 0
    holders = []
    for label, holder in CONTROL_HOLDERS:
        try:
            target = holder(executor)
            lists = (target.request_accumulated, target.control_requests)
        except AttributeError:
            continue
        try:
            parked, pending = parked + len(lists[0]), pending + len(lists[1])
        except Exception as exc:
            errors.append(f"control requests: {label} lists unreadable: "
                          f"{type(exc).__name__}: {exc}")
            return None, None
        holders.append(label)
    if holders:
        layout["control_requests"] = f"control lists on {' + '.join(holders)}"
        return parked, pending
    entry = []
    for label, read in CONTROL_ENTRY_POINTS:
        try:
            read(executor)
        except Exception:
            continue
        entry.append(label)
    if entry:
        errors.append(f"control requests: {entry[0]} exists but neither PyExecutor nor "
                      "ExecutorRequestQueue has control_requests/request_accumulated, so "
                      "requests parked behind a control action cannot be counted")
        return None, None
    layout["control_requests"] = "no control requests in this build"
    return 0, 0


def _connector_problem(executor: Any, layout: dict[str, str]) -> str | None:
    """Why a KV connector blinds the older layout, or None (see KV_CONNECTOR_OLD_LAYOUT).
    The transfer-manager layout counts connector saves (``start_transfer``)."""
    if layout.get("ctx_in_transfer") != CTX_IN_TRANSMISSION:
        return None
    try:
        connector = executor.kv_connector_manager
    except AttributeError:
        return ("kv_connector: PyExecutor.kv_connector_manager is missing on the older "
                "layout, so whether a KV connector holds KV cannot be told")
    return KV_CONNECTOR_OLD_LAYOUT if connector is not None else None


def _shutdown(executor: Any) -> tuple[bool | None, bool | None]:
    """(``is_shutdown`` of the executor or its request queue, whether a shutdown was
    requested: ``enqueue_shutdown_request`` sets the queue's ``active`` to False, a fatal
    error does not). None where unreadable."""
    flags = [getattr(executor, "is_shutdown", None),
             getattr(getattr(executor, "executor_request_queue", None), "is_shutdown", None)]
    known = [f for f in flags if isinstance(f, bool)]
    shutdown = any(known) if known else None
    active = getattr(getattr(executor, "executor_request_queue", None), "active", None)
    return shutdown, (not active) if isinstance(active, bool) else None


def read_py_executor(executor: Any) -> dict[str, Any]:
    """Pending work of one ``PyExecutor`` as plain data. Never raises.

    Read in the order a request flows (request queue → waiting queue → active →
    in transfer), so that a request moving forward between two reads is seen in the later
    place; a request the executor holds between two places (taken from one, not yet put
    in the next) or a list it rebuilds (``clear()`` then ``extend()``) can still give a
    transient zero, which is why a zero must be confirmed
    (:class:`~.zero_confirmation.ZeroConfirmation`).

    Keys: ``version``; the counts in :data:`COUNTS` (an int, or None when unreadable);
    ``attention_dp_dummies``; ``layout`` (what -> layout label); ``errors`` (list of str);
    ``is_shutdown`` (bool or None); ``shutdown_requested`` (bool or None: False means a
    fatal error stopped it); ``idle_transfer_gap`` (bool); ``iter_before`` and
    ``iter_after`` (the iteration counter around the reading, or None); ``parked`` (the
    loop was blocked on an empty request queue after the reading, with the counter
    unchanged since before it).
    """
    errors: list[str] = []
    layout: dict[str, str] = {}
    out: dict[str, Any] = {"version": READING_VERSION, "layout": layout, "errors": errors}
    out["iter_before"] = _iteration(executor)
    out["queued"] = _first(executor, _QUEUED, "queued", errors, layout)
    out["parked_behind_control"], out["control_requests"] = _control(executor, errors, layout)
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
    connector = _connector_problem(executor, layout)
    if connector is not None:
        errors.append(connector)
    parked = _parked(executor)
    out["iter_after"] = _iteration(executor)
    out["parked"] = bool(parked and out["iter_before"] is not None
                         and out["iter_before"] == out["iter_after"])
    out["is_shutdown"], out["shutdown_requested"] = _shutdown(executor)
    idle = all(out[name] == 0 for name in COUNTS if name != "ctx_in_transfer")
    out["idle_transfer_gap"] = bool(idle and (out["ctx_in_transfer"] or 0) > 0)
    return out


def all_zero(reading: dict[str, Any]) -> bool:
    """Every count known and zero, and no error: a reading that claims idle."""
    return not reading.get("errors") and all(reading.get(name) == 0 for name in COUNTS)


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
    down = [r for r in valid if r.get("is_shutdown") is True]
    if down:
        details["executor_shut_down"] = True
        requested = {r.get("shutdown_requested") for r in down}
        if requested == {True}:
            why = ("a shutdown was requested (the request queue no longer admits): "
                   "its counts no longer change")
        elif requested == {False}:
            why = ("it stopped on a fatal error, no shutdown was requested (the request "
                   "queue still admits): its counts no longer change and its requests "
                   "will not finish; see the engine's log")
        else:
            why = ("a requested shutdown or a fatal error (the request queue's admission "
                   "flag cannot be read to tell which): its counts no longer change")
        details["executor_shut_down_by"] = ("request" if requested == {True} else
                                            "fatal error" if requested == {False} else
                                            "unknown")
        errors.append(f"the executor is shut down: {why}")
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
    None, see :class:`~.zero_confirmation.ZeroConfirmation`); otherwise it is UNKNOWN
    with the reason.
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
                       queues={"request_queue": totals["queued"],
                               "parked_behind_control": totals["parked_behind_control"],
                               "control_requests": totals["control_requests"]},
                       errors=tuple(errors), details=details)
