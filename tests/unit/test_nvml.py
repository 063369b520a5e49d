"""The NVML GPU-activity wrapper (quiesce.adapters.nvml).

Most tests drive the probe with ``FakeNvml``, a FAKE stand-in for the ``pynvml`` module
(this machine has no NVIDIA GPU or driver): it answers the handful of calls the probe
makes with figures the test sets, and fails on demand. The real thing on an H200 is
covered by tests/gpu/test_nvml.py. The last tests use the REAL ``pynvml`` installed here,
where the driver is missing, and prove the probe answers UNKNOWN with NVML's own error.
"""

from __future__ import annotations

import asyncio
import ctypes.util
import logging
import threading
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from quiesce import UNKNOWN, ConfigError, PendingWork, Probe, Role, Verdict
from quiesce.adapters.nvml import (
    GPU_ACTIVE_QUEUE,
    SOURCE,
    GpuQuietProbe,
    GpuQuietThresholds,
    parse_devices,
    require_gpu_quiet,
)
from quiesce.adapters.nvml import calls as nvml_calls
from quiesce.adapters.nvml import probe as nvml_probe
from quiesce.budget import Deadline
from quiesce.drain import DrainConfig, StageOutcome, wait_quiescent
from quiesce.errors import EngineNotInstalled

WINDOW = 0.01  # short windows keep the suite fast; the figures come from the fake


class FakeNvmlError(Exception):
    """Mimics pynvml.NVMLError: an error code in ``value`` and NVML's text in str()."""

    TEXT: ClassVar[dict[int, str]] = {3: "Not Supported", 9: "Driver Not Loaded",
                                      999: "Unknown Error"}

    def __init__(self, value: int) -> None:
        super().__init__(self.TEXT.get(value, f"NVML Error with code {value}"))
        self.value = value


class FakeNvml:
    """A FAKE pynvml: per-device figures and failures set by the test; every call logged."""

    NVMLError = FakeNvmlError
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3

    def __init__(self, count: int = 2) -> None:
        self.count = count
        self.calls: list[str] = []
        self.threads: set[str] = set()
        self.util = dict.fromkeys(range(count), 0)
        self.pcie_kb_s = dict.fromkeys(range(count), (8, 8))  # (tx, rx) in KB/s
        self.nvlink_kib = {i: [1_000, 2_000] for i in range(count)}  # cumulative (tx, rx)
        self.nvlink_step_kib = dict.fromkeys(range(count), (0, 0))  # added per counter read
        self.nvlink_status = dict.fromkeys(range(count), 0)
        self.fail: dict[str, Exception] = {}  # call name (or "name:index") -> raised
        self.block: threading.Event | None = None  # when set: utilisation blocks on it

    def _enter(self, name: str, index: int | None = None) -> None:
        self.calls.append(name)
        self.threads.add(threading.current_thread().name)
        for key in (name, f"{name}:{index}"):
            if key in self.fail:
                raise self.fail[key]

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._enter("nvmlDeviceGetHandleByIndex", index)
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        self._enter("nvmlDeviceGetUtilizationRates", handle)
        if self.block is not None:
            self.block.wait(10)
        return SimpleNamespace(gpu=self.util[handle], memory=0)

    def nvmlDeviceGetPcieThroughput(self, handle: int, counter: int) -> int:
        self._enter("nvmlDeviceGetPcieThroughput", handle)
        return self.pcie_kb_s[handle][counter]

    def nvmlDeviceGetFieldValues(self, handle: int,
                                 fields: list[tuple[int, int]]) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetFieldValues", handle)
        out = []
        for direction, (field, scope) in enumerate(fields):
            assert scope == 0xFFFFFFFF, "NVLink counters are read summed over every link"
            self.nvlink_kib[handle][direction] += self.nvlink_step_kib[handle][direction]
            out.append(SimpleNamespace(
                fieldId=field, nvmlReturn=self.nvlink_status[handle], valueType=3,
                value=SimpleNamespace(ullVal=self.nvlink_kib[handle][direction])))
        return out


class StaticProbe(Probe):
    """A fake inner (engine) probe with a fixed answer; counts its reads."""

    def __init__(self, answer: PendingWork | None = None) -> None:
        super().__init__(Role.AGGREGATED, "engine")
        self.answer = answer or PendingWork.idle(Role.AGGREGATED, "engine")
        self.reads = 0

    async def pending_work(self) -> PendingWork:
        self.reads += 1
        return self.answer


def wrap(fake: Any, devices: tuple[int, ...] = (0, 1), **kwargs: Any) -> GpuQuietProbe:
    kwargs.setdefault("window_s", WINDOW)
    return GpuQuietProbe(StaticProbe(), devices, nvml=fake, **kwargs)


async def read(fake: Any, devices: tuple[int, ...] = (0, 1), **kwargs: Any) -> PendingWork:
    probe = wrap(fake, devices, **kwargs)
    try:
        return await probe.pending_work()
    finally:
        await probe.aclose()


# -- quiet and busy ---------------------------------------------------------------------


async def test_quiet_gpu_keeps_the_inner_quiet_verdict_and_shows_the_figures() -> None:
    fake = FakeNvml()
    work = await read(fake)
    assert work.verdict is Verdict.QUIESCENT
    assert work.queues[GPU_ACTIVE_QUEUE] == 0
    assert work.waiting == 0 and work.engine_has_work is False  # the inner snapshot's
    assert work.source == f"engine+{SOURCE}"
    for i in (0, 1):
        assert work.details[f"{SOURCE}.gpu{i}.sm_util_pct"] == 0
        assert work.details[f"{SOURCE}.gpu{i}.pcie_rx_mb_s"] == round(8 * 1024 / 1e6, 3)
        assert work.details[f"{SOURCE}.gpu{i}.nvlink_tx_mb_s"] == 0
    assert {"nvmlInit", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPcieThroughput",
            "nvmlDeviceGetFieldValues"} <= set(fake.calls)


async def test_busy_sm_makes_a_quiet_worker_busy_with_the_figure_in_the_reason() -> None:
    fake = FakeNvml()
    fake.util[1] = 80
    work = await read(fake)
    assert work.verdict is Verdict.BUSY
    assert work.queues[GPU_ACTIVE_QUEUE] == 1
    assert work.details[f"{SOURCE}.busy"] == "gpu 1: SM 80.0% > 5%"


async def test_busy_pcie_makes_a_quiet_worker_busy() -> None:
    fake = FakeNvml()
    fake.pcie_kb_s[0] = (8, 2_000_000)  # ~2 GB/s into the GPU
    work = await read(fake)
    assert work.verdict is Verdict.BUSY
    assert work.details[f"{SOURCE}.busy"] == "gpu 0: PCIe rx 2048.0 MB/s > 50 MB/s"


async def test_busy_nvlink_counts_bytes_moved_during_the_window() -> None:
    fake = FakeNvml()
    fake.nvlink_step_kib[1] = (1_000_000, 0)  # 1 GiB sent between the two reads
    work = await read(fake)
    assert work.verdict is Verdict.BUSY
    assert str(work.details[f"{SOURCE}.busy"]).startswith("gpu 1: NVLink tx ")
    assert float(work.details[f"{SOURCE}.gpu1.nvlink_tx_mb_s"]) > 50
    assert work.details[f"{SOURCE}.gpu0.nvlink_tx_mb_s"] == 0


async def test_figures_at_the_threshold_are_quiet_and_above_are_busy() -> None:
    fake = FakeNvml(count=1)
    fake.util[0] = 5
    assert (await read(fake, (0,))).verdict is Verdict.QUIESCENT
    fake.util[0] = 6
    assert (await read(fake, (0,))).verdict is Verdict.BUSY


async def test_a_channel_set_to_none_is_neither_read_nor_required() -> None:
    fake = FakeNvml()
    fake.nvlink_status[0] = 3  # would be "Not Supported"
    fake.util[0] = 100
    work = await read(fake, thresholds=GpuQuietThresholds(sm_util_pct=None, nvlink_mb_s=None))
    assert work.verdict is Verdict.QUIESCENT
    assert "nvmlDeviceGetFieldValues" not in fake.calls
    assert "nvmlDeviceGetUtilizationRates" not in fake.calls


@pytest.mark.parametrize("answer", [
    PendingWork(role=Role.AGGREGATED, source="engine", waiting=0, running=3),
    PendingWork.unknown(Role.AGGREGATED, "engine", "engine core did not answer"),
], ids=["busy", "unknown"])
async def test_inner_not_quiet_is_returned_unchanged_without_touching_nvml(
        answer: PendingWork) -> None:
    fake = FakeNvml()
    probe = GpuQuietProbe(StaticProbe(answer), (0,), nvml=fake, window_s=WINDOW)
    work = await probe.pending_work()
    await probe.aclose()
    assert work is answer
    assert fake.calls == []


# -- every error path is UNKNOWN with a reason ------------------------------------------


def reasons(work: PendingWork) -> str:
    return " | ".join(work.reasons)


@pytest.mark.parametrize("fail,expected", [
    ({"nvmlInit": FakeNvmlError(9)}, "nvmlInit failed: FakeNvmlError (NVML error 9): Driver "
                                     "Not Loaded"),
    ({"nvmlDeviceGetCount": FakeNvmlError(999)}, "opening devices (0, 1) failed: FakeNvmlError"),
    ({"nvmlDeviceGetHandleByIndex:1": FakeNvmlError(999)}, "opening devices (0, 1) failed"),
    ({"nvmlDeviceGetUtilizationRates:0": FakeNvmlError(999)},
     "gpu 0: utilisation: FakeNvmlError (NVML error 999): Unknown Error"),
    ({"nvmlDeviceGetPcieThroughput:1": FakeNvmlError(3)},
     "gpu 1: PCIe throughput: FakeNvmlError (NVML error 3): Not Supported"),
    ({"nvmlDeviceGetFieldValues:0": RuntimeError("boom")},
     "gpu 0: NVLink counters: RuntimeError: boom"),
    ({"nvmlDeviceGetUtilizationRates": AttributeError("no attribute 'gpu'")},
     "utilisation: AttributeError: no attribute 'gpu'"),
], ids=["driver-missing", "count", "handle", "utilisation", "pcie", "fieldvalues",
        "attribute"])
async def test_nvml_failures_are_unknown_with_nvmls_reason(
        fail: dict[str, Exception], expected: str) -> None:
    fake = FakeNvml()
    fake.fail.update(fail)
    work = await read(fake)
    assert work.verdict is Verdict.UNKNOWN
    assert work.queues[GPU_ACTIVE_QUEUE] is UNKNOWN
    assert expected in reasons(work)


async def test_nvlink_not_supported_is_unknown_and_says_how_to_opt_out() -> None:
    fake = FakeNvml()
    fake.nvlink_status[1] = 3
    work = await read(fake)
    assert work.verdict is Verdict.UNKNOWN
    assert "gpu 1: NVLink tx counter: FakeNvmlError (NVML error 3): Not Supported" \
        in reasons(work)
    assert "nvlink_mb_s=None" in reasons(work)


async def test_a_device_index_nvml_does_not_have_is_unknown() -> None:
    fake = FakeNvml(count=2)
    work = await read(fake, (0, 2))
    assert work.verdict is Verdict.UNKNOWN
    assert "device index 2 out of range: NVML sees 2 device(s)" in reasons(work)
    assert fake.calls[-1] == "nvmlShutdown"  # a failed start does not keep NVML open


async def test_nvlink_counter_going_backwards_is_unknown() -> None:
    fake = FakeNvml(count=1)
    fake.nvlink_step_kib[0] = (-10, 0)
    work = await read(fake, (0,))
    assert work.verdict is Verdict.UNKNOWN
    assert "NVLink tx counter went backwards" in reasons(work)


async def test_missing_pynvml_is_unknown_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def absent() -> Any:
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(nvml_calls, "_load_pynvml", absent)
    probe = GpuQuietProbe(StaticProbe(), (0,), window_s=WINDOW)
    work = await probe.pending_work()
    await probe.aclose()
    assert work.verdict is Verdict.UNKNOWN
    assert "pynvml is not installed" in reasons(work)
    assert "pip install 'quiesce[nvml]'" in reasons(work)


async def test_a_hung_nvml_call_times_out_and_later_reads_do_not_queue_behind_it() -> None:
    fake = FakeNvml()
    fake.block = threading.Event()
    probe = wrap(fake, call_timeout_s=0.05)
    try:
        first = await probe.pending_work()
        assert first.verdict is Verdict.UNKNOWN
        assert "NVML did not answer within 0.050s (device activity)" in reasons(first)
        second = await probe.pending_work()
        assert second.verdict is Verdict.UNKNOWN
        assert "an NVML call has not returned for" in reasons(second)
    finally:
        fake.block.set()
        await probe.aclose()


async def test_one_device_failing_and_another_busy_is_busy() -> None:
    fake = FakeNvml()
    fake.fail["nvmlDeviceGetUtilizationRates:0"] = FakeNvmlError(999)
    fake.util[1] = 50
    work = await read(fake)
    assert work.verdict is Verdict.BUSY  # busy wins: known activity is activity
    assert work.queues[GPU_ACTIVE_QUEUE] == 1
    assert "gpu 0: utilisation" in reasons(work)


async def test_one_device_failing_and_another_quiet_is_unknown() -> None:
    fake = FakeNvml()
    fake.fail["nvmlDeviceGetPcieThroughput:1"] = FakeNvmlError(999)
    assert (await read(fake)).verdict is Verdict.UNKNOWN


# -- lifecycle: init once, off the loop, shared samples, close -------------------------


async def test_nvml_is_initialised_once_used_off_the_loop_and_shut_down_on_close() -> None:
    fake = FakeNvml()
    probe = wrap(fake)
    for _ in range(3):
        assert (await probe.pending_work()).verdict is Verdict.QUIESCENT
    assert fake.calls.count("nvmlInit") == 1
    assert fake.threads and threading.current_thread().name not in fake.threads
    await probe.aclose()
    await probe.aclose()  # idempotent
    assert fake.calls.count("nvmlShutdown") == 1
    closed = await probe.pending_work()
    assert closed.verdict is Verdict.UNKNOWN
    assert "the NVML probe is closed" in reasons(closed)


async def test_a_failed_init_is_retried_on_the_next_read() -> None:
    fake = FakeNvml()
    fake.fail["nvmlInit"] = FakeNvmlError(9)
    probe = wrap(fake)
    assert (await probe.pending_work()).verdict is Verdict.UNKNOWN
    del fake.fail["nvmlInit"]
    assert (await probe.pending_work()).verdict is Verdict.QUIESCENT
    await probe.aclose()


async def test_concurrent_reads_share_one_sample() -> None:
    fake = FakeNvml()
    probe = wrap(fake, window_s=0.05)
    works = await asyncio.gather(*(probe.pending_work() for _ in range(4)))
    await probe.aclose()
    assert all(w.verdict is Verdict.QUIESCENT for w in works)
    assert fake.calls.count("nvmlDeviceGetUtilizationRates") == 2  # one sample, two devices


async def test_failures_are_logged_once_and_recovery_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNvml()
    fake.fail["nvmlInit"] = FakeNvmlError(9)
    probe = wrap(fake)
    with caplog.at_level(logging.INFO, logger="quiesce.adapters.nvml"):
        await probe.pending_work()
        await probe.pending_work()
        del fake.fail["nvmlInit"]
        await probe.pending_work()
    await probe.aclose()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("GPU activity unknown" in m for m in messages) == 1
    assert any("readable again" in m for m in messages)


async def test_check_reports_whether_every_device_answers() -> None:
    fake = FakeNvml()
    probe = wrap(fake)
    assert await probe.check() is None
    fake.fail["nvmlDeviceGetPcieThroughput:0"] = FakeNvmlError(3)
    assert "gpu 0: PCIe throughput" in str(await probe.check())
    await probe.aclose()


async def test_the_drain_waits_for_the_gpu_after_the_engine_is_quiet() -> None:
    """Through the real drain wait: the engine is idle at once, the GPU for a few reads
    still moves bytes (a transfer the engine did not report); drained only afterwards."""
    fake = FakeNvml(count=1)
    fake.pcie_kb_s[0] = (5_000_000, 8)
    probe = wrap(fake, (0,))
    seen: list[Verdict] = []

    def progress(work: PendingWork) -> None:
        seen.append(work.verdict)
        if len(seen) == 3:
            fake.pcie_kb_s[0] = (8, 8)  # the transfer ends

    report, last = await wait_quiescent(probe, Deadline.after(30), DrainConfig(),
                                        on_progress=progress)
    await probe.aclose()
    assert seen[:3] == [Verdict.BUSY] * 3
    assert report.outcome is StageOutcome.COMPLETED
    assert last.verdict is Verdict.QUIESCENT


async def test_wait_for_change_uses_the_inner_notifier_only_while_it_decides() -> None:
    class Notifying(StaticProbe):
        def __init__(self) -> None:
            super().__init__()
            self.waits = 0

        async def wait_for_change(self, after: PendingWork, timeout: float) -> None:
            self.waits += 1

    inner = Notifying()
    probe = GpuQuietProbe(inner, (0,), nvml=FakeNvml(), window_s=WINDOW)
    busy = PendingWork(role=Role.AGGREGATED, source="engine", waiting=1, running=0)
    await probe.wait_for_change(busy, 0.001)
    assert inner.waits == 1
    gpu_busy = await probe.pending_work()  # merged: its parts include the GPU part
    await probe.wait_for_change(gpu_busy, 0.001)
    assert inner.waits == 1
    await probe.aclose()


# -- configuration ----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,field", [
    ({"sm_util_pct": -1}, "sm_util_pct"),
    ({"sm_util_pct": 100}, "sm_util_pct"),
    ({"sm_util_pct": True}, "sm_util_pct"),
    ({"pcie_mb_s": float("nan")}, "pcie_mb_s"),
    ({"pcie_mb_s": "50"}, "pcie_mb_s"),
    ({"nvlink_mb_s": float("inf")}, "nvlink_mb_s"),
    ({"sm_util_pct": None, "pcie_mb_s": None, "nvlink_mb_s": None}, "thresholds"),
])
def test_bad_thresholds_raise_config_error_naming_the_field(
        kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        GpuQuietThresholds(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize("kwargs,field", [
    ({"devices": ()}, "devices"),
    ({"devices": (0, 0)}, "devices"),
    ({"devices": (-1,)}, "devices"),
    ({"devices": "0,x"}, "devices"),
    ({"window_s": 0}, "window_s"),
    ({"window_s": 60}, "window_s"),
    ({"call_timeout_s": -1}, "call_timeout_s"),
    ({"thresholds": {"sm_util_pct": 5}}, "thresholds"),
    ({"inner": object()}, "inner"),
])
def test_bad_probe_arguments_raise_before_any_nvml_call(
        kwargs: dict[str, Any], field: str) -> None:
    fake = FakeNvml()
    args: dict[str, Any] = {"inner": StaticProbe(), "devices": (0,), "nvml": fake, **kwargs}
    with pytest.raises(ConfigError) as info:
        GpuQuietProbe(**args)
    assert info.value.field == field
    assert fake.calls == []


@pytest.mark.parametrize("spec,expected", [("0", (0,)), ("0,1", (0, 1)), (" 3 , 1 ", (3, 1)),
                                           ([2], (2,))])
def test_parse_devices(spec: Any, expected: tuple[int, ...]) -> None:
    assert parse_devices(spec) == expected


@pytest.mark.parametrize("spec", ["", "0,", "a", "0;1", "1,1", "-1", "0.5"])
def test_the_cli_option_rejects_bad_device_lists(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        require_gpu_quiet(StaticProbe(), spec)
    assert info.value.field == "require_gpu_quiet"


def test_the_factory_refuses_a_read_longer_than_the_drains_probe_timeout() -> None:
    with pytest.raises(ConfigError) as info:
        require_gpu_quiet(StaticProbe(), "0", window_s=0.5, call_timeout_s=0.3,
                          probe_timeout_s=1.0)
    assert info.value.field == "window_s"
    probe = require_gpu_quiet(StaticProbe(), "0,1", probe_timeout_s=1.0)
    assert probe.devices == (0, 1) and probe.max_read_s < 1.0
    assert probe.source == f"engine+{SOURCE}" and probe.role is Role.AGGREGATED


def test_the_factory_names_the_extra_when_pynvml_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml_probe, "_pynvml_installed", lambda: False)
    with pytest.raises(EngineNotInstalled, match=r"pip install 'quiesce\[nvml\]'"):
        require_gpu_quiet(StaticProbe(), "0")


# -- the REAL pynvml, on this machine without an NVIDIA driver --------------------------


def _real_init_error() -> str:
    """NVML's own error for nvmlInit here; skips where a driver answers (a GPU machine)."""
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is in the dev extra")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return str(exc)
    pynvml.nvmlShutdown()
    pytest.skip("an NVIDIA driver answers here: tests/gpu/test_nvml.py reads the real GPU")


async def test_real_pynvml_without_a_driver_is_unknown_with_nvmls_own_error() -> None:
    nvml_error = _real_init_error()
    assert nvml_error  # e.g. "NVML Shared Library Not Found" (no libnvidia-ml.so.1 here)
    probe = require_gpu_quiet(StaticProbe(), "0")  # the real module, found on the path
    work = await probe.pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert work.is_quiescent is False
    assert "nvmlInit failed: NVMLError" in reasons(work)
    assert nvml_error in reasons(work)
    assert await probe.check() is not None
    await probe.aclose()


def test_this_machine_really_has_no_nvml_library() -> None:
    """Guards the test above: it exercises the real error path only where NVML is absent."""
    if ctypes.util.find_library("nvidia-ml") is not None:
        pytest.skip("libnvidia-ml is installed here: the real-GPU suite covers this machine")
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is in the dev extra")
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        pynvml.nvmlInit()
