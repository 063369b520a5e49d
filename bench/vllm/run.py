"""The run: every phase on one engine, then the comparisons that need more.

:func:`run` prepares the environment, builds the tiny model and starts the pinned engine
for phases 1-4 (:class:`~bench.vllm.measured.Measured`, with the other processes' CPU
share per phase); when time allows, a second engine in vLLM's default binding repeats
phase 3 (:class:`~bench.vllm.measured.Unpinned`); last, :mod:`bench.vllm.publish`
measures the board's cost inside EngineCore in a child process.
:func:`bench.vllm.result.result` turns it into the Result.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.results_format import Result
from bench.vllm.busy import busy
from bench.vllm.detection import detect
from bench.vllm.engine import (
    REPO,
    UNPINNED,
    WORKER_CPUS_ENV,
    cpu_sample,
    generate,
    log,
    other_load,
    prepare_environment,
    probes,
    release,
    settle,
    start_engine,
)
from bench.vllm.idle import idle
from bench.vllm.measured import Measured, Unpinned
from bench.vllm.result import result
from bench.vllm.throughput import THROUGHPUT_ROUNDS, UNPINNED_ROUNDS, throughput
from quiesce import Role
from quiesce.adapters.vllm import VllmProbe

SECOND_ENGINE_BEFORE_S = 120.0
"""The unpinned comparison (a second engine start) runs only if the main measurements
ended within this many seconds, to keep the benchmark within about 4 minutes."""


async def _phases(llm: Any, release_dir: Path, startup: float,
                  load_before: tuple[float, float, float]) -> Measured:
    by_variant = probes(llm)
    board = by_variant["board"]
    await generate(llm, 16)  # warm the engine and the plugin path
    await settle(board, release_dir)
    for name, probe in by_variant.items():
        first = await probe.pending_work()
        signals = {v for k, v in first.details.items() if k.endswith("signal")}
        expected = {"board": "board", "snapshot": "quiesce_snapshot", "has_work": "has_work"}
        if signals != {expected[name]} or not first.is_quiescent:
            raise RuntimeError(f"the {name} probe did not answer on its own path: "
                               f"{first.summary()} ({board.board_off})")
    other_loads: dict[str, float] = {}
    mark = cpu_sample()

    def phase(name: str, what: str) -> None:
        nonlocal mark
        now = cpu_sample()
        other_loads[name] = other_load(mark, now)
        log(f"{what} ({now.at - mark.at:.1f}s, other processes used "
            f"{other_loads[name]:.0%} of the CPUs)")
        mark = now

    idle_samples = await idle(llm, by_variant)
    phase("idle", "idle reads done")
    busy_samples = await busy(llm, by_variant)
    await settle(board, release_dir)
    phase("busy", f"busy reads done, {busy_samples.waves} waves")
    rounds = await throughput(llm, board, THROUGHPUT_ROUNDS)
    await settle(board, release_dir)
    phase("throughput", "throughput rounds done")
    drains = await detect(llm, release_dir, True, 3)
    snapshot_drains = await detect(llm, release_dir, False, 4)
    phase("detection", "detection drains done")
    return Measured(idle_samples, busy_samples, rounds, drains, snapshot_drains, startup,
                    load_before, os.getloadavg(), other_loads)


async def _measure(model: Path, release_dir: Path) -> Measured:
    release(release_dir)  # phases 1-3: finished requests' KV is freed on the next step
    load_before = os.getloadavg()
    started = time.monotonic()
    llm = start_engine(model, release_dir)
    try:
        startup = time.monotonic() - started
        log(f"engine started in {startup:.1f}s")
        return await _phases(llm, release_dir, startup, load_before)
    finally:
        llm.shutdown()
        # vLLM keeps a frame of the engine's start-up alive, and through it this frame:
        # drop the reference, or AsyncLLM.__del__ runs during interpreter teardown.
        del llm


async def _unpinned(model: Path, release_dir: Path) -> Unpinned:
    os.environ[WORKER_CPUS_ENV] = UNPINNED
    release(release_dir)
    started = time.monotonic()
    llm = start_engine(model, release_dir)
    try:
        startup = time.monotonic() - started
        probe = VllmProbe(llm, Role.PREFILL)
        await generate(llm, 16)
        await settle(probe, release_dir)
        before = cpu_sample()
        rounds = await throughput(llm, probe, UNPINNED_ROUNDS)
        other = other_load(before, cpu_sample())
        log(f"unpinned throughput rounds done (engine started in {startup:.1f}s, other "
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
        log("the worker was not pinned: no unpinned comparison")
    elif time.monotonic() - started > SECOND_ENGINE_BEFORE_S:
        log("no time left for the unpinned comparison (the machine is slow now)")
    else:
        measured.unpinned = await _unpinned(model, release_dir)
    return measured


def _publish_cost(model: Path, release_dir: Path) -> dict[str, float]:
    """:mod:`bench.vllm.publish` in a child process (an in-process EngineCore)."""
    release(release_dir)
    done = subprocess.run([sys.executable, "-m", "bench.vllm.publish", str(model),
                           str(release_dir)], capture_output=True, text=True, timeout=600,
                          cwd=REPO, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"bench.vllm.publish failed ({done.returncode}): "
                           f"{done.stderr[-2000:]}")
    cost: dict[str, float] = json.loads(lines[-1])
    log(f"publication cost measured: {cost}")
    return cost


def run() -> Result:
    prepare_environment()
    from tests.integration.vllm.tiny_model import build_tiny_llama

    with tempfile.TemporaryDirectory(prefix="quiesce-bench-vllm-") as tmp:
        model = build_tiny_llama(Path(tmp) / "tiny-llama")
        release_dir = Path(tmp) / "release"
        release_dir.mkdir()
        measured = asyncio.run(_measure_all(model, release_dir))
        gc.collect()  # finalize the engine now, not during interpreter teardown
        measured.publish_cost = _publish_cost(model, release_dir)
    return result(measured)
