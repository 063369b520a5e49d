"""The drain ETA EngineCore computes for its pending requests (informational, never part
of a verdict), from what EngineCore itself knows — nothing from the client beyond the
request's own ``max_tokens``. Pure arithmetic over vLLM's scheduler objects; the
publisher (:mod:`.publisher`) calls it after every step.

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
- KV held for a remote reader: the bound is the connector's lease where it is hard
  (Mooncake's ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``, default 480 s, from the moment
  the request finished); NIXL's ``kv_lease_duration`` is renewed by the reader's
  heartbeats (and ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` no longer exists in 0.32), so NIXL
  and any other connector leave it unbounded with the reason; so do requests waiting
  for remote KV and connector push work. The expected value counts the engine's own
  steps only (the remote reader's pace is not known here).

The remaining work of a scan ages between rescans: :func:`estimate` takes ``aged_steps``
off both step counts, and :func:`fold_request` adds a request that arrived after the scan.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterable
from typing import Any

from .board import Eta, EtaFlags, eta_ms

STEP_EMA_ALPHA = 0.05
"""Weight of the newest timed step in the step-period EMA (~20 steps of memory)."""
STEP_MAX_DECAY = 0.999
"""Per timed step, the recent maximum decays by this factor (half-life ~700 steps: a slow
step, e.g. a long prefill or the OS preempting the engine, is remembered for seconds)."""
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
