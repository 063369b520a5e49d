"""quiesce's vLLM plugin: the scheduler's pending-work counts and a drain ETA, read inside
EngineCore.

Registered on the ``vllm.general_plugins`` entry point, so vLLM calls :func:`register`
in every process it starts (frontend, EngineCore, workers). :func:`register` attaches two
utility methods to ``EngineCore``; the frontend calls them with
``engine.engine_core.call_utility_all_async(name, *args)``. Both run on EngineCore's
busy-loop thread between two steps, so what they count is consistent.

- ``quiesce_snapshot()`` returns the counts as a dict: waiting, running, finished but
  held for a KV send, waiting for remote KV, connector push work, unflushed finished
  ids, EngineCore's own ``has_work()``, and the drain ETA with its inputs (``eta``).
  Read-only: it never calls a connector method that reaps transfers. The first call
  starts the step timer (below) if no subscription did, so its ETA is unknown until
  a step has been timed.
- ``quiesce_subscribe(directory, fifo_name)`` starts the board (:mod:`.board`): it
  creates this engine's board file in ``directory`` (made by the frontend), publishes the
  counts and the ETA at once, and from then on after every engine step and after
  every client request EngineCore handles, by wrapping three methods of this
  EngineCore instance: ``step_fn`` (an instance attribute vLLM binds to ``step`` or
  ``step_with_batch_queue``), ``_handle_client_request`` (an idle or paused engine takes
  requests without stepping) and ``shutdown`` (marks the boards CLOSED). It answers
  ``{"board": file name, "pid", "dp_rank"}``. The board's FIFO is signalled only when the
  counts change; the ETA, which moves every busy step, is rewritten in place silently.
  Each later subscriber (another frontend process) gets a board of its own; at most
  :data:`MAX_BOARDS`, the oldest is closed beyond that. A board whose frontend closed its
  FIFO is dropped at its next change; with no board left nothing is counted any more.

The drain ETA (:func:`estimate`; informational, never part of a verdict), from what
EngineCore itself knows — nothing from the client beyond the request's own
``max_tokens``:

- per pending request (``scheduler.running``, ``waiting``, ``kv_holding_waiting``; vLLM
  0.32 ``Request``): remaining decode tokens ``r = max_tokens - num_output_tokens`` (an
  upper bound: a stop string or EOS only ends a request earlier) and remaining prefill
  tokens ``p = num_tokens - num_computed_tokens - 1`` (a waiting or preempted request
  recomputes its prompt and output); its steps at a prefill chunk of ``c`` tokens are
  ``ceil((p + 1) / c) + r - 1`` while prefill is left (the last chunk samples a token),
  else ``r``;
- the batch: ``B = scheduler.max_num_running_reqs`` (``max_num_seqs``), narrowed to the
  requests the KV cache holds at full length (``cache_config.num_gpu_blocks //
  ceil((num_prompt_tokens + max_tokens) / block_size)`` of the longest; flag
  ``KV_LIMITED``), and the per-step token budget ``T = scheduler.max_num_scheduled_tokens``;
- the step period, timed around the wrapped ``step_fn`` for steps that ran the model:
  from the end of the previous step when the engine stayed busy in between (so the
  loop's own overhead counts), else the step alone; an EMA (``STEP_EMA_ALPHA``) and a
  recent maximum that decays by ``STEP_MAX_DECAY`` per timed step;
- expected steps ``max(max_i steps_i(c=T), ceil(Σr / B), ceil((Σr + Σp) / T))`` times the
  EMA; the upper bound ``max_i steps_i(c=T-B+1) + ceil(Σ steps_i(c=T-B+1) / B) + ceil(Σp / T)
  + 1`` (a list-scheduling bound: no request waits longer than all the others' work
  spread over the batch, plus the budget-limited prefill, plus the step that flushes the
  last output) times the larger of the EMA and the recent maximum;
- not every step passes over every request: the publisher rescans once per
  :data:`REFRESH_STEPS` working steps, when a preemption shows (the waiting queue grew by
  more than the requests added), or when more requests are pending than it scanned; on
  the other steps it takes the steps run since off both step counts and folds each added
  request in as it arrives (``_handle_client_request`` with ``ADD``; :func:`fold_request`,
  O(1)). A request that ended early (abort, stop string) stays in the aged figures until
  the next rescan: they err long;
- KV held for a remote reader: the bound is the connector's lease where it is hard
  (Mooncake's ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``, default 480 s, from the moment
  the request finished); NIXL's ``kv_lease_duration`` is renewed by the reader's
  heartbeats (and ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` no longer exists in 0.32), so NIXL
  and any other connector leave it unbounded with the reason; so do requests waiting
  for remote KV and connector push work. The expected value counts the engine's own
  steps only (the remote reader's pace is not known here).

Costs and contract:

- inert until subscribed (or snapshot once): :func:`register` adds methods and nothing
  runs per step;
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
  answered as ``{"error": ...}`` by the snapshot and published with the ERROR flag on the
  board, and the probe turns both into UNKNOWN; an ETA that fails is published as
  ``NOT_COMPUTED`` and leaves the counts alone.

Imports nothing from vLLM at import time, and from quiesce's core only the standard
library signal guard.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from quiesce.signal_guard import guard_process

from .board import NO_ETA, BoardFlags, BoardWriter, Counts, Eta, EtaFlags, eta_ms
from .exit import install_engine_exit

SNAPSHOT_METHOD = "quiesce_snapshot"
SUBSCRIBE_METHOD = "quiesce_subscribe"
SNAPSHOT_VERSION = 3
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


# -- the drain ETA ---------------------------------------------------------------------------

STEP_EMA_ALPHA = 0.05
"""Weight of the newest timed step in the step-period EMA (~20 steps of memory)."""
STEP_MAX_DECAY = 0.999
"""Per timed step, the recent maximum decays by this factor (half-life ~700 steps: a slow
step, e.g. a long prefill or the OS preempting the engine, is remembered for seconds)."""
REFRESH_STEPS = 16
"""The publisher rescans every pending request at least once per this many working steps;
in between it ages the last scan by the steps run and folds added requests in (O(1))."""
MOONCAKE_LEASE_ENV = "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"
MOONCAKE_LEASE_DEFAULT_S = 480.0


class StepClock:
    """The engine's step period: an EMA and a decaying recent maximum, in seconds.

    ``record`` is called after every step with its start and end (``time.perf_counter``),
    whether it ran the model, and whether requests were left after it. A step that ran
    the model is one sample: measured from the previous step's end when that step also
    ran the model and left requests (the busy loop went straight on, so its overhead
    between steps is part of the period), else from its own start. O(1), no allocation.
    """

    __slots__ = ("_chained_end", "ema_s", "max_s", "samples")

    def __init__(self) -> None:
        self.ema_s: float | None = None
        self.max_s: float | None = None
        self.samples = 0
        self._chained_end: float | None = None

    def record(self, started: float, ended: float, ran_model: bool, busy_after: bool) -> None:
        if ran_model:
            sample = ended - (started if self._chained_end is None else self._chained_end)
            if self.ema_s is None or self.max_s is None:
                self.ema_s = self.max_s = sample
            else:
                self.ema_s += STEP_EMA_ALPHA * (sample - self.ema_s)
                self.max_s = max(sample, self.max_s * STEP_MAX_DECAY)
            self.samples += 1
        self._chained_end = ended if ran_model and busy_after else None

    def interrupted(self) -> None:
        """A step raised: the next one is timed on its own."""
        self._chained_end = None


@dataclasses.dataclass
class WorkScan:
    """One pass over the pending requests (see :func:`scan_requests`)."""

    requests: int = 0
    decode_tokens: int = 0
    """Σ r: remaining decode tokens at most (``max_tokens - num_output_tokens``)."""
    prefill_tokens: int = 0
    """Σ p: tokens still to be computed before decoding (prompt, or a preempted request's
    prompt and output)."""
    longest_expected: int = 0
    """max steps of one request with full-budget prefill chunks."""
    longest_bound: int = 0
    """max steps of one request with the smallest prefill chunk the budget guarantees."""
    bound_steps: int = 0
    """Σ steps of every request with that smallest chunk."""
    blocks_longest: int = 0
    """KV blocks the longest request needs at full length (0: block size unknown)."""


def request_steps(decode: int, prefill: int, chunk: int) -> int:
    """Steps one request still needs: its prefill in chunks of ``chunk`` tokens (the last
    chunk samples a token), then the rest of its decode tokens one per step."""
    if prefill <= 0:
        return decode
    return -(-(prefill + 1) // chunk) + max(decode - 1, 0)


def scan_requests(requests: Iterable[Any], budget: int, min_chunk: int,
                  block_size: int | None) -> WorkScan:
    """Remaining work of ``requests`` (vLLM ``Request`` objects). Raises on drift.

    Reads ``max_tokens``, ``num_output_tokens``, ``num_tokens``, ``num_computed_tokens``
    and, with ``block_size``, ``num_prompt_tokens`` of each: O(n), no allocation per
    request, the arithmetic of :func:`request_steps` inlined (this runs in the engine loop).
    """
    count = decode_sum = prefill_sum = bound_sum = 0
    longest_expected = longest_bound = longest_tokens = 0
    for request in requests:
        max_tokens = request.max_tokens
        decode = max_tokens - request.num_output_tokens
        if decode < 0:  # noqa: PLR1730
            decode = 0
        prefill = request.num_tokens - request.num_computed_tokens - 1
        count += 1
        decode_sum += decode
        if prefill > 0:
            prefill_sum += prefill
            tail = decode - 1 if decode > 0 else 0
            expected = -(-(prefill + 1) // budget) + tail
            bound = -(-(prefill + 1) // min_chunk) + tail
        else:
            expected = bound = decode
        bound_sum += bound
        if expected > longest_expected:  # noqa: PLR1730 (a call costs more, every step)
            longest_expected = expected
        if bound > longest_bound:  # noqa: PLR1730
            longest_bound = bound
        if block_size:
            tokens = request.num_prompt_tokens + max_tokens
            if tokens > longest_tokens:  # noqa: PLR1730
                longest_tokens = tokens
    blocks = -(-longest_tokens // block_size) if block_size else 0
    return WorkScan(count, decode_sum, prefill_sum, longest_expected, longest_bound, bound_sum,
                    blocks)


def fold_request(scan: WorkScan, request: Any, shape: EngineShape, aged_steps: int) -> None:
    """Add one request that arrived ``aged_steps`` working steps after ``scan`` was taken
    (in place, O(1)): it counts as if present since the scan and idle until now, so that
    :func:`estimate` with the same ``aged_steps`` stays an estimate and a bound. Raises
    on drift."""
    decode = max(request.max_tokens - request.num_output_tokens, 0)
    prefill = max(request.num_tokens - request.num_computed_tokens - 1, 0)
    bound = request_steps(decode, prefill, shape.min_chunk)
    scan.requests += 1
    scan.decode_tokens += decode
    scan.prefill_tokens += prefill
    scan.bound_steps += bound
    scan.longest_expected = max(scan.longest_expected,
                                aged_steps + request_steps(decode, prefill, shape.token_budget))
    scan.longest_bound = max(scan.longest_bound, aged_steps + bound)
    if shape.block_size:
        scan.blocks_longest = max(scan.blocks_longest, -(-(
            request.num_prompt_tokens + request.max_tokens) // shape.block_size))


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """What bounds an engine step: batch size, token budget, KV cache size, and the KV
    lease of its connector (read once, when the publisher starts)."""

    max_seqs: int
    token_budget: int
    kv_blocks: int | None = None
    block_size: int | None = None
    lease_s: float | None = None
    """A hard bound on how long a finished request's KV is held for a remote reader."""
    lease_renewable: bool = False
    """The connector's lease exists but the reader renews it (NIXL): no bound."""

    @property
    def min_chunk(self) -> int:
        """The prefill chunk a step guarantees: the budget less one token per other
        running request."""
        return max(self.token_budget - self.max_seqs + 1, 1)


def engine_shape(engine_core: Any) -> EngineShape:
    """Read the scheduler's limits and the connector's lease. Raises on drift."""
    scheduler = engine_core.scheduler
    max_seqs = int(scheduler.max_num_running_reqs)
    budget = int(scheduler.max_num_scheduled_tokens)
    cache = getattr(scheduler, "cache_config", None)
    blocks = getattr(cache, "num_gpu_blocks", None)
    block_size = getattr(scheduler, "block_size", None)
    lease, renewable = connector_lease(getattr(scheduler, "connector", None))
    return EngineShape(max_seqs, budget, int(blocks) if isinstance(blocks, int) else None,
                       int(block_size) if isinstance(block_size, int) else None,
                       lease, renewable)


def connector_lease(connector: Any) -> tuple[float | None, bool]:
    """``(hard lease in seconds or None, whether a lease exists but is renewable)``."""
    if connector is None:
        return None, False
    names = {cls.__name__ for cls in type(connector).__mro__}
    if any(name.startswith("Mooncake") for name in names):
        raw = os.environ.get(MOONCAKE_LEASE_ENV)
        try:
            return (float(raw) if raw else MOONCAKE_LEASE_DEFAULT_S), False
        except ValueError:
            return None, False
    if any(name.startswith("Nixl") for name in names):
        return None, True  # kv_lease_duration, renewed by the decoder's heartbeats
    return None, False


def estimate(scan: WorkScan, shape: EngineShape, clock: StepClock, *, held: int,
             receiving: int, push_work: int, aged_steps: int = 0) -> Eta:
    """The drain ETA in board form ``(expected ms, upper ms, EtaFlags)``; see the module
    docstring for the formula. ``aged_steps``: working steps the engine ran since ``scan``
    was taken (each takes one step off every term; at least one step is left while the
    scan has requests). Pure arithmetic, O(1)."""
    flags = EtaFlags(0)
    if scan.requests == 0:
        expected: float | None = 0.0
        upper: float | None = 0.0
    elif clock.ema_s is None or clock.max_s is None:
        expected = upper = None
        flags |= EtaFlags.NO_STEP_TIME
    else:
        batch = max(shape.max_seqs, 1)
        if shape.kv_blocks and scan.blocks_longest:
            fits = max(shape.kv_blocks // scan.blocks_longest, 1)
            if fits < min(batch, scan.requests):
                flags |= EtaFlags.KV_LIMITED
            batch = min(batch, fits)
        budget = max(shape.token_budget, 1)
        expected_steps = max(scan.longest_expected, -(-scan.decode_tokens // batch),
                             -(-(scan.decode_tokens + scan.prefill_tokens) // budget))
        bound_steps = (scan.longest_bound + -(-scan.bound_steps // batch)
                       + -(-scan.prefill_tokens // budget) + 1)
        expected_steps = max(expected_steps - aged_steps, 1)
        bound_steps = max(bound_steps - aged_steps, 1)
        expected = expected_steps * clock.ema_s
        upper = max(bound_steps * max(clock.max_s, clock.ema_s), expected)
    if held:
        if shape.lease_s is not None:
            flags |= EtaFlags.HELD_LEASE
            if upper is not None:
                upper = max(upper, shape.lease_s)
        else:
            flags |= (EtaFlags.HELD_RENEWABLE_LEASE if shape.lease_renewable
                      else EtaFlags.HELD_NO_LEASE)
            upper = None
    if receiving:
        flags |= EtaFlags.RECVS_AWAITED
        upper = None
    if push_work:
        flags |= EtaFlags.PUSH_WORK
        upper = None
    expected_ms, upper_ms = eta_ms(expected, upper=False), eta_ms(upper, upper=True)
    if upper is not None and expected is not None:
        expected_ms = min(expected_ms, upper_ms)
    return expected_ms, upper_ms, int(flags)


def pending_requests(engine_core: Any) -> Iterable[Any]:
    scheduler = engine_core.scheduler
    return itertools.chain(scheduler.running, scheduler.waiting, scheduler.kv_holding_waiting)


def quiesce_snapshot(engine_core: Any) -> dict[str, Any]:
    """Utility: the counts and the ETA as a dict, or ``{"error": reason}``; never raises.

    Starts the step timer on first use (an ETA needs a timed step)."""
    try:
        counts = count_pending(engine_core)
    except Exception as exc:  # drift: answer with the reason, never raise into EngineCore
        return {"version": SNAPSHOT_VERSION, "error": f"{type(exc).__name__}: {exc}"}
    answer: dict[str, Any] = {"version": SNAPSHOT_VERSION,
                              **dict(zip(FIELDS, counts, strict=False)),
                              "has_work": bool(counts[6] & BoardFlags.HAS_WORK)}
    try:
        publisher = _publisher(engine_core)
        answer["eta"] = publisher.eta_details(counts)
    except Exception as exc:  # the ETA never costs the counts
        answer["eta"] = {"expected_ms": None, "upper_ms": None,
                         "flags": int(EtaFlags.NOT_COMPUTED),
                         "error": f"{type(exc).__name__}: {exc}"}
    return answer


class _Publisher:
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


def _publisher(engine_core: Any) -> _Publisher:
    """This EngineCore's publisher, made (and its methods wrapped) on first use."""
    publisher = getattr(engine_core, "_quiesce_publisher", None)
    if publisher is None:
        publisher = _Publisher(engine_core)
        engine_core._quiesce_publisher = publisher
    return publisher


def quiesce_subscribe(engine_core: Any, directory: str, fifo_name: str) -> dict[str, Any]:
    """Utility: start publishing to a new board in ``directory``; never raises."""
    try:
        publisher = _publisher(engine_core)
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


COORDINATOR_NAME = "DPCoordinator"


def run_coordinator_guarded(*args: Any, **kwargs: Any) -> Any:
    """vLLM's ``DPCoordinatorProc.run_coordinator``, guarded first (see :func:`register`).

    Module-level so that a spawned coordinator unpickles it by name (and finds vLLM's
    own function on the class, since nothing replaced it there); a forked one finds the
    original where :func:`guard_coordinator` kept it."""
    from vllm.v1.engine.coordinator import DPCoordinatorProc  # noqa: PLC0415

    guard_process(COORDINATOR_NAME)
    original = getattr(DPCoordinatorProc, _ORIGINAL_COORDINATOR, None)
    run = original if original is not None else DPCoordinatorProc.run_coordinator
    if run is run_coordinator_guarded:  # never: the original is kept where it is replaced
        raise RuntimeError("DPCoordinatorProc.run_coordinator is quiesce's own wrapper")
    return run(*args, **kwargs)


_ORIGINAL_COORDINATOR = "_quiesce_original_run_coordinator"


def guard_coordinator() -> bool:
    """Make vLLM's DP coordinator process (data parallel) guard itself first thing: it
    loads no plugins, so nothing else would. Returns whether it is (or already was) set
    up; False without DP support. Set up in every frontend, whether a quiesce worker owns
    the signals yet or not: the coordinator decides when it starts (``guard_process``
    does nothing without the owner's variable), so a frontend that loaded the plugins
    before its worker claimed the signals still gets a guarded coordinator.

    Unguarded, SIGTERM kills the coordinator and SIGINT ends it (``KeyboardInterrupt``);
    it then neither publishes the engines' load to the frontend nor starts their request
    waves (a MoE model's DP ranks step in lock step and wait for it). That this cannot
    lose a request was not established, so it is guarded rather than trusted; once the
    worker permits the shutdown, vLLM's own SIGTERM ends it as before.
    """
    try:
        from vllm.v1.engine.coordinator import DPCoordinatorProc  # noqa: PLC0415
    except ImportError:
        return False
    current = DPCoordinatorProc.__dict__.get("run_coordinator")
    function = getattr(current, "__func__", None)
    if function is run_coordinator_guarded:
        return True
    if function is None:  # not the staticmethod this was checked on (0.31, 0.32)
        return False
    setattr(DPCoordinatorProc, _ORIGINAL_COORDINATOR, function)
    DPCoordinatorProc.run_coordinator = staticmethod(run_coordinator_guarded)
    return True


def register() -> None:
    """Entry point of ``vllm.general_plugins``: guard this process's signal handlers and
    attach the utilities to EngineCore.

    vLLM loads general plugins in every process it starts: the frontend (process 0),
    EngineCore's constructor and each model runner's. :func:`quiesce.signal_guard.
    guard_process` guards whatever SIGTERM/SIGINT handler the process has then *and*
    those installed later: on 0.32, ``run_engine_core`` and ``WorkerProc.worker_main``
    install vLLM's handlers before the plugins load; on 0.31, ``run_engine_core``
    installs EngineCore's after (when the constructor returns): either way EngineCore's
    handler runs only with the worker's permit. In the frontend (the worker itself)
    nothing is guarded; :func:`guard_coordinator` makes the DP coordinator guard itself.
    In a process not started by a quiesce worker nothing changes. Idempotent, and
    harmless in processes that never run an EngineCore.
    """
    guard_process(multiprocessing.current_process().name)
    guard_coordinator()
    try:
        from vllm.v1.engine.core import EngineCore  # noqa: PLC0415 (vLLM is optional)
    except ImportError:  # a vLLM without the V1 engine: the probe falls back and says so
        return
    for name, function in ((SNAPSHOT_METHOD, quiesce_snapshot),
                           (SUBSCRIBE_METHOD, quiesce_subscribe)):
        if getattr(EngineCore, name, None) is not function:
            setattr(EngineCore, name, function)
    install_engine_exit()  # only in a quiesce worker's engine processes
