"""The vLLM drain ETA: the plugin's arithmetic, its publication on the board, the probe's
reading of it.

Requests and the scheduler are stand-ins with the attribute names of vLLM 0.32's
``vllm.v1.request.Request`` and ``Scheduler`` (vLLM is not installed in the core
environment). The real engine is covered by tests/integration/vllm/test_vllm_eta.py;
how good the estimate is, by ``bench/eta.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quiesce import Role, Verdict
from quiesce.adapters.vllm import VllmProbe
from quiesce.adapters.vllm import eta as vllm_eta
from quiesce.adapters.vllm import probe as vllm_probe
from quiesce.adapters.vllm import publisher as vllm_publisher
from quiesce.adapters.vllm.board import (
    NO_VALUE,
    RECORD_END,
    RECORD_SIZE,
    BoardReader,
    BoardWriter,
    ChangeFifo,
    EtaFlags,
)
from quiesce.adapters.vllm.eta import (
    EngineShape,
    StepClock,
    WorkScan,
    connector_lease,
    estimate,
    fold_request,
    request_steps,
    scan_requests,
)
from quiesce.adapters.vllm.probe import drain_eta
from quiesce.adapters.vllm.utilities import quiesce_snapshot
from tests.unit.test_vllm_board import FakeEngineCore, engine_over

_ids = itertools.count()


def request(max_tokens: int, output: int = 0, prompt: int = 8,
            computed: int | None = None) -> Any:
    """A stand-in ``Request``: ``computed`` defaults to mid-decode (all but the last token)."""
    tokens = prompt + output
    return types.SimpleNamespace(
        request_id=f"r{next(_ids)}", max_tokens=max_tokens, num_output_tokens=output,
        num_prompt_tokens=prompt, num_tokens=tokens,
        num_computed_tokens=tokens - 1 if computed is None else computed)


def clock(ema_s: float = 1.0, max_s: float | None = None) -> StepClock:
    step = StepClock()
    step.record(0.0, ema_s, ran_model=True, busy_after=False)
    if max_s is not None:
        step.max_s = max_s
    return step


SHAPE = EngineShape(max_seqs=4, token_budget=16)


def eta_of(requests: list[Any], shape: EngineShape = SHAPE, step: StepClock | None = None,
           **kv: int) -> tuple[int, int, int]:
    scan = scan_requests(requests, shape.token_budget, shape.min_chunk, shape.block_size)
    counts = {"held": 0, "receiving": 0, "push_work": 0, **kv}
    return estimate(scan, shape, step or clock(), **counts)


# -- the arithmetic ---------------------------------------------------------------------------


def test_a_request_needs_its_prefill_chunks_then_the_rest_of_its_tokens() -> None:
    assert request_steps(decode=5, prefill=0, chunk=16) == 5
    assert request_steps(decode=5, prefill=31, chunk=16) == 2 + 4  # 32 tokens; 1st token
    assert request_steps(decode=5, prefill=32, chunk=16) == 3 + 4
    assert request_steps(decode=0, prefill=0, chunk=16) == 0


def test_the_scan_reads_remaining_tokens_from_vllm_request_attributes() -> None:
    scan = scan_requests([request(10, output=4), request(7, output=0, prompt=20, computed=0)],
                         budget=16, min_chunk=13, block_size=4)
    assert scan.requests == 2
    assert scan.decode_tokens == 6 + 7
    assert scan.prefill_tokens == 19  # the waiting one: 20 prompt tokens, the last samples
    assert scan.longest_expected == max(6, request_steps(7, 19, 16))
    assert scan.longest_bound == max(6, request_steps(7, 19, 13))
    assert scan.bound_steps == 6 + request_steps(7, 19, 13)
    assert scan.blocks_longest == (20 + 7 + 3) // 4


def test_a_request_past_its_max_tokens_counts_no_decode_work() -> None:
    scan = scan_requests([request(3, output=5)], 16, 13, None)
    assert scan.decode_tokens == 0 and scan.longest_bound == 0


def test_idle_is_zero_and_needs_no_step_time() -> None:
    assert estimate(WorkScan(), SHAPE, StepClock(), held=0, receiving=0,
                    push_work=0) == (0, 0, 0)


def test_work_without_a_timed_step_is_unknown_and_says_why() -> None:
    expected, upper, flags = eta_of([request(10)], step=StepClock())
    assert (expected, upper) == (NO_VALUE, NO_VALUE)
    assert EtaFlags(flags) == EtaFlags.NO_STEP_TIME


def test_expected_is_the_longest_request_times_the_step_ema() -> None:
    expected, upper, flags = eta_of([request(10, output=2), request(5)], step=clock(0.01, 0.02))
    assert expected == 80  # 8 steps of 10 ms: the batch holds both, the longest decides
    bound_steps = 8 + -(-(8 + 5) // 4) + 0 + 1
    assert upper == bound_steps * 20
    assert flags == 0


def test_more_requests_than_the_batch_take_their_share_of_it() -> None:
    expected, upper, _ = eta_of([request(10) for _ in range(12)], step=clock(0.01, 0.01))
    assert expected == 300  # 120 tokens over 4 slots: 30 steps
    assert upper >= expected


def test_a_kv_cache_too_small_for_the_batch_narrows_it_and_says_so() -> None:
    shape = EngineShape(max_seqs=4, token_budget=16, kv_blocks=2, block_size=16)
    expected, _, flags = eta_of([request(10, prompt=6) for _ in range(4)], shape,
                                clock(0.01, 0.01))
    assert EtaFlags.KV_LIMITED in EtaFlags(flags)
    assert expected == 200  # one request of 16 tokens per block, 2 blocks: 2 at a time


def test_aged_steps_come_off_both_values_and_leave_at_least_one_step() -> None:
    scan = scan_requests([request(10)], 16, 13, None)
    fresh = estimate(scan, SHAPE, clock(0.01, 0.01), held=0, receiving=0, push_work=0)
    aged = estimate(scan, SHAPE, clock(0.01, 0.01), held=0, receiving=0, push_work=0,
                    aged_steps=4)
    assert (fresh[0] - aged[0], fresh[1] - aged[1]) == (40, 40)
    gone = estimate(scan, SHAPE, clock(0.01, 0.01), held=0, receiving=0, push_work=0,
                    aged_steps=100)
    assert gone[:2] == (10, 10)


def test_held_kv_without_a_lease_is_unbounded_and_says_why() -> None:
    expected, upper, flags = eta_of([], held=2)
    assert (expected, upper) == (0, NO_VALUE)
    assert EtaFlags(flags) == EtaFlags.HELD_NO_LEASE
    renewable = EngineShape(4, 16, lease_renewable=True)
    assert EtaFlags(eta_of([], renewable, held=1)[2]) == EtaFlags.HELD_RENEWABLE_LEASE


def test_held_kv_under_a_hard_lease_is_bounded_by_it() -> None:
    leased = EngineShape(4, 16, lease_s=30.0)
    expected, upper, flags = eta_of([request(10)], leased, clock(0.01, 0.01), held=1)
    assert expected == 100 and upper == 30_000
    assert EtaFlags(flags) == EtaFlags.HELD_LEASE


def test_remote_kv_and_push_work_leave_the_bound_open() -> None:
    _, upper, flags = eta_of([request(4)], receiving=1, push_work=1)
    assert upper == NO_VALUE
    assert EtaFlags(flags) == EtaFlags.RECVS_AWAITED | EtaFlags.PUSH_WORK


def test_the_connector_lease_is_known_by_class_name(monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = type("NixlPullConnector", (), {})()
    mooncake = type("MooncakeConnector", (), {})()
    other = type("HoldingConnector", (), {})()
    assert connector_lease(None) == (None, False)
    assert connector_lease(nixl) == (None, True)
    assert connector_lease(other) == (None, False)
    monkeypatch.delenv(vllm_eta.MOONCAKE_LEASE_ENV, raising=False)
    assert connector_lease(mooncake) == (480.0, False)
    monkeypatch.setenv(vllm_eta.MOONCAKE_LEASE_ENV, "60")
    assert connector_lease(mooncake) == (60.0, False)
    monkeypatch.setenv(vllm_eta.MOONCAKE_LEASE_ENV, "soon")
    assert connector_lease(mooncake) == (None, False)


def test_the_step_clock_chains_busy_steps_and_times_a_lone_step_alone() -> None:
    step = StepClock()
    step.record(10.0, 10.002, ran_model=True, busy_after=True)
    assert step.ema_s == pytest.approx(0.002)
    step.record(10.003, 10.005, ran_model=True, busy_after=False)  # 3 ms since the last end
    assert step.max_s == pytest.approx(0.003)
    assert step.ema_s == pytest.approx(0.002 + vllm_eta.STEP_EMA_ALPHA * 0.001)
    step.record(20.0, 20.002, ran_model=True, busy_after=True)  # idle before: alone
    assert step.max_s == pytest.approx(max(0.002, 0.003 * vllm_eta.STEP_MAX_DECAY))
    step.record(20.003, 20.004, ran_model=False, busy_after=True)  # no model run: no sample
    assert step.samples == 3


# -- the bound against a list-scheduling model of the engine ----------------------------------


def simulate(work: list[tuple[int, int]], max_seqs: int, budget: int) -> int:
    """Steps an FCFS engine with ``max_seqs`` slots and ``budget`` tokens a step takes:
    decodes first (one token each), then prefill chunks in order; a request's last
    prefill chunk samples its first token."""
    queue = [[prefill + 1 if prefill else 0, decode] for decode, prefill in work]
    running: list[list[int]] = []
    steps = 0
    while queue or running:
        while queue and len(running) < max_seqs:
            running.append(queue.pop(0))
        left = budget
        for state in running:
            if state[0] == 0:
                state[1] -= 1
                left -= 1
        for state in running:
            if state[0] > 0 and left > 0:
                take = min(state[0], left)
                state[0] -= take
                left -= take
                if state[0] == 0:
                    state[1] -= 1
        running = [s for s in running if s[0] > 0 or s[1] > 0]
        steps += 1
    return steps


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 80)), min_size=1, max_size=20),
       st.integers(1, 8), st.integers(0, 64))
def test_the_bound_holds_for_any_mix_the_engine_model_schedules(
        work: list[tuple[int, int]], max_seqs: int, extra_budget: int) -> None:
    shape = EngineShape(max_seqs=max_seqs, token_budget=max_seqs + extra_budget)
    requests = [request(decode, prompt=prefill + 1, computed=0) if prefill
                else request(decode + 3, output=3) for decode, prefill in work]
    expected, upper, _ = eta_of(requests, shape, clock(1.0, 1.0))
    steps = simulate(work, shape.max_seqs, shape.token_budget)
    assert steps * 1000 <= upper
    assert expected <= upper


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(0, 30),
       st.integers(1, 60))
def test_a_request_folded_in_after_aging_keeps_the_bound(
        decodes: list[int], aged: int, added: int) -> None:
    """The publisher ages its last scan and folds added requests in; the bound then still
    covers what a fresh scan of the same moment would need."""
    shape = EngineShape(max_seqs=4, token_budget=16)
    old = [request(d) for d in decodes]
    scan = scan_requests(old, 16, shape.min_chunk, None)
    new = request(added, prompt=5, computed=0)
    fold_request(scan, new, shape, aged)
    now = [request(d, output=min(aged, d)) for d in decodes if d > aged] + [new]
    fresh = eta_of(now, shape, clock(1.0, 1.0))
    folded = estimate(scan, shape, clock(1.0, 1.0), held=0, receiving=0, push_work=0,
                      aged_steps=aged)
    assert folded[1] >= simulate([(d - aged, 0) for d in decodes if d > aged] + [(added, 4)],
                                 4, 16) * 1000
    assert folded[1] >= fresh[0]


# -- the board --------------------------------------------------------------------------------


def test_the_record_still_fits_64_bytes() -> None:
    assert RECORD_END <= RECORD_SIZE == 64


def test_the_eta_reads_back_and_an_eta_change_alone_wakes_nobody(tmp_path: Path) -> None:
    fifo = ChangeFifo(str(tmp_path / "changes.fifo"))
    board = BoardWriter(str(tmp_path / "a.board"), str(tmp_path / "changes.fifo"), 0)
    reader = BoardReader(str(tmp_path / "a.board"))
    counts = (0, 2, 0, 0, 0, 0, 1)
    board.publish(counts, (120, 480, 0))
    fifo.drain()
    first = reader.read()
    assert first is not None and (first.eta_expected_ms, first.eta_upper_ms) == (120, 480)

    async def woken() -> bool:
        waiter = asyncio.create_task(fifo.wait(0.05))
        await asyncio.sleep(0)
        board.publish(counts, (110, 470, 0))  # the ETA ticked down; the counts did not
        await waiter
        return fifo._waiters != set() or _signalled(fifo)

    assert not asyncio.run(woken())
    second = reader.read()
    assert second is not None and second.sequence > first.sequence
    assert (second.eta_expected_ms, second.eta_upper_ms) == (110, 470)
    board.publish(counts, (NO_VALUE, NO_VALUE, int(EtaFlags.NO_STEP_TIME)))
    third = reader.read()
    assert third is not None and third.eta_expected_ms is None and third.eta_upper_ms is None
    assert third.eta_flags == EtaFlags.NO_STEP_TIME
    board.publish((0, 1, 0, 0, 0, 0, 1), (NO_VALUE, NO_VALUE, int(EtaFlags.NO_STEP_TIME)))
    assert _signalled(fifo)  # a count change does signal
    board.close()
    fifo.close()


def _signalled(fifo: ChangeFifo) -> bool:
    import os

    try:
        return bool(os.read(fifo._read, 4096))
    except BlockingIOError:
        return False


def test_a_layout_1_board_is_refused(tmp_path: Path) -> None:
    import struct

    from quiesce.adapters.vllm.board import BoardError

    path = tmp_path / "old.board"
    path.write_bytes(struct.pack("<4sIiI", b"QSCB", 1, 0, 1) + bytes(48))
    with pytest.raises(BoardError, match="layout"):
        BoardReader(str(path))


# -- the probe --------------------------------------------------------------------------------


def test_drain_eta_turns_board_figures_into_a_drain_eta() -> None:
    eta = drain_eta(250, 900, 0)
    assert (eta.expected_s, eta.upper_s, eta.reason) == (0.25, 0.9, None)
    open_bound = drain_eta(250, NO_VALUE, int(EtaFlags.HELD_RENEWABLE_LEASE))
    assert open_bound.upper_s is None and "renews" in (open_bound.reason or "")
    unknown = drain_eta(NO_VALUE, NO_VALUE, int(EtaFlags.NO_STEP_TIME))
    assert unknown.expected_s is None and "timed" in (unknown.reason or "")
    assert drain_eta(5, 900, int(EtaFlags.NOT_COMPUTED)).expected_s is None
    assert drain_eta(NO_VALUE, 3, 0).reason  # never a missing value without a reason


ADD = types.SimpleNamespace(name="ADD")
"""Stands in for vLLM's ``EngineCoreRequestType.ADD``."""


class EtaEngineCore(FakeEngineCore):
    """The fake EngineCore with stand-in Requests and the scheduler limits the ETA reads."""

    def __init__(self, rank: int = 0) -> None:
        super().__init__(rank)
        self.scheduler.max_num_running_reqs = 4  # type: ignore[attr-defined]
        self.scheduler.max_num_scheduled_tokens = 16  # type: ignore[attr-defined]
        self.step_fn = self.step

    def step(self) -> tuple[dict[int, Any], bool]:
        self.steps += 1
        time.sleep(0.002)  # a step long enough for the board's millisecond resolution
        for r in self.scheduler.running:
            if isinstance(r, str):  # a bare id (the drift test): nothing to advance
                continue
            r.num_output_tokens += 1
            r.num_tokens += 1
            r.num_computed_tokens += 1
        return {}, bool(self.scheduler.running)

    def _handle_client_request(self, request_type: Any, request: Any) -> Any:
        if getattr(request_type, "name", None) == "ADD":  # vLLM's EngineCoreRequestType.ADD
            return None
        return super()._handle_client_request(request_type, request)

    def run(self, req: Any) -> None:
        """Add ``req`` as vLLM's input loop does (a client request), straight to running."""
        self.scheduler.requests[req.request_id] = req
        self.scheduler.running.append(req)
        self._handle_client_request(ADD, (req, 0))


@pytest.fixture(autouse=True)
def tested_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_probe, "installed_vllm_version", lambda: "0.32.0")


async def test_the_probe_reports_every_dp_engines_eta_combined() -> None:
    cores = [EtaEngineCore(0), EtaEngineCore(1)]
    probe = VllmProbe(engine_over(list(cores)), Role.AGGREGATED)
    idle = await probe.pending_work()
    assert idle.is_quiescent and idle.eta is not None
    assert (idle.eta.expected_s, idle.eta.upper_s) == (0.0, 0.0)
    cores[0].run(request(20))
    cores[1].run(request(50))
    cores[0].step_fn()  # no timed step on engine 1 yet: its ETA is unknown
    work = await probe.pending_work()
    assert work.verdict is Verdict.BUSY and work.eta is not None
    assert work.eta.expected_s is None and "timed" in (work.eta.reason or "")
    cores[1].step_fn()
    work = await probe.pending_work()
    assert work.eta is not None and work.eta.expected_s is not None
    assert work.eta.upper_s is not None and work.eta.upper_s >= work.eta.expected_s > 0
    one = cores[1]._quiesce_publisher  # type: ignore[attr-defined]
    assert one.clock.ema_s is not None
    # the slowest engine decides: engine 1 has 49 steps left
    assert work.eta.expected_s == pytest.approx(49 * one.clock.ema_s, abs=1e-3)


async def test_the_snapshot_utility_reports_the_eta_with_its_inputs() -> None:
    core = EtaEngineCore()
    core.run(request(20))
    probe = VllmProbe(engine_over([core]), Role.AGGREGATED, board=False)
    first = await probe.pending_work()
    assert first.eta is not None and first.eta.expected_s is None  # timer starts now
    core.step_fn()
    work = await probe.pending_work()
    assert work.eta is not None and work.eta.expected_s is not None and work.eta.expected_s > 0
    answer = quiesce_snapshot(core)
    assert answer["eta"]["decode_tokens"] == 19 and answer["eta"]["steps_timed"] == 1


async def test_an_eta_that_cannot_be_computed_leaves_the_counts_and_the_verdict() -> None:
    core = EtaEngineCore()
    probe = VllmProbe(engine_over([core]), Role.AGGREGATED)
    assert (await probe.pending_work()).is_quiescent
    core.scheduler.add("r1")  # a request without Request attributes: drift
    core.step_fn()
    work = await probe.pending_work()
    assert work.verdict is Verdict.BUSY and work.running == 1
    assert work.eta is not None and work.eta.expected_s is None
    assert "remaining tokens" in (work.eta.reason or "")
    del core.scheduler.running[0], core.scheduler.requests["r1"]
    core.step_fn()
    done = await probe.pending_work()
    assert done.is_quiescent and done.eta is not None and done.eta.expected_s == 0.0


async def test_the_eta_never_makes_held_kv_look_done() -> None:
    core = EtaEngineCore()
    probe = VllmProbe(engine_over([core]), Role.PREFILL)
    core.scheduler.requests["held"] = request(1)  # finished, KV held for a remote reader
    core.step_fn()
    work = await probe.pending_work()
    assert work.verdict is Verdict.BUSY and work.kv_sends_held == 1
    assert work.eta is not None and work.eta.expected_s == 0.0 and work.eta.upper_s is None
    assert "no known lease" in (work.eta.reason or "")


async def test_an_added_request_is_folded_into_the_aged_scan_without_a_rescan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    core = EtaEngineCore()
    core.run(request(10))
    probe = VllmProbe(engine_over([core]), Role.AGGREGATED)
    await probe.pending_work()
    core.step_fn()
    scans = 0
    real_scan = vllm_eta.scan_requests

    def counting(*args: Any) -> WorkScan:
        nonlocal scans
        scans += 1
        return real_scan(*args)

    monkeypatch.setattr(vllm_publisher, "scan_requests", counting)
    core.step_fn()
    core.run(request(40))  # an ADD client request: folded in
    work = await probe.pending_work()
    assert scans == 0  # aged and folded: no pass over the requests
    one = core._quiesce_publisher  # type: ignore[attr-defined]
    assert work.eta is not None and work.eta.expected_s is not None
    assert work.eta.expected_s >= 39 * one.clock.ema_s - 1e-3
    for _ in range(vllm_publisher.REFRESH_STEPS):
        core.step_fn()
    assert scans == 1  # a full pass once per REFRESH_STEPS working steps


async def test_a_waiting_drain_is_not_woken_by_the_eta_ticking_down() -> None:
    core = EtaEngineCore()
    core.run(request(50))
    probe = VllmProbe(engine_over([core]), Role.AGGREGATED)
    await probe.pending_work()
    core.step_fn()
    work = await probe.pending_work()
    assert work.eta is not None and work.eta.expected_s is not None
    waiting = asyncio.create_task(probe.wait_for_change(work, 3600))
    for _ in range(3):
        core.step_fn()  # the ETA moves each step; the counts do not
        await asyncio.sleep(0.01)
    assert not waiting.done()
    moved = await probe.pending_work()
    assert moved.same_work(work) and moved.eta != work.eta  # rewritten: a new ETA
    sequence = "vllm.engine_core.board_sequence"
    assert int(moved.details[sequence]) > int(work.details[sequence])
    core.scheduler.running.clear()
    core.scheduler.requests.clear()
    core.step_fn()
    await asyncio.wait_for(waiting, 60)
