"""quiesce's vLLM plugin: the scheduler's pending-work counts, read inside EngineCore.

Registered on the ``vllm.general_plugins`` entry point, so vLLM calls :func:`register`
in every process it starts (frontend, EngineCore, workers). :func:`register` attaches two
utility methods to ``EngineCore``; the frontend calls them with
``engine.engine_core.call_utility_all_async(name, *args)``. Both run on EngineCore's
busy-loop thread between two steps, so what they count is consistent.

- ``quiesce_snapshot()`` returns the counts as a dict: waiting, running, finished but
  held for a KV send, waiting for remote KV, connector push work, unflushed finished
  ids, and EngineCore's own ``has_work()``. Read-only: it never calls a connector method
  that reaps transfers.
- ``quiesce_subscribe(directory, fifo_name)`` starts the board (:mod:`.board`): it
  creates this engine's board file in ``directory`` (made by the frontend), publishes the
  counts at once, and from then on publishes them after every engine step and after
  every client request EngineCore handles, by wrapping three methods of this
  EngineCore instance: ``step_fn`` (an instance attribute vLLM binds to ``step`` or
  ``step_with_batch_queue``), ``_handle_client_request`` (an idle or paused engine takes
  requests without stepping) and ``shutdown`` (marks the boards CLOSED). It answers
  ``{"board": file name, "pid", "dp_rank"}``.
  Each later subscriber (another frontend process) gets a board of its own; at most
  :data:`MAX_BOARDS`, the oldest is closed beyond that. A board whose frontend closed its
  FIFO is dropped at its next change; with no board left nothing is counted any more.

Costs and contract:

- inert until subscribed: :func:`register` adds methods and nothing runs per step;
- once subscribed, per step and per client request: a count (queue lengths, with a KV
  connector one pass over ``kv_holding_waiting``, ``scheduler.has_requests()``; ~4 µs)
  and a board write (~1 µs) only when the counts changed;
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
  answered as ``{"error": ...}`` by the snapshot and published with the ERROR flag on the
  board, and the probe turns both into UNKNOWN.

Imports nothing from vLLM at import time, and from quiesce's core only the standard
library signal guard.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from typing import Any

from quiesce.signal_guard import guard_process

from .board import BoardFlags, BoardWriter, Counts
from .exit import install_engine_exit

SNAPSHOT_METHOD = "quiesce_snapshot"
SUBSCRIBE_METHOD = "quiesce_subscribe"
SNAPSHOT_VERSION = 2
MAX_BOARDS = 8
"""Boards one EngineCore keeps (one per subscribed frontend process)."""
FIELDS = ("waiting", "running", "kv_sends_held", "kv_recvs_awaited", "connector_push_work",
          "unflushed_finished")


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


def quiesce_snapshot(engine_core: Any) -> dict[str, Any]:
    """Utility: the counts as a dict, or ``{"error": reason}``; never raises."""
    try:
        counts = count_pending(engine_core)
    except Exception as exc:  # drift: answer with the reason, never raise into EngineCore
        return {"version": SNAPSHOT_VERSION, "error": f"{type(exc).__name__}: {exc}"}
    return {"version": SNAPSHOT_VERSION, **dict(zip(FIELDS, counts, strict=False)),
            "has_work": bool(counts[6] & BoardFlags.HAS_WORK)}


class _Publisher:
    """Publishes one EngineCore's counts to its boards after every step and after every
    client request; on shutdown marks them CLOSED."""

    def __init__(self, engine_core: Any) -> None:
        self.engine_core = engine_core
        self.boards: deque[BoardWriter] = deque()
        # read all three before replacing any: a missing one leaves the engine untouched
        step, handle, shutdown = (engine_core.step_fn, engine_core._handle_client_request,
                                  engine_core.shutdown)

        # Between two steps the counts change only in a client request (an add, an abort,
        # a pause), published below; so one publication after each step is enough.
        def step_and_publish() -> Any:
            try:
                return step()
            finally:
                self.publish()  # what this step finished, freed or started

        def handle_and_publish(*args: Any, **kwargs: Any) -> Any:
            try:
                return handle(*args, **kwargs)
            finally:
                self.publish()  # an added or aborted request, a pause, a subscription

        def close_boards_and_shutdown(*args: Any, **kwargs: Any) -> Any:
            for board in self.boards:
                board.close()  # readers see CLOSED: the counts are final, not live
            self.boards.clear()
            return shutdown(*args, **kwargs)

        engine_core.step_fn = step_and_publish
        engine_core._handle_client_request = handle_and_publish
        engine_core.shutdown = close_boards_and_shutdown

    def counts(self) -> Counts:
        try:
            return count_pending(self.engine_core)
        except Exception:  # drift: the probe asks quiesce_snapshot for the reason
            return (0, 0, 0, 0, 0, 0, int(BoardFlags.ERROR))

    def publish(self) -> None:
        if self.boards:
            counts = self.counts()
            for board in self.boards:
                board.publish(counts)
            if any(board.abandoned for board in self.boards):
                for board in [b for b in self.boards if b.abandoned]:
                    board.close()
                    self.boards.remove(board)

    def add(self, board: BoardWriter) -> None:
        board.publish(self.counts())
        self.boards.append(board)
        while len(self.boards) > MAX_BOARDS:
            self.boards.popleft().close()  # its reader sees CLOSED and stops trusting it


def quiesce_subscribe(engine_core: Any, directory: str, fifo_name: str) -> dict[str, Any]:
    """Utility: start publishing to a new board in ``directory``; never raises."""
    try:
        publisher = getattr(engine_core, "_quiesce_publisher", None)
        if publisher is None:
            publisher = _Publisher(engine_core)
            engine_core._quiesce_publisher = publisher
        parallel = engine_core.vllm_config.parallel_config
        rank = int(getattr(parallel, "data_parallel_index",
                           getattr(parallel, "data_parallel_rank", 0)) or 0)
        name = f"engine-{rank}-{os.getpid()}.board"
        board = BoardWriter(os.path.join(directory, name), os.path.join(directory, fifo_name),
                            rank)
        publisher.add(board)
    except Exception as exc:  # e.g. a DP engine on another host cannot see ``directory``
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"board": name, "pid": os.getpid(), "dp_rank": rank}


def register() -> None:
    """Entry point of ``vllm.general_plugins``: guard this process's signal handlers and
    attach the utilities to EngineCore.

    vLLM loads general plugins in EngineCore's and each model runner's constructor,
    after ``run_engine_core`` and ``WorkerProc.worker_main`` installed their SIGTERM/SIGINT
    handlers (checked on 0.32), so :func:`quiesce.signal_guard.guard_process` wraps
    vLLM's own handlers there; in a process not started by a quiesce worker it does
    nothing. Idempotent, and harmless in processes that never run an EngineCore.
    """
    guard_process(multiprocessing.current_process().name)
    try:
        from vllm.v1.engine.core import EngineCore  # noqa: PLC0415 (vLLM is optional)
    except ImportError:  # a vLLM without the V1 engine: the probe falls back and says so
        return
    for name, function in ((SNAPSHOT_METHOD, quiesce_snapshot),
                           (SUBSCRIBE_METHOD, quiesce_subscribe)):
        if getattr(EngineCore, name, None) is not function:
            setattr(EngineCore, name, function)
    install_engine_exit()  # only in a quiesce worker's engine processes
