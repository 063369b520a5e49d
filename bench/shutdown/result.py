"""The shutdown benchmark (:mod:`bench.shutdown`): rounds of one run per delivery within a
time budget, and the :class:`~bench.results_format.Result` they make (per delivery: medians,
lost streams, exit noise, ``/dev/shm`` left; the target's verdict; how each figure was
measured).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.results_format import Result
from bench.shutdown.one_run import (
    DELIVERIES,
    DTYPE,
    MAX_MODEL_LEN,
    PRESTOP_GRACE_S,
    ROUTER_GRACE_S,
    STREAMS,
    TOKENS,
    WORKER_BUDGET_S,
    Run,
    one_run,
)
from bench.stats import median
from bench.watch import PROC_POLL_S, STATUS_POLL_S

NAME = "shutdown"
RUNS = 3
"""Runs per delivery at most; rounds of one run per delivery, while the time budget lasts."""
TIME_BUDGET_S = 330.0
"""No run starts once the runs so far plus one more (at their mean) would pass this."""
TARGET_S = 1.0


def _log(message: str) -> None:
    print(f"  [bench.shutdown] {message}", file=sys.stderr, flush=True)


def _runs_plan(deliveries: Sequence[str], runs: int) -> list[tuple[str, int]]:
    """Rounds of one run per delivery, the order rotated each round."""
    plan = []
    for index in range(runs):
        shift = index % len(deliveries)
        plan += [(d, index) for d in (*deliveries[shift:], *deliveries[:shift])]
    return plan


def measure(model: Path, deliveries: Sequence[str], runs: int, budget_s: float,
            progress: Callable[[str], None] = _log) -> list[Run]:
    done: list[Run] = []
    started = time.monotonic()
    for delivery, index in _runs_plan(deliveries, runs):
        elapsed = time.monotonic() - started
        mean = elapsed / len(done) if done else 0.0
        if index > 0 and elapsed + mean > budget_s:
            progress(f"time budget {budget_s:g}s: stopping after {len(done)} runs")
            break
        run = asyncio.run(one_run(model, delivery, index))
        done.append(run)
        d = run.to_dict()
        progress(f"{delivery} #{index}: exit {d['exit_after_drained_s']}s after drained "
                 f"(all processes {d['all_gone_after_drained_s']}s), lost {run.lost}, "
                 f"noise {len(run.noise)}, exit code {run.exit_code}"
                 + (f", error: {run.error}" if run.error else ""))
    return done


def build_result(done: Sequence[Run], deliveries: Sequence[str], runs: int,
                 budget_s: float, model_note: str) -> Result:
    metrics: dict[str, float] = {}
    units: dict[str, str] = {}
    verdicts = []
    for delivery in deliveries:
        mine = [r for r in done if r.delivery == delivery]
        series: dict[str, list[float | None]] = {
            "exit_after_drained_s": [r.after_drained(r.main_gone) for r in mine],
            "all_gone_after_drained_s": [r.after_drained(r.all_gone) for r in mine],
            "exit_line_after_drained_s": [r.after_drained(r.exit_line_at) for r in mine],
            "engine_shutdown_stage_s": [r.stage_s("engine_shutdown") for r in mine],
        }
        for key, maybe in series.items():
            values = [v for v in maybe if v is not None]
            if values:
                metrics[f"{key}_{delivery}"] = round(median(values), 4)
                units[f"{key}_{delivery}"] = "s"
        lost = sum(r.lost for r in mine)
        noise = sum(r.noisy for r in mine)
        shm = sum(len(r.shm_left) for r in mine)
        for key, value in (("lost_streams", lost), ("exit_noise_lines", noise),
                           ("shm_left", shm), ("runs", len(mine))):
            metrics[f"{key}_{delivery}"] = value
            units[f"{key}_{delivery}"] = "count"
        p50 = metrics.get(f"exit_after_drained_s_{delivery}")
        met = p50 is not None and p50 <= TARGET_S and lost == 0 and noise == 0 and shm == 0
        verdicts.append(f"{delivery}: {'met' if met else 'NOT met'} (p50 "
                        f"{'n/a' if p50 is None else f'{p50:g} s'}, {lost} lost, "
                        f"{noise} noise lines, {shm} /dev/shm entries left)")
    from quiesce.adapters.vllm import installed_vllm_version

    return Result(
        name=NAME, metrics=metrics, units=units,
        parameters={
            "vllm_version": installed_vllm_version() or "not installed",
            "model": model_note,
            "worker": {"engine": "vllm", "max_model_len": MAX_MODEL_LEN, "dtype": DTYPE,
                       "router_grace_s": ROUTER_GRACE_S, "budget_s": WORKER_BUDGET_S,
                       "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                 "1")},
            "streams": STREAMS, "tokens_per_stream": TOKENS,
            "prestop_grace_period_s": PRESTOP_GRACE_S,
            "runs_per_delivery_max": runs, "time_budget_s": budget_s,
            "status_poll_s": STATUS_POLL_S, "process_poll_s": PROC_POLL_S,
            "runs": [r.to_dict() for r in done],
        },
        notes=[
            f"Target: exit_after_drained_s <= {TARGET_S:g} s (p50) with no lost stream, "
            "nothing printed at exit and nothing left in /dev/shm, per delivery: "
            + "; ".join(verdicts) + ".",
            "exit_after_drained_s_<delivery>: p50 over the runs of (main process gone) - "
            "(worker drained). Drained is the worker's own lifecycle transition, read from "
            "the admin API (GET /engine/status polled every "
            f"{STATUS_POLL_S * 1e3:g} ms from before the signal until it shows 'drained' or "
            "'stopping', so that it adds no requests of its own to the exit): drained.since when a "
            "status showed 'drained' (always on the kubelet path, after quiesce prestop); "
            "otherwise draining.since + last_drain.elapsed_s (the drain run's start and "
            "length, read once the worker is 'stopping', or else the exit report's drain stage, "
            "which the shutdown starts together with the drain run). Each run's source is in "
            "parameters.runs[].drained_source. drained_after_lower_bound_s compares it "
            "with the lower bound the drain could reach: the later of the last stream's end "
            "(as the client saw it) and the router grace's end (draining.since + "
            f"{ROUTER_GRACE_S:g} s). Gone = the process's /proc entry is a zombie or absent "
            f"(polled every {PROC_POLL_S * 1e3:g} ms); all times are wall-clock on one machine.",
            "all_gone_after_drained_s: the same to the last of the worker's processes "
            "(main, EngineCore, the model runner, multiprocessing's resource tracker) gone. "
            "exit_line_after_drained_s: to the worker's exit report line (as received); "
            "engine_shutdown_stage_s: the report's engine_shutdown stage (vLLM's "
            "AsyncLLM.shutdown, which waits for EngineCore, which waits for its model "
            "runner).",
            f"Each run: a fresh worker, {STREAMS} streams of {TOKENS} tokens; the delivery "
            "starts once every stream has its first token, so the drain waits for them. "
            "kubelet: quiesce prestop (admin drain, waits for drained), then SIGTERM to the "
            "main process; term_main: SIGTERM to the main process; term_group / int_group: "
            "SIGTERM / SIGINT to the process group (os.killpg); term_all: SIGTERM to every "
            "process of the worker one by one (main and every descendant from /proc). "
            "Every stream is read to its end: a non-200 answer, an SSE error event or a "
            "missing [DONE] is a lost stream (lost_streams_<delivery>, over all runs).",
            "exit_noise_lines_<delivery>: lines the worker's processes printed (stdout and "
            "stderr) after its exit report that look like a traceback, warning or error "
            "(e.g. AsyncLLM.__del__'s TypeError, the resource tracker's 'leaked "
            "shared_memory' warning, nanobind leak reports), plus any traceback or 'leaked' "
            "line after the signal; samples per run in parameters.runs[].exit_noise. "
            "shm_left_<delivery>: /dev/shm entries that appeared during the run and were "
            "still there once every process was gone (removed after being counted, unless a "
            "live process maps them). parameters.runs[].shutdown_warnings: "
            "WARNING/ERROR log lines between the signal and the exit report (the signal "
            "guard logs each signal an engine process ignored).",
            f"Runs: rounds of one run per delivery (order rotated), at most {runs} per "
            f"delivery, none started past a {budget_s:g} s budget; a 2-CPU machine shared "
            "with other work moves every figure here (the engine's teardown is CPU-bound).",
        ],
    )


def run(runs: int = RUNS, budget_s: float = TIME_BUDGET_S,
        deliveries: Sequence[str] = DELIVERIES) -> Result:
    from tests.integration.vllm.tiny_model import build_tiny_llama  # needs torch

    with tempfile.TemporaryDirectory(prefix="quiesce-bench-shutdown-") as tmp:
        model = build_tiny_llama(Path(tmp) / "tiny-llama")
        done = measure(model, deliveries, runs, budget_s)
    return build_result(done, deliveries, runs, budget_s,
                        "tiny random-weight Llama from tests/integration/vllm/tiny_model.py "
                        f"(served in {DTYPE}, max_model_len {MAX_MODEL_LEN})")


HEADLINE = tuple(f"exit_after_drained_s_{d}" for d in DELIVERIES) + tuple(
    f"lost_streams_{d}" for d in DELIVERIES) + tuple(f"exit_noise_lines_{d}" for d in DELIVERIES)
