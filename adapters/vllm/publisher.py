"""The board publisher inside EngineCore: after every engine step and every client request,
the scheduler's counts and the drain ETA (:mod:`.eta`) written to each subscribed
frontend's board (:mod:`.board`).

:func:`engine_publisher` makes one :class:`Publisher` per EngineCore on first use (a
subscription, or the first snapshot) and wraps three methods of that EngineCore instance:
``step_fn`` (an instance attribute vLLM binds to ``step`` or ``step_with_batch_queue``;
timed for the ETA's step period), ``_handle_client_request`` (an idle or paused engine
takes requests without stepping) and ``shutdown`` (marks the boards CLOSED). A board's
FIFO is signalled only when the counts change; the ETA, which moves every busy step, is
rewritten in place silently. At most :data:`MAX_BOARDS` boards, the oldest is closed
beyond that. A board whose frontend closed its FIFO is dropped at its next change; with
no board left nothing is counted any more.

Not every step passes over every request: the publisher rescans once per
:data:`REFRESH_STEPS` working steps, when a preemption shows (the waiting queue grew by
more than the requests added), or when more requests are pending than it scanned; on the
other steps it takes the steps run since off both step counts and folds each added
request in as it arrives (``_handle_client_request`` with ``ADD``;
:func:`~.eta.fold_request`, O(1)). A request that ended early (abort, stop string) stays
in the aged figures until the next rescan: they err long.

Costs and contract:

- inert until subscribed (or snapshot once): :func:`.plugin.register` adds methods and
  nothing runs per step;
- once subscribed, per step and per client request: a count (queue lengths, with a KV
  connector one pass over ``kv_holding_waiting``, ``scheduler.has_requests()``; ~3 µs),
  the ETA (O(1) arithmetic on the aged scan; once per :data:`REFRESH_STEPS` working
  steps a pass over the pending requests, ~0.2 µs per request: five attribute reads
  each), two clock reads around the step, and a board write (~1 µs) when the counts or
  the ETA changed — on a busy engine, every step. Measured by ``bench/eta.py``: about
  4.5 µs per publication on the aged steps whatever the batch, 9 / 18 / 53 µs on the
  rescanning ones with 16 / 64 / 256 decoding requests;
- what the board shows changes only on EngineCore's busy-loop thread, in a step or in a
  request: a connector must report transfer completions through a step (vLLM's own
  connectors do: ``get_finished`` runs in the model runner, and the scheduler frees the
  blocks in ``update_from_output``). A connector whose ``has_pending_push_work()`` turned
  false on another thread would leave the board busy (safe) until the next step;
- the ``has_work`` flag is the scheduler's ``has_requests()`` or a non-empty batch queue:
  EngineCore's ``has_work()`` without the DP wave flag, which only says that another rank
  has work (that rank's own counts show it) and which vLLM clears after the step, when
  nothing would publish the change;
- ``kv_sends_held`` is ``len(scheduler.requests)`` minus the running and waiting queues:
  the scheduler deletes an entry only when its blocks are freed, so an entry in no queue is
  a finished request whose KV is held for a remote reader (vLLM's own
  ``has_finished_requests`` counts held requests the same way);
- never raises into EngineCore: a count that fails (a vLLM version it does not know) is
  answered as ``{"error": ...}`` by the snapshot (:mod:`.utilities`) and published with
  the ERROR flag on the board, and the probe turns both into UNKNOWN; an ETA that fails
  is published as ``NOT_COMPUTED`` and leaves the counts alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

from .board import NO_ETA, BoardFlags, BoardWriter, Counts, Eta
from .eta import (
    STEP_EMA_ALPHA,
    EngineShape,
    StepClock,
    WorkScan,
    engine_shape,
    estimate,
    fold_request,
    pending_requests,
    scan_requests,
)

MAX_BOARDS = 8
"""Boards one EngineCore keeps (one per subscribed frontend process)."""
REFRESH_STEPS = 16
"""The publisher rescans every pending request at least once per this many working steps;
in between it ages the last scan by the steps run and folds added requests in (O(1))."""


def count_pending(engine_core: Any) -> Counts:
    """The scheduler's counts in board order (:data:`.board.Counts`). Raises on drift."""
    scheduler = engine_core.scheduler
    queued = (scheduler.waiting, scheduler.kv_holding_waiting)
    waiting = sum(len(q) for q in queued)
    running = len(scheduler.running)
    held = len(scheduler.requests) - running - waiting
    if held < 0:
        raise RuntimeError(f"scheduler.requests ({len(scheduler.requests)}) is smaller than "
                           f"its queues ({running} running, {waiting} waiting)")
    connector = getattr(scheduler, "connector", None)
    receiving = push_work = 0
    if connector is not None:
        from vllm.v1.request import RequestStatus  # noqa: PLC0415 (only inside EngineCore)

        # a request waiting for remote KV holds blocks, so it is queued in
        # kv_holding_waiting (Scheduler._enqueue_waiting_request), never in waiting
        receiving = sum(1 for r in scheduler.kv_holding_waiting
                        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        push_work = int(bool(connector.has_pending_push_work()))
    has_work = scheduler.has_requests() or bool(engine_core.batch_queue)
    flags = BoardFlags.HAS_WORK if has_work else BoardFlags(0)
    return (waiting - receiving, running, held, receiving, push_work,
            len(scheduler.finished_req_ids), int(flags))


class Publisher:
    """Publishes one EngineCore's counts to its boards after every step and after every
    client request; on shutdown marks them CLOSED."""

    def __init__(self, engine_core: Any) -> None:
        self.engine_core = engine_core
        self.boards: deque[BoardWriter] = deque()
        self.clock = StepClock()
        self._scan: WorkScan | None = None
        """The last full scan, with added requests folded in (None: rescan)."""
        self._aged = 0
        """Working steps since ``_scan`` was taken."""
        self._queued_seen = 0
        """Waiting requests at the last publication (a rise beyond the adds since then is
        a preemption: rescan)."""
        self._adds = 0
        self.cost_ema_s: float | None = None
        """Seconds one publication takes (count, ETA, board writes), an EMA."""
        try:
            self.shape: EngineShape | None = engine_shape(engine_core)
            self.shape_error: str | None = None
        except Exception as exc:  # drift: no ETA, the counts go on
            self.shape, self.shape_error = None, f"{type(exc).__name__}: {exc}"
        # read all three before replacing any: a missing one leaves the engine untouched
        step, handle, shutdown = (engine_core.step_fn, engine_core._handle_client_request,
                                  engine_core.shutdown)

        # Between two steps the counts change only in a client request (an add, an abort,
        # a pause), published below; so one publication after each step is enough.
        def step_and_publish() -> Any:
            started = time.perf_counter()
            try:
                result = step()
            except BaseException:
                self.clock.interrupted()
                self.publish()
                raise
            ended = time.perf_counter()
            self.timed(started, ended, result)
            self.publish()  # what this step finished, freed or started
            return result

        def handle_and_publish(*args: Any, **kwargs: Any) -> Any:
            try:
                return handle(*args, **kwargs)
            finally:
                self.note_request(args)
                self.publish()  # an added or aborted request, a pause, a subscription

        def close_boards_and_shutdown(*args: Any, **kwargs: Any) -> Any:
            for board in self.boards:
                board.close()  # readers see CLOSED: the counts are final, not live
            self.boards.clear()
            return shutdown(*args, **kwargs)

        engine_core.step_fn = step_and_publish
        engine_core._handle_client_request = handle_and_publish
        engine_core.shutdown = close_boards_and_shutdown

    def timed(self, started: float, ended: float, result: Any) -> None:
        """Feed the step clock; never raises (an odd return value is not timed)."""
        try:
            ran_model = bool(result[1])
            busy = bool(self.engine_core.scheduler.has_requests())
        except Exception:
            self.clock.interrupted()
            self._scan = None
            return
        self.clock.record(started, ended, ran_model, busy)
        if ran_model:
            self._aged += 1

    def note_request(self, args: tuple[Any, ...]) -> None:
        """Fold an added request into the last scan (O(1)); never raises (a request it
        cannot read makes the next publication rescan)."""
        try:
            if getattr(args[0], "name", None) != "ADD":
                return
            self._adds += 1
            if self._scan is not None and self.shape is not None:
                fold_request(self._scan, args[1][0], self.shape, self._aged)
        except Exception:
            self._scan = None

    def counts(self) -> Counts:
        try:
            return count_pending(self.engine_core)
        except Exception:  # drift: the probe asks quiesce_snapshot for the reason
            return (0, 0, 0, 0, 0, 0, int(BoardFlags.ERROR))

    def eta(self, counts: Counts) -> Eta:
        """The ETA for the engine state ``counts`` were read from; NO_ETA on any failure."""
        if self.shape is None or counts[6] & BoardFlags.ERROR:
            return NO_ETA
        shape = self.shape
        queued = counts[0] + counts[3]
        pending = queued + counts[1]
        try:
            if pending == 0:
                self._scan, self._aged = WorkScan(), 0
            elif (self._scan is None or self._aged >= REFRESH_STEPS
                  or pending > self._scan.requests or queued > self._queued_seen + self._adds):
                self._scan = scan_requests(pending_requests(self.engine_core),
                                           shape.token_budget, shape.min_chunk,
                                           shape.block_size)
                self._aged = 0
            self._queued_seen, self._adds = queued, 0
            return estimate(self._scan, shape, self.clock, held=counts[2],
                            receiving=counts[3], push_work=counts[4], aged_steps=self._aged)
        except Exception:  # drift in Request: the snapshot says why
            self._scan = None
            return NO_ETA

    def eta_details(self, counts: Counts) -> dict[str, Any]:
        """The ETA with its inputs, for the snapshot utility (raises on drift)."""
        if self.shape is None:
            raise RuntimeError(f"cannot read the engine's limits: {self.shape_error}")
        shape = self.shape
        scan = scan_requests(pending_requests(self.engine_core), shape.token_budget,
                             shape.min_chunk, shape.block_size)
        expected, upper, flags = estimate(scan, shape, self.clock, held=counts[2],
                                          receiving=counts[3], push_work=counts[4])
        return {"expected_ms": expected, "upper_ms": upper, "flags": flags,
                "step_ema_s": self.clock.ema_s, "step_max_s": self.clock.max_s,
                "steps_timed": self.clock.samples,
                "publish_cost_s": self.cost_ema_s, **dataclasses.asdict(scan),
                "max_seqs": shape.max_seqs, "token_budget": shape.token_budget,
                "kv_blocks": shape.kv_blocks, "lease_s": shape.lease_s}

    def publish(self) -> None:
        if self.boards:
            started = time.perf_counter()
            counts = self.counts()
            eta = self.eta(counts)
            for board in self.boards:
                board.publish(counts, eta)
            if any(board.abandoned for board in self.boards):
                for board in [b for b in self.boards if b.abandoned]:
                    board.close()
                    self.boards.remove(board)
            cost = time.perf_counter() - started
            self.cost_ema_s = cost if self.cost_ema_s is None else (
                self.cost_ema_s + STEP_EMA_ALPHA * (cost - self.cost_ema_s))

    def add(self, board: BoardWriter) -> None:
        counts = self.counts()
        board.publish(counts, self.eta(counts))
        self.boards.append(board)
        while len(self.boards) > MAX_BOARDS:
            self.boards.popleft().close()  # its reader sees CLOSED and stops trusting it


def engine_publisher(engine_core: Any) -> Publisher:
    """This EngineCore's publisher, made (and its methods wrapped) on first use."""
    publisher = getattr(engine_core, "_quiesce_publisher", None)
    if publisher is None:
        publisher = Publisher(engine_core)
        engine_core._quiesce_publisher = publisher
    return publisher
