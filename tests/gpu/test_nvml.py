"""The NVML GPU-activity signal on a real H200 (quiesce.adapters.nvml).

Run by ``ci/gpu/vllm.sh`` (its environment has the CUDA torch that makes the GPU busy)
and skipped, with the reason, where there is no GPU, no ``pynvml`` or no GPU of the
expected class (tests/gpu/conftest.py; ``QUIESCE_GPU_CLASS``). The unit tests drive the
probe with a fake NVML; here the real driver answers:

- an idle device reads as known (quiet, or busy with the figures that say why), with
  every channel read; its figures and the cost of each NVML call are recorded as JUnit
  properties (``ci/gpu/results/nvml.xml``): the numbers behind the default thresholds;
- a device running matmuls and host-to-device copies reads BUSY with SM (and, in at
  least one of a few reads, PCIe) above the thresholds;
- the drain's wait (``wait_quiescent``) with an engine side that already says quiet ends
  only after a GPU load has ended: the GPU alone holds the drain;
- a device index NVML does not have is UNKNOWN with the reason, on the real driver.
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from quiesce import PendingWork, Probe, Role, Verdict
from quiesce.adapters.nvml import GPU_ACTIVE_QUEUE, SOURCE, GpuQuietProbe, GpuQuietThresholds
from quiesce.budget import Deadline
from quiesce.drain import DrainConfig, wait_quiescent
from tests.gpu.conftest import GpuDevice, StartEngine

REQUIRES = ("pynvml",)

RecordProperty = Callable[[str, object], None]  # pytest's record_property fixture


class IdleEngine(Probe):
    """The engine side says quiet: what the GPU shows decides."""

    def __init__(self) -> None:
        super().__init__(Role.AGGREGATED, "idle-engine")

    async def pending_work(self) -> PendingWork:
        return PendingWork.idle(self.role, self.source)


async def read_once(probe: GpuQuietProbe) -> tuple[PendingWork, float]:
    start = time.perf_counter()
    work = await probe.pending_work()
    return work, time.perf_counter() - start


def nvlink_unsupported(work: PendingWork) -> bool:
    return bool(work.errors) and all("NVLink" in e and "Not Supported" in e for e in work.errors)


async def test_an_idle_h200_reads_as_known_with_every_channel(
        gpu: GpuDevice, record_property: RecordProperty) -> None:
    record_property("gpu", f"{gpu.index}: {gpu.name} (driver {gpu.driver})")
    thresholds = GpuQuietThresholds()
    probe = GpuQuietProbe(IdleEngine(), (gpu.index,), thresholds=thresholds)
    try:
        work, first_s = await read_once(probe)  # includes nvmlInit
        if nvlink_unsupported(work):
            record_property("nvlink", "not supported on this device: read without it")
            await probe.aclose()
            thresholds = GpuQuietThresholds(nvlink_mb_s=None)
            probe = GpuQuietProbe(IdleEngine(), (gpu.index,), thresholds=thresholds)
            work, first_s = await read_once(probe)
        reads = [await read_once(probe) for _ in range(10)]
    finally:
        await probe.aclose()
    print(work.summary(), dict(work.details))
    assert work.verdict is not Verdict.UNKNOWN, work.reasons
    last = reads[-1][0]
    assert last.verdict is not Verdict.UNKNOWN, last.reasons
    figures = {k.removeprefix(f"{SOURCE}.gpu{gpu.index}."): v for k, v in last.details.items()
               if k.startswith(f"{SOURCE}.gpu{gpu.index}.")}
    expected = {"sm_util_pct", "pcie_tx_mb_s", "pcie_rx_mb_s"}
    if thresholds.nvlink_mb_s is not None:
        expected |= {"nvlink_tx_mb_s", "nvlink_rx_mb_s"}
    assert expected <= set(figures), figures
    for name, value in figures.items():
        record_property(f"idle.{name}", value)
    record_property("idle.verdict", last.verdict.value)
    record_property("read_s.first", round(first_s, 4))
    record_property("read_s.median", round(statistics.median(s for _, s in reads), 4))
    record_property("read_s.max", round(max(s for _, s in reads), 4))


def test_the_cost_of_each_nvml_call(gpu: GpuDevice, record_property: RecordProperty) -> None:
    """Measured, not asserted: the per-call costs the module docstring expects."""
    import pynvml  # type: ignore[import-untyped, import-not-found, unused-ignore]

    start = time.perf_counter()
    pynvml.nvmlInit()
    record_property("cost_s.nvmlInit", round(time.perf_counter() - start, 5))
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu.index)
        calls: dict[str, Callable[[], Any]] = {
            "utilization": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle),
            "pcie_tx": lambda: pynvml.nvmlDeviceGetPcieThroughput(
                handle, pynvml.NVML_PCIE_UTIL_TX_BYTES),
            "nvlink_fields": lambda: pynvml.nvmlDeviceGetFieldValues(handle, [
                (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF),
                (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 0xFFFFFFFF)]),
        }
        results: dict[str, Any] = {}
        for name, call in calls.items():
            times = []
            for _ in range(10):
                t = time.perf_counter()
                results[name] = call()
                times.append(time.perf_counter() - t)
            record_property(f"cost_s.{name}.median", round(statistics.median(times), 6))
            record_property(f"cost_s.{name}.max", round(max(times), 6))
        assert 0 <= results["utilization"].gpu <= 100
        assert results["pcie_tx"] >= 0
    finally:
        pynvml.nvmlShutdown()


LOAD = r"""
import sys, time
import torch
stop_at = time.monotonic() + float(sys.argv[1])
dev = torch.device("cuda:0")
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
host = torch.empty(256 * 1024 * 1024, dtype=torch.uint8).pin_memory()
dst = torch.empty_like(host, device=dev)
side = torch.cuda.Stream()
print("ready", flush=True)
while time.monotonic() < stop_at:
    with torch.cuda.stream(side):
        for _ in range(4):
            dst.copy_(host, non_blocking=True)  # host -> device over PCIe
    for _ in range(10):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


async def start_load(gpu: GpuDevice, engine_process: StartEngine, tmp_path: Path,
                     seconds: float) -> Any:
    """:data:`LOAD` on ``gpu`` for ``seconds`` (stopped at the test's end if still
    running), once NVML's utilisation sample can see its kernels; skips without torch."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the GPU load needs torch with CUDA, not installed here")
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    load = engine_process("gpu-load", [sys.executable, str(script), str(seconds)],
                          env={"CUDA_VISIBLE_DEVICES": gpu.uuid})
    load.wait_until(lambda: "ready" in load.tail(), 120, "the load's ready line")
    await asyncio.sleep(1.0)  # let NVML's utilisation sample period see the kernels
    return load


async def test_a_busy_h200_reads_busy(gpu: GpuDevice, engine_process: StartEngine,
                                      tmp_path: Path, record_property: RecordProperty) -> None:
    await start_load(gpu, engine_process, tmp_path, 120)
    probe = GpuQuietProbe(IdleEngine(), (gpu.index,),
                          thresholds=GpuQuietThresholds(nvlink_mb_s=None))
    try:
        works = [(await read_once(probe))[0] for _ in range(5)]
    finally:
        await probe.aclose()
    for i, work in enumerate(works):
        record_property(f"busy.read{i}", str(work.details.get(f"{SOURCE}.busy", "")))
    assert all(w.verdict is Verdict.BUSY for w in works), [w.summary() for w in works]
    assert all(w.queues[GPU_ACTIVE_QUEUE] == 1 for w in works)
    assert all("SM " in str(w.details[f"{SOURCE}.busy"]) for w in works)
    assert any("PCIe " in str(w.details[f"{SOURCE}.busy"]) for w in works), \
        [w.details for w in works]


async def test_a_drain_waits_until_the_gpu_load_has_ended(
        gpu: GpuDevice, engine_process: StartEngine, tmp_path: Path,
        record_property: RecordProperty) -> None:
    """The engine side says quiet from the start; only the GPU's activity holds the drain."""
    load = await start_load(gpu, engine_process, tmp_path, 8)
    probe = GpuQuietProbe(IdleEngine(), (gpu.index,),
                          thresholds=GpuQuietThresholds(nvlink_mb_s=None))
    busy: list[PendingWork] = []
    config = DrainConfig(router_grace_s=0, poll_base_s=0.05, poll_cap_s=0.5, probe_timeout_s=5)
    try:
        report, last = await wait_quiescent(
            probe, Deadline.after(120), config,
            on_progress=lambda w: busy.append(w) if w.verdict is Verdict.BUSY else None)
    finally:
        await probe.aclose()
    record_property("drain.busy_reads", len(busy))
    record_property("drain.waited_s", round(report.elapsed_s, 2))
    assert last.verdict is Verdict.QUIESCENT, (report, last.summary())
    assert busy, "the drain never saw the GPU load"
    assert not load.alive(), "the drain ended while the GPU load was still running"


async def test_a_device_index_nvml_does_not_have_is_unknown_on_the_real_driver(
        gpu: GpuDevice) -> None:
    probe = GpuQuietProbe(IdleEngine(), (gpu.count,))
    try:
        work = await probe.pending_work()
    finally:
        await probe.aclose()
    assert work.verdict is Verdict.UNKNOWN
    assert f"device index {gpu.count} out of range" in "; ".join(work.reasons)
