"""Drain detection lag: from the engine's true quiescence to ``drained``.

quiesce side: the real :class:`~quiesce.lifecycle.Lifecycle` (admission gate,
``SimProbe(SimEngine)``, ``InMemoryDiscovery``, ``DrainConfig(router_grace_s=0)``)
drains a simulated engine that still has a few requests in flight, some of them
``remote_decode`` (their KV is held until a simulated decoder pulls it, so the last
event is often a KV pull). Lag = the moment the lifecycle entered ``drained`` minus
the engine's ``idle_since`` (the moment its last work item ended).

Baselines: fixed-interval pollers (Dynamo's pending PR: 250 ms; Ray Serve, Istio;
SGLang: 5 s) that read ``probe.is_quiescent()`` every P seconds from the drain start
and publish on the first true read, against the same kind of workload.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Sequence

from bench.results_format import Result
from bench.stats import percentile
from quiesce.adapters.sim import SimConfig, SimEngine, SimProbe, SimRequest
from quiesce.admission import AdmissionGate, Outcome
from quiesce.discovery import InMemoryDiscovery
from quiesce.drain import DrainConfig, StageOutcome
from quiesce.lifecycle import Lifecycle, State

NAME = "drain_lag"

QUIESCE_DRAINS = 400
"""Measured sequential drains (each with a fresh engine, gate and lifecycle)."""
WARMUP_DRAINS = 20
CONCURRENT_DRAINS = 200
CONCURRENT_TIME_SCALE = 50.0
POLL_INTERVALS_S = (0.25, 1.0, 2.0, 5.0)
POLLERS_PER_INTERVAL = 200
WORK_SPAN_S = 0.005
"""Pollers stretch the workload by ``P / WORK_SPAN_S``: the base workload quiesces about
8-20 ms after the drain starts, so quiescence then falls 1.6-4 intervals after the drain
start, at an unaligned phase of the poll grid."""
STAGGER_STEPS = 1.0
"""Concurrent instances start after a random delay of up to this many (stretched) decode
steps, so that their engines do not step in lockstep and flood the loop in bursts."""
TARGET_P99_MS = 2.0

DECODE_STEP_S = 0.001
PREFILL_S_PER_TOKEN = 2e-6
KV_PULL_LATENCY_S = (0.0005, 0.008)
REQUESTS = (2, 6)
PROMPT_TOKENS = (16, 256)
MAX_TOKENS = (2, 12)
REMOTE_DECODE_FRACTION = 0.4


@dataclasses.dataclass(frozen=True)
class Sample:
    lag_s: float
    """Published ``drained`` (or the poller's true read) minus the engine's ``idle_since``."""
    observed_lag_s: float | None
    """For quiesce: when a caller awaiting ``run.wait()`` resumed, minus ``idle_since``."""
    quiescent_after_s: float
    """Engine ``idle_since`` minus the drain start."""
    kv_pull_last: bool
    """Whether the last work item to end was a KV pull (not a decode step)."""
    kv_freed_early: int


def sim_config(seed: int, time_scale: float) -> SimConfig:
    return SimConfig(decode_step_s=DECODE_STEP_S, prefill_s_per_token=PREFILL_S_PER_TOKEN,
                     kv_pull_latency_s=KV_PULL_LATENCY_S, time_scale=time_scale, seed=seed)


def make_requests(rng: random.Random) -> list[SimRequest]:
    return [SimRequest(f"req-{i}", prompt_tokens=rng.randint(*PROMPT_TOKENS),
                       max_tokens=rng.randint(*MAX_TOKENS),
                       remote_decode=rng.random() < REMOTE_DECODE_FRACTION)
            for i in range(rng.randint(*REQUESTS))]


class Workload:
    """One simulated worker with requests in flight, each admitted through the gate."""

    def __init__(self, seed: int, time_scale: float) -> None:
        self.rng = random.Random(seed)
        self.engine = SimEngine(sim_config(seed, time_scale), name=f"sim-{seed}")
        self.gate = AdmissionGate()
        self.stream_ends: list[float] = []
        self._clients: list[asyncio.Task[None]] = []

    async def _serve(self, request: SimRequest) -> None:
        with self.gate.admit(request.request_id) as admission:
            async for _ in self.engine.generate(request):
                pass
            self.stream_ends.append(time.monotonic())
            admission.finish(Outcome.COMPLETED)

    async def start(self, stagger_s: float = 0.0) -> None:
        if stagger_s > 0:
            await asyncio.sleep(self.rng.uniform(0, stagger_s))
        await self.engine.start()
        loop = asyncio.get_running_loop()
        self._clients = [loop.create_task(self._serve(r)) for r in make_requests(self.rng)]
        await asyncio.sleep(0)  # every client admitted and its request inside the engine
        if not self.engine.has_work or self.gate.inflight != len(self._clients):
            raise RuntimeError("workload did not start: the drain would start idle")

    async def finish(self, drain_started: float, published: float,
                     observed: float | None) -> Sample:
        await asyncio.gather(*self._clients)
        idle = self.engine.idle_since
        if idle is None or self.engine.has_work:
            raise RuntimeError("engine still has work after the drain")
        await self.engine.shutdown()
        return Sample(lag_s=published - idle,
                      observed_lag_s=None if observed is None else observed - idle,
                      quiescent_after_s=idle - drain_started,
                      kv_pull_last=max(self.stream_ends) < idle,
                      kv_freed_early=self.engine.kv_freed_early)


def _stagger_s(time_scale: float) -> float:
    return STAGGER_STEPS * DECODE_STEP_S * time_scale


async def quiesce_drain(seed: int, time_scale: float = 1.0, stagger_s: float = 0.0) -> Sample:
    """One drain through the real lifecycle; a fresh engine, gate and lifecycle."""
    work = Workload(seed, time_scale)
    # wall_clock=time.monotonic: Status.since becomes the monotonic instant of the last
    # transition, taken inside Lifecycle._transition, on the clock idle_since uses.
    lifecycle = Lifecycle(gate=work.gate, probe=SimProbe(work.engine),
                          discovery=InMemoryDiscovery(f"worker-{seed}"),
                          config=DrainConfig(router_grace_s=0), wall_clock=time.monotonic)
    await lifecycle.start()
    await work.start(stagger_s)
    drain_started = time.monotonic()
    run = await lifecycle.drain()
    report = await run.wait()
    observed = time.monotonic()
    status = lifecycle.status()
    if report is None or not report.drained or status.state is not State.DRAINED:
        raise RuntimeError(f"drain {seed} did not end drained: {report}")
    if any(s.outcome not in (StageOutcome.COMPLETED, StageOutcome.SKIPPED)
           for s in report.stages):
        raise RuntimeError(f"drain {seed} had a failed stage: {report.to_dict()}")
    return await work.finish(drain_started, status.since, observed)


async def polled_drain(seed: int, interval_s: float, time_scale: float) -> Sample:
    """A fixed-interval poller: close admission, then read the probe every ``interval_s``."""
    work = Workload(seed, time_scale)
    probe = SimProbe(work.engine)
    await work.start(_stagger_s(time_scale))
    drain_started = time.monotonic()
    work.gate.close("draining")
    # The fixed-interval poll is the baseline being measured, hence no event here.
    while not await probe.is_quiescent():  # noqa: ASYNC110
        await asyncio.sleep(interval_s)
    published = time.monotonic()
    return await work.finish(drain_started, published, None)


async def _sequential(count: int, first_seed: int) -> list[Sample]:
    return [await quiesce_drain(seed) for seed in range(first_seed, first_seed + count)]


async def _concurrent_quiesce(count: int, first_seed: int, time_scale: float) -> list[Sample]:
    stagger = _stagger_s(time_scale)
    return list(await asyncio.gather(*(quiesce_drain(seed, time_scale, stagger)
                                       for seed in range(first_seed, first_seed + count))))


async def _concurrent_pollers(count: int, first_seed: int, interval_s: float) -> list[Sample]:
    scale = interval_s / WORK_SPAN_S
    return list(await asyncio.gather(*(polled_drain(seed, interval_s, scale)
                                       for seed in range(first_seed, first_seed + count))))


def _ms(values: Sequence[float], q: float) -> float:
    return round(percentile(values, q) * 1e3, 4)


def _interval_label(interval_s: float) -> str:
    return f"{round(interval_s * 1000)}ms" if interval_s < 1 else f"{interval_s:g}s"


def run() -> Result:
    asyncio.run(_sequential(WARMUP_DRAINS, 1_000_000))
    sequential = asyncio.run(_sequential(QUIESCE_DRAINS, 0))
    concurrent = asyncio.run(_concurrent_quiesce(CONCURRENT_DRAINS, 10_000,
                                                 CONCURRENT_TIME_SCALE))
    polled = {interval: asyncio.run(_concurrent_pollers(POLLERS_PER_INTERVAL,
                                                        100_000 * (i + 1), interval))
              for i, interval in enumerate(POLL_INTERVALS_S)}

    lags = [s.lag_s for s in sequential]
    observed = [s.observed_lag_s for s in sequential if s.observed_lag_s is not None]
    by_pull = [s.lag_s for s in sequential if s.kv_pull_last]
    by_decode = [s.lag_s for s in sequential if not s.kv_pull_last]
    quiesce_samples = [*sequential, *concurrent]
    all_samples = [*quiesce_samples, *(s for samples in polled.values() for s in samples)]
    metrics: dict[str, float] = {
        "quiesce_p50_ms": _ms(lags, 50),
        "quiesce_p99_ms": _ms(lags, 99),
        "quiesce_max_ms": _ms(lags, 100),
        "quiesce_observed_p50_ms": _ms(observed, 50),
        "quiesce_observed_p99_ms": _ms(observed, 99),
    }
    if by_pull:
        metrics["quiesce_kv_pull_last_p99_ms"] = _ms(by_pull, 99)
    if by_decode:
        metrics["quiesce_decode_last_p99_ms"] = _ms(by_decode, 99)
    metrics["quiesce_kv_pull_last_fraction"] = round(len(by_pull) / len(sequential), 4)
    metrics["quiesce_concurrent_p50_ms"] = _ms([s.lag_s for s in concurrent], 50)
    metrics["quiesce_concurrent_p99_ms"] = _ms([s.lag_s for s in concurrent], 99)
    for interval, samples in polled.items():
        label = _interval_label(interval)
        metrics[f"poll_{label}_p50_ms"] = _ms([s.lag_s for s in samples], 50)
        metrics[f"poll_{label}_p99_ms"] = _ms([s.lag_s for s in samples], 99)
    metrics["premature_drained_count"] = sum(s.lag_s < 0 for s in quiesce_samples)
    metrics["kv_freed_early_count"] = sum(s.kv_freed_early for s in all_samples)

    units = {m: ("ms" if m.endswith("_ms") else "fraction" if m.endswith("_fraction")
                 else "count") for m in metrics}
    p99 = metrics["quiesce_p99_ms"]
    verdict = "met" if p99 <= TARGET_P99_MS else "NOT met"
    return Result(
        name=NAME, metrics=metrics, units=units,
        parameters={
            "quiesce_drains": QUIESCE_DRAINS,
            "warmup_drains": WARMUP_DRAINS,
            "concurrent_drains": CONCURRENT_DRAINS,
            "concurrent_time_scale": CONCURRENT_TIME_SCALE,
            "poll_intervals_s": list(POLL_INTERVALS_S),
            "pollers_per_interval": POLLERS_PER_INTERVAL,
            "poll_time_scale": {_interval_label(p): p / WORK_SPAN_S for p in POLL_INTERVALS_S},
            "poll_quiescent_after_drain_start_over_interval": {
                _interval_label(p): {f"p{q}": round(percentile(
                    [s.quiescent_after_s / p for s in samples], q), 3) for q in (5, 50, 95)}
                for p, samples in polled.items()},
            "drain_config": {"router_grace_s": 0},
            "sim": {"decode_step_s": DECODE_STEP_S, "prefill_s_per_token": PREFILL_S_PER_TOKEN,
                    "kv_pull_latency_s": list(KV_PULL_LATENCY_S), "requests": list(REQUESTS),
                    "prompt_tokens": list(PROMPT_TOKENS), "max_tokens": list(MAX_TOKENS),
                    "remote_decode_fraction": REMOTE_DECODE_FRACTION},
            "percentiles": "linear interpolation between closest ranks (numpy's default)",
        },
        notes=[
            f"Target: quiesce drain lag p99 <= {TARGET_P99_MS:g} ms on the sim engine: "
            f"{verdict} (measured p99 {p99:g} ms over {len(lags)} drains).",
            "Lag = drained_at - true_quiescence_at, both on time.monotonic. "
            "true_quiescence_at is SimEngine.idle_since, which SimEngine._notify sets in the "
            "same synchronous step as the last counter change (the last decode step, or the "
            "timer callback of the last KV pull).",
            "drained_at (quiesce_*): the instant Lifecycle._transition(DRAINED) ran. The "
            "Lifecycle is built with wall_clock=time.monotonic, so Status.since is that "
            "instant on the clock idle_since uses: poll-free, nothing added by the "
            "measurement. quiesce_observed_*: time.monotonic() read as soon as a caller "
            "awaiting run.wait() resumes (what an admin API waiting on the run sees). "
            "run.started_at + report.elapsed_s was not used: started_at is read before the "
            "drain task starts and elapsed_s after the publish bookkeeping, two origins.",
            f"quiesce workload: {QUIESCE_DRAINS} sequential drains (after {WARMUP_DRAINS} "
            "warm-up drains), each with a fresh SimEngine, AdmissionGate, InMemoryDiscovery "
            "and Lifecycle (DrainConfig(router_grace_s=0)); each drain has "
            f"{REQUESTS[0]}-{REQUESTS[1]} requests in flight admitted through the gate "
            f"(max_tokens {MAX_TOKENS[0]}-{MAX_TOKENS[1]}, decode step "
            f"{DECODE_STEP_S * 1e3:g} ms, {REMOTE_DECODE_FRACTION:.0%} remote_decode whose KV "
            f"is pulled {KV_PULL_LATENCY_S[0] * 1e3:g}-{KV_PULL_LATENCY_S[1] * 1e3:g} ms after "
            "the stream ends); the drain starts as soon as they are admitted. "
            "quiesce_kv_pull_last_fraction: share of drains whose last event was a KV pull.",
            f"quiesce_concurrent_*: {CONCURRENT_DRAINS} such lifecycles draining at once in "
            f"one event loop, workload stretched with SimConfig.time_scale="
            f"{CONCURRENT_TIME_SCALE:g} and started at random offsets within one decode "
            "step (the pollers' conditions; the loop contention of the harness is included). "
            "This lag grows with the number of instances sharing the loop (trial runs: p99 "
            "about 0.8 ms with 20, 1.3 ms with 100, 1.9-2.5 ms with 200): it measures the "
            "harness's loop load, not the target, which is one worker per loop as above.",
            "poll_*: a fixed-interval poller models Dynamo's pending PR (250 ms), Ray Serve, "
            "Istio and SGLang (5 s): close admission, read probe.is_quiescent() at the drain "
            "start and then after each asyncio.sleep(P), publish on the first true read; "
            "lag = time of that read - idle_since. Running them one by one would take hours, "
            f"so {POLLERS_PER_INTERVAL} independent engine+poller pairs per interval run "
            "concurrently in one event loop, started at random offsets within one decode "
            "step so that the engines do not step in lockstep. Same workload generator, "
            "stretched with "
            f"SimConfig.time_scale = P / {WORK_SPAN_S * 1e3:g} ms so that quiescence lands "
            "at an unaligned phase of the poll grid (see parameters."
            "poll_quiescent_after_drain_start_over_interval); the expected lag is then "
            "about uniform on [0, P], p99 close to P. The poller figures exclude the "
            "probe's own cost and whatever consumes the published state.",
            "premature_drained_count: quiesce drains published before idle_since (must be "
            "0); kv_freed_early_count: KV freed before the decoder pulled it (must be 0).",
        ],
    )


HEADLINE = ("quiesce_p50_ms", "quiesce_p99_ms", "quiesce_observed_p99_ms",
            "quiesce_concurrent_p99_ms", "poll_250ms_p99_ms", "poll_1s_p99_ms",
            "poll_2s_p99_ms", "poll_5s_p99_ms", "premature_drained_count")
