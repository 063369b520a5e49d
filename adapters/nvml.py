"""NVML adapter: a corroborating GPU-activity signal that a drain can require to be quiet.

A KV transfer the engine forgot to report still moves bytes over PCIe or NVLink, and a
kernel the engine forgot still keeps the SMs busy. :class:`GpuQuietProbe` wraps a
worker's own probe and, only when that probe already says QUIESCENT, samples NVML (the
NVIDIA Management Library, through the ``pynvml`` module of ``nvidia-ml-py``) on the
devices the worker uses. It never makes a worker quiescent on its own:

- inner BUSY or UNKNOWN → the inner snapshot, unchanged (no NVML call at all);
- inner QUIESCENT and every watched device quiet → still QUIESCENT; the figures are in
  ``details`` (``nvml.gpu_activity.gpu<i>.*``) and the queue ``nvml.gpu_active`` is 0;
- inner QUIESCENT and a device above a threshold → BUSY: ``queues["nvml.gpu_active"]`` is
  the number of active devices and ``details["nvml.gpu_activity.busy"]`` says which
  figure crossed which threshold (e.g. ``gpu 1: PCIe rx 812.0 MB/s > 50 MB/s``);
- inner QUIESCENT and NVML cannot answer (``pynvml`` missing, no driver, a failing
  call, a device index NVML does not have, a channel a device does not support, a
  call past its timeout) → UNKNOWN: the queue is UNKNOWN and ``errors`` holds NVML's
  own message, e.g. ``nvmlInit failed: NVMLError_LibraryNotFound (NVML error 12): NVML
  Shared Library Not Found``. Fail closed: unknown is never quiet.

The combined snapshot is :meth:`PendingWork.merge` of the inner snapshot and the GPU
part, so the usual rules apply (busy wins, any error is unknown otherwise).

What it reads, per watched device, where, and what each costs
--------------------------------------------------------------
The cost figures for a real GPU below are **expected from NVML's documented behaviour,
not measured here** (this machine has no NVIDIA driver); ``tests/gpu/test_nvml.py``
measures them on the H200 and records them in its JUnit properties. Measured here,
against the real ``pynvml`` with no driver (2-core VM, 200 tries): a failed ``nvmlInit``
(library not found) costs about 20 µs (median; 0.16 ms at most), and a whole read on
that path, thread hop included, about 0.2 ms (median; p99 0.6 ms). It skips the window,
so the error path is cheap, and it is retried on every read.

- ``nvmlInit`` / ``nvmlDeviceGetCount`` / ``nvmlDeviceGetHandleByIndex`` — once, on
  the first read (retried on the next read after a failure). Loads
  ``libnvidia-ml.so.1`` and opens the driver: expected tens of ms, once. NVML counts
  its initialisations, so this is safe beside vLLM's or SGLang's own ``pynvml`` use in
  the same process. Missing: UNKNOWN ("nvmlInit failed: ...").
- **NVLink** (``nvlink_mb_s``): ``nvmlDeviceGetFieldValues`` with
  ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX``/``_RX`` summed over all links (scope
  ``UINT_MAX``), read at the start and at the end of the window; the figure is the
  byte-count difference over the window (data payload, KiB counters). Expected cost: a
  driver query, well under a millisecond. A device or link set without NVLink answers
  "Not Supported" per field: UNKNOWN, with the hint to set ``nvlink_mb_s=None``.
- **SM** (``sm_util_pct``): ``nvmlDeviceGetUtilizationRates(...).gpu`` at the end of
  the window: the percentage of time, over NVML's last sample period (1/6 s to 1 s
  depending on the product), during which at least one kernel ran. It is kernel
  activity, not SM occupancy. Expected cost: well under a millisecond.
- **PCIe** (``pcie_mb_s``): ``nvmlDeviceGetPcieThroughput`` for TX and RX at the end
  of the window: NVML samples the link over 20 ms per counter, so expect up to about
  20 ms per call, about 40 ms per device. It counts the link's traffic (DMA copies, RDMA
  into GPU memory, the driver's own traffic), in KB/s taken as KiB/s.

A read therefore costs the window (``window_s``, default 0.2 s, spent in
``asyncio.sleep`` on the loop) plus two bounded NVML batches (each at most
``call_timeout_s``, default 0.3 s) run in one dedicated worker thread, never on the
event loop: :attr:`GpuQuietProbe.max_read_s` (0.8 s by default) must stay below the
drain's ``probe_timeout_s`` (1 s by default), or the drain's own bound cuts the read
and reports UNKNOWN. The end batch reads every device in turn (~40 ms each, expected):
past about six devices raise ``call_timeout_s`` and the drain's ``probe_timeout_s``
with it. Concurrent reads (a drain and a status request) share one sample.
If an NVML call hangs past its timeout, the thread stays blocked: later reads answer
UNKNOWN at once ("an NVML call has not returned for ...") instead of queueing more.

What a sample can and cannot show
---------------------------------
It is corroboration, never proof. Kernel activity and link bytes include every process
on the device (another engine sharing the GPU, a monitoring agent), so a shared GPU can
keep a drain from ending (BUSY: pick the devices and thresholds accordingly). A
transfer shorter than the PCIe counters' 20 ms sample, or one that starts after the
window, is not seen; NVLink counters catch every byte inside the window. NVML device
indices are NVML's own (``nvidia-smi``'s), not positions in ``CUDA_VISIBLE_DEVICES``.

Methods (where each signal is read, what it costs, what missing means)
----------------------------------------------------------------------
- :meth:`GpuQuietProbe.pending_work` — reads the inner probe on the loop, then, only if
  it is QUIESCENT, one shared NVML sample (above). Cost: the inner read, plus
  :attr:`~GpuQuietProbe.max_read_s` at most (the window plus ~40 ms per device expected
  on a GPU). Missing NVML or a failing call: UNKNOWN with the reason; never raises for
  NVML (an inner probe that raises still raises, and :func:`~quiesce.probe.observe`
  turns that into UNKNOWN).
- :meth:`GpuQuietProbe.is_quiescent` — ``pending_work()`` is QUIESCENT; same cost.
- :meth:`GpuQuietProbe.wait_for_change` — while the inner probe decides (its snapshot was
  returned), waits on its notifier when it has one; while the GPU decides there is no
  event to wait for, so it sleeps ``timeout`` (the drain then reads again). No NVML call.
- :meth:`GpuQuietProbe.check` — one NVML sample on demand, without the inner probe, for a
  start-up log line: ``None`` when every device answers on every enabled channel, else
  the reason. Cost: one read (window included).
- :meth:`GpuQuietProbe.aclose` — ``nvmlShutdown`` in the NVML thread (if NVML was
  initialised; skipped, with a warning, while a call hangs), then the thread ends.
  Idempotent; later reads answer UNKNOWN ("closed").
- :func:`require_gpu_quiet` — the factory behind ``--require-gpu-quiet 0,1``: validates
  the option, needs ``pynvml`` importable (no NVML call), returns the wrapper.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib.util
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

from quiesce.budget import check_seconds
from quiesce.errors import ConfigError, EngineNotInstalled
from quiesce.probe import (
    UNKNOWN,
    ChangeNotifier,
    Count,
    Detail,
    PendingWork,
    Probe,
    QuiescenceProbe,
    Verdict,
)

__all__ = ["DEFAULT_CALL_TIMEOUT_S", "DEFAULT_WINDOW_S", "GPU_ACTIVE_QUEUE", "SOURCE",
           "DeviceActivity", "GpuQuietProbe", "GpuQuietThresholds", "parse_devices",
           "require_gpu_quiet"]

SOURCE: Final = "nvml.gpu_activity"
GPU_ACTIVE_QUEUE: Final = "nvml.gpu_active"
"""The queue in the combined snapshot: active devices (0 when quiet, UNKNOWN when unread)."""
DEFAULT_WINDOW_S: Final = 0.2
DEFAULT_CALL_TIMEOUT_S: Final = 0.3
MAX_WINDOW_S: Final = 10.0
_ALL_LINKS: Final = 0xFFFFFFFF  # NVML's scope id for "summed over every NVLink"
_MB: Final = 1_000_000.0
_KIB: Final = 1024.0
_INSTALL_HINT: Final = "pip install 'quiesce[nvml]'"

log = logging.getLogger("quiesce.adapters.nvml")
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class GpuQuietThresholds:
    """When a device counts as active. A figure strictly above its threshold is activity.

    ``None`` leaves a channel unread (and unrequired). Defaults: ``sm_util_pct=5``
    (kernel-active time; an idle engine shows 0), ``pcie_mb_s=50`` and ``nvlink_mb_s=50``
    per direction (idle links carry well under a MB/s of driver traffic; a KV transfer
    moves GB/s). They are starting points: calibrate on the machine with
    ``tests/gpu/test_nvml.py``, which records idle figures. Invalid values raise
    :class:`ConfigError` naming the field.
    """

    sm_util_pct: float | None = 5.0
    pcie_mb_s: float | None = 50.0
    nvlink_mb_s: float | None = 50.0

    def __post_init__(self) -> None:
        for field in ("sm_util_pct", "pcie_mb_s", "nvlink_mb_s"):
            value = getattr(self, field)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ConfigError(field, f"must be a finite number >= 0 or None, got {value!r}")
        if self.sm_util_pct is not None and self.sm_util_pct >= 100:
            raise ConfigError("sm_util_pct", f"must be below 100 (a percentage), "
                                             f"got {self.sm_util_pct!r}")
        if self.sm_util_pct is None and self.pcie_mb_s is None and self.nvlink_mb_s is None:
            raise ConfigError("thresholds", "every channel is None: nothing would be checked")


@dataclasses.dataclass(frozen=True)
class DeviceActivity:
    """What one device showed over a window; ``None`` for a channel that was not read."""

    index: int
    sm_util_pct: float | None = None
    pcie_tx_mb_s: float | None = None
    pcie_rx_mb_s: float | None = None
    nvlink_tx_mb_s: float | None = None
    nvlink_rx_mb_s: float | None = None

    def over(self, limits: GpuQuietThresholds) -> list[str]:
        """Readable descriptions of every figure above its threshold (empty: quiet)."""
        checks: list[tuple[str, float | None, float | None, str]] = [
            ("SM", self.sm_util_pct, limits.sm_util_pct, "%"),
            ("PCIe tx", self.pcie_tx_mb_s, limits.pcie_mb_s, " MB/s"),
            ("PCIe rx", self.pcie_rx_mb_s, limits.pcie_mb_s, " MB/s"),
            ("NVLink tx", self.nvlink_tx_mb_s, limits.nvlink_mb_s, " MB/s"),
            ("NVLink rx", self.nvlink_rx_mb_s, limits.nvlink_mb_s, " MB/s"),
        ]
        return [f"{name} {value:.1f}{unit} > {limit:g}{unit}"
                for name, value, limit, unit in checks
                if value is not None and limit is not None and value > limit]

    def details(self) -> dict[str, Detail]:
        """The figures that were read, keyed ``gpu<i>.<figure>``."""
        figures = dataclasses.asdict(self)
        figures.pop("index")
        return {f"gpu{self.index}.{k}": round(v, 3) for k, v in figures.items() if v is not None}


class _NvmlFailure(Exception):
    """One NVML step failed; the message is what the operator reads."""


def parse_devices(spec: str | Sequence[int], field: str = "require_gpu_quiet") -> tuple[int, ...]:
    """``"0,1"`` or ``[0, 1]`` → ``(0, 1)``; anything else raises :class:`ConfigError`."""
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",")]
        if not spec.strip() or any(not p for p in parts):
            raise ConfigError(field, f"expected NVML device indices like '0,1', got {spec!r}")
        try:
            values: list[object] = [int(p, 10) for p in parts]
        except ValueError:
            raise ConfigError(field, f"expected NVML device indices like '0,1', "
                                     f"got {spec!r}") from None
    else:
        values = list(spec)
    if not values:
        raise ConfigError(field, "needs at least one NVML device index")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(field, f"a device index must be an int >= 0, got {value!r}")
    if len(set(values)) != len(values):
        raise ConfigError(field, f"device indices repeat: {spec!r}")
    return tuple(v for v in values if isinstance(v, int))


def _pynvml_installed() -> bool:
    """Whether ``pynvml`` can be imported (found on the path; nothing is imported)."""
    return importlib.util.find_spec("pynvml") is not None


def _load_pynvml() -> Any:
    """The real bindings; ImportError when ``nvidia-ml-py`` is not installed."""
    import pynvml  # type: ignore[import-untyped, import-not-found, unused-ignore]  # noqa: PLC0415

    return pynvml


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "value", None)
    text = str(exc) or repr(exc)
    if isinstance(code, int):
        return f"{type(exc).__name__} (NVML error {code}): {text}"
    return f"{type(exc).__name__}: {text}"


class _Sample:
    """The result of one window: per-device activity and per-device failures."""

    def __init__(self) -> None:
        self.activity: dict[int, DeviceActivity] = {}
        self.errors: list[str] = []


class GpuQuietProbe(Probe):
    """``inner``, corroborated by NVML on ``devices``: see the module docstring.

    Every argument is validated before anything is created; a bad one raises
    :class:`ConfigError` naming it. ``nvml`` injects a module with ``pynvml``'s API (the
    unit tests' fake); by default the real ``pynvml`` is imported on the first read.
    """

    def __init__(self, inner: QuiescenceProbe, devices: str | Sequence[int], *,
                 thresholds: GpuQuietThresholds | None = None,
                 window_s: float = DEFAULT_WINDOW_S,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                 nvml: Any = None) -> None:
        if not isinstance(inner, QuiescenceProbe):
            raise ConfigError("inner", f"must be a QuiescenceProbe, got {inner!r}")
        parsed = parse_devices(devices, "devices")
        limits = GpuQuietThresholds() if thresholds is None else thresholds
        if not isinstance(limits, GpuQuietThresholds):
            raise ConfigError("thresholds", f"must be GpuQuietThresholds, got {limits!r}")
        check_seconds("window_s", window_s, allow_zero=False)
        if window_s > MAX_WINDOW_S:
            raise ConfigError("window_s", f"must be at most {MAX_WINDOW_S:g} s, got {window_s!r}")
        check_seconds("call_timeout_s", call_timeout_s, allow_zero=False)
        super().__init__(inner.role, f"{inner.source}+{SOURCE}")
        self.inner = inner
        self.devices = parsed
        self.thresholds = limits
        self.window_s = float(window_s)
        self.call_timeout_s = float(call_timeout_s)
        self._nvml_override = nvml
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self._initialised = False
        self._closed = False
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._call_started: float | None = None  # set while the thread runs an NVML batch
        self._call_lock = threading.Lock()
        self._sampling: asyncio.Task[_Sample] | None = None
        self._last_problem: str | None = None

    # -- the contract ---------------------------------------------------------------

    @property
    def max_read_s(self) -> float:
        """The longest a read can take: the window plus two bounded NVML batches."""
        return self.window_s + 2 * self.call_timeout_s

    async def pending_work(self) -> PendingWork:
        """The inner snapshot, made BUSY or UNKNOWN by the GPU when the inner one is quiet."""
        inner = await self.inner.pending_work()
        if not isinstance(inner, PendingWork) or inner.verdict is not Verdict.QUIESCENT:
            return inner
        sample = await self._shared_sample()
        return PendingWork.merge(self.role, (inner, self._snapshot(sample)))

    async def wait_for_change(self, after: PendingWork, timeout: float) -> None:
        """Wait on the inner notifier while it decides; sleep while the GPU decides."""
        gpu_decided = any(part.source == SOURCE for part in after.parts)
        inner = self.inner
        if not gpu_decided and isinstance(inner, ChangeNotifier):
            await inner.wait_for_change(after, timeout)
            return
        await asyncio.sleep(max(timeout, 0.0))

    async def check(self) -> str | None:
        """Read every device once (no inner probe): ``None`` if all answer, else why not."""
        snapshot = self._snapshot(await self._shared_sample())
        return "; ".join(snapshot.errors) or None

    async def aclose(self) -> None:
        """Shut NVML down (if it was initialised) and end the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._sampling is not None and not self._sampling.done():
            self._sampling.cancel()
        if self._initialised and self._call_started is None:
            try:
                await self._call(self._shutdown_nvml, "nvmlShutdown")
            except _NvmlFailure as exc:
                log.warning("NVML shutdown failed: %s", exc)
        elif self._initialised:
            log.warning("NVML not shut down: an NVML call is still running")
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    # -- sampling -------------------------------------------------------------------

    async def _shared_sample(self) -> _Sample:
        """Join the sample in progress, or start one; callers' cancellation does not stop it."""
        if self._sampling is None or self._sampling.done():
            self._sampling = asyncio.ensure_future(self._sample())
        return await asyncio.shield(self._sampling)

    async def _sample(self) -> _Sample:
        sample = _Sample()
        if self._closed:
            sample.errors.append("the NVML probe is closed")
            return sample
        try:
            await self._call(self._ensure_init, "nvmlInit")
            start = await self._call(self._read_nvlink_all, "NVLink counters")
            began = time.monotonic()
            await asyncio.sleep(self.window_s)
            end = await self._call(self._read_end, "device activity")
            elapsed = max(time.monotonic() - began, 1e-6)
        except _NvmlFailure as exc:
            sample.errors.append(str(exc))
            self._report(sample)
            return sample
        for index in self.devices:
            before, start_error = start.get(index, ({}, "no reading at the window's start"))
            after, end_error = end.get(index, ({}, "no reading at the window's end"))
            error = start_error or end_error
            if error is not None:
                sample.errors.append(error)
                continue
            try:
                sample.activity[index] = self._activity(index, before, after, elapsed)
            except _NvmlFailure as exc:
                sample.errors.append(str(exc))
        self._report(sample)
        return sample

    def _activity(self, index: int, before: dict[str, float], after: dict[str, float],
                  elapsed: float) -> DeviceActivity:
        nvlink: dict[str, float | None] = {"tx": None, "rx": None}
        if self.thresholds.nvlink_mb_s is not None:
            for direction in ("tx", "rx"):
                delta = after[f"nvlink_{direction}_kib"] - before[f"nvlink_{direction}_kib"]
                if delta < 0:
                    raise _NvmlFailure(f"gpu {index}: NVLink {direction} counter went backwards "
                                       f"(reset during the window?)")
                nvlink[direction] = delta * _KIB / elapsed / _MB
        return DeviceActivity(index, sm_util_pct=after.get("sm_util_pct"),
                              pcie_tx_mb_s=after.get("pcie_tx_mb_s"),
                              pcie_rx_mb_s=after.get("pcie_rx_mb_s"),
                              nvlink_tx_mb_s=nvlink["tx"], nvlink_rx_mb_s=nvlink["rx"])

    def _snapshot(self, sample: _Sample) -> PendingWork:
        """The GPU part: only the ``nvml.gpu_active`` queue; counters stay unknown."""
        active = {i: a.over(self.thresholds) for i, a in sample.activity.items()}
        busy = {i: reasons for i, reasons in active.items() if reasons}
        details: dict[str, Detail] = {"window_s": self.window_s}
        for activity in sample.activity.values():
            details.update(activity.details())
        if busy:
            details["busy"] = "; ".join(f"gpu {i}: {', '.join(r)}" for i, r in busy.items())
        count: Count = len(busy) if busy or not sample.errors else UNKNOWN
        return PendingWork(role=self.role, source=SOURCE, queues={GPU_ACTIVE_QUEUE: count},
                           errors=tuple(sample.errors), details=details)

    def _report(self, sample: _Sample) -> None:
        """Log a failure once when it starts or changes, and once when it clears."""
        problem = "; ".join(sample.errors) or None
        if problem != self._last_problem:
            if problem is not None:
                log.warning("GPU activity unknown on devices %s: %s", self.devices, problem)
            else:
                log.info("GPU activity readable again on devices %s", self.devices)
            self._last_problem = problem

    async def _call(self, fn: Callable[[], _T], what: str) -> _T:
        """Run ``fn`` in the probe's one NVML thread, bounded by ``call_timeout_s``."""
        started = self._call_started
        if started is not None:
            hung = time.monotonic() - started
            raise _NvmlFailure(f"an NVML call has not returned for {hung:.1f}s"
                               f" (driver hung?); not starting {what}")
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="quiesce-nvml")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._timed, fn)
        try:
            return await asyncio.wait_for(future, self.call_timeout_s)
        except asyncio.TimeoutError:
            raise _NvmlFailure(f"NVML did not answer within {self.call_timeout_s:.3f}s "
                               f"({what})") from None

    def _timed(self, fn: Callable[[], _T]) -> _T:
        with self._call_lock:
            self._call_started = time.monotonic()
        try:
            return fn()
        finally:
            with self._call_lock:
                self._call_started = None

    # -- blocking NVML calls (in the thread only) --------------------------------------

    def _ensure_init(self) -> None:
        if self._initialised:
            return
        if self._nvml is None:
            if self._nvml_override is not None:
                self._nvml = self._nvml_override
            else:
                try:
                    self._nvml = _load_pynvml()
                except ImportError as exc:
                    raise _NvmlFailure(f"pynvml is not installed ({exc}): {_INSTALL_HINT}") \
                        from None
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:
            raise _NvmlFailure(f"nvmlInit failed: {_describe(exc)}") from None
        try:
            count = int(nvml.nvmlDeviceGetCount())
            missing = [i for i in self.devices if i >= count]
            if missing:
                raise _NvmlFailure(f"device index {', '.join(map(str, missing))} out of range: "
                                   f"NVML sees {count} device(s) (indices are NVML's, as "
                                   f"nvidia-smi shows them)")
            self._handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in self.devices}
        except _NvmlFailure:
            self._shutdown_quietly(nvml)
            raise
        except Exception as exc:
            self._shutdown_quietly(nvml)
            raise _NvmlFailure(f"opening devices {self.devices} failed: {_describe(exc)}") \
                from None
        self._initialised = True
        log.info("NVML initialised: %d device(s) visible; watching %s (window %.3fs)",
                 count, self.devices, self.window_s)

    @staticmethod
    def _shutdown_quietly(nvml: Any) -> None:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown after a failed start: %s", _describe(exc))

    def _shutdown_nvml(self) -> None:
        if not self._initialised or self._nvml is None:
            return
        self._initialised = False
        self._handles = {}
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            raise _NvmlFailure(_describe(exc)) from None

    def _per_device(self, read: Callable[[int, Any], dict[str, float]]
                    ) -> dict[int, tuple[dict[str, float], str | None]]:
        out: dict[int, tuple[dict[str, float], str | None]] = {}
        for index, handle in self._handles.items():
            try:
                out[index] = (read(index, handle), None)
            except _NvmlFailure as exc:
                out[index] = ({}, str(exc))
            except Exception as exc:
                out[index] = ({}, f"gpu {index}: {_describe(exc)}")
        return out

    def _read_nvlink_all(self) -> dict[int, tuple[dict[str, float], str | None]]:
        return self._per_device(self._read_nvlink)

    def _read_nvlink(self, index: int, handle: Any) -> dict[str, float]:
        if self.thresholds.nvlink_mb_s is None:
            return {}
        nvml = self._nvml
        fields = [(nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, _ALL_LINKS),
                  (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, _ALL_LINKS)]
        try:
            values = nvml.nvmlDeviceGetFieldValues(handle, fields)
        except Exception as exc:
            raise _NvmlFailure(f"gpu {index}: NVLink counters: {_describe(exc)}") from None
        out: dict[str, float] = {}
        for direction, value in zip(("tx", "rx"), values, strict=True):
            status = int(value.nvmlReturn)
            if status != 0:
                error = nvml.NVMLError(status)
                raise _NvmlFailure(f"gpu {index}: NVLink {direction} counter: {_describe(error)}"
                                   f" (a device without NVLink: set nvlink_mb_s=None)")
            out[f"nvlink_{direction}_kib"] = float(_field_number(nvml, value))
        return out

    def _read_end(self) -> dict[int, tuple[dict[str, float], str | None]]:
        def read(index: int, handle: Any) -> dict[str, float]:
            out = self._read_nvlink(index, handle)
            nvml = self._nvml
            step = "utilisation"
            try:
                if self.thresholds.sm_util_pct is not None:
                    out["sm_util_pct"] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                if self.thresholds.pcie_mb_s is not None:
                    step = "PCIe throughput"
                    for direction, counter in (("tx", nvml.NVML_PCIE_UTIL_TX_BYTES),
                                               ("rx", nvml.NVML_PCIE_UTIL_RX_BYTES)):
                        kb_s = nvml.nvmlDeviceGetPcieThroughput(handle, counter)
                        out[f"pcie_{direction}_mb_s"] = float(kb_s) * _KIB / _MB
            except Exception as exc:
                raise _NvmlFailure(f"gpu {index}: {step}: {_describe(exc)}") from None
            return out

        return self._per_device(read)


def _field_number(nvml: Any, value: Any) -> int | float:
    """The number in an NVML field value, by its declared type."""
    kind = int(value.valueType)
    member = {getattr(nvml, "NVML_VALUE_TYPE_DOUBLE", 0): "dVal",
              getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_INT", 1): "uiVal",
              getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG", 2): "ulVal",
              getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3): "ullVal",
              getattr(nvml, "NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4): "sllVal",
              getattr(nvml, "NVML_VALUE_TYPE_SIGNED_INT", 5): "siVal"}.get(kind)
    if member is None:
        raise _NvmlFailure(f"NVML field {int(value.fieldId)} has an unknown value type {kind}")
    number: int | float = getattr(value.value, member)
    return number


def require_gpu_quiet(inner: QuiescenceProbe, devices: str | Sequence[int], *,
                      thresholds: GpuQuietThresholds | None = None,
                      window_s: float = DEFAULT_WINDOW_S,
                      call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                      probe_timeout_s: float | None = None) -> GpuQuietProbe:
    """The reference worker's ``--require-gpu-quiet 0,1``: wrap ``inner`` in a GPU check.

    Raises :class:`ConfigError` (field ``require_gpu_quiet``) for a bad device list, and
    (field ``window_s``) when a read could outlast ``probe_timeout_s`` (the drain's
    ``DrainConfig.probe_timeout_s``; the drain would then never see a finished read);
    :class:`EngineNotInstalled` when ``pynvml`` is not installed: a worker asked to
    require a quiet GPU should not start unable to read one. A missing driver is not
    checked here (no blocking call): it shows as UNKNOWN on the first read; call
    ``await probe.check()`` at start-up to log it early.
    """
    parsed = parse_devices(devices, "require_gpu_quiet")
    if not _pynvml_installed():
        raise EngineNotInstalled("nvml", "nvidia-ml-py", "nvml")
    probe = GpuQuietProbe(inner, parsed, thresholds=thresholds, window_s=window_s,
                          call_timeout_s=call_timeout_s)
    if probe_timeout_s is not None and probe.max_read_s >= probe_timeout_s:
        raise ConfigError("window_s", f"a GPU read can take {probe.max_read_s:.3f}s "
                                      f"(window + 2 x call timeout), not below the drain's "
                                      f"probe timeout of {probe_timeout_s:g}s")
    return probe
