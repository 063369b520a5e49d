"""The GPU-activity probe: a worker's own probe, corroborated by one shared NVML sample
when it already says QUIESCENT (see :mod:`quiesce.adapters.nvml` for the verdicts).

What a read costs
-----------------
A read costs the window (``window_s``, default 0.2 s, spent in
``asyncio.sleep`` on the loop) plus two bounded NVML batches (each at most
``call_timeout_s``, default 0.3 s) run in one dedicated worker thread, never on the
event loop: :attr:`GpuQuietProbe.max_read_s` (0.8 s by default) must stay below the
drain's ``probe_timeout_s`` (1 s by default), or the drain's own bound cuts the read
and reports UNKNOWN. The end batch reads every device in turn (~40 ms each, expected):
past about six devices raise ``call_timeout_s`` and the drain's ``probe_timeout_s``
with it. Concurrent reads (a drain and a status request) share one sample.
If an NVML call hangs past its timeout, the thread stays blocked: later reads answer
UNKNOWN at once ("an NVML call has not returned for ...") instead of queueing more.

Methods (where each signal is read, what it costs, what missing means)
----------------------------------------------------------------------
- :meth:`GpuQuietProbe.pending_work` — reads the inner probe on the loop, then, only if
  it is QUIESCENT, one shared NVML sample (:mod:`.calls`). Cost: the inner read, plus
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
import importlib.util
import logging
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

from .activity import DeviceActivity, GpuQuietThresholds, parse_devices
from .calls import NvmlDevices, NvmlFailure

SOURCE: Final = "nvml.gpu_activity"
GPU_ACTIVE_QUEUE: Final = "nvml.gpu_active"
"""The queue in the combined snapshot: active devices (0 when quiet, UNKNOWN when unread)."""
DEFAULT_WINDOW_S: Final = 0.2
DEFAULT_CALL_TIMEOUT_S: Final = 0.3
MAX_WINDOW_S: Final = 10.0

log = logging.getLogger("quiesce.adapters.nvml")
_T = TypeVar("_T")


def _pynvml_installed() -> bool:
    """Whether ``pynvml`` can be imported (found on the path; nothing is imported)."""
    return importlib.util.find_spec("pynvml") is not None


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
        self._nvml = NvmlDevices(parsed, limits, self.window_s, nvml)
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
        if self._nvml.initialised and self._call_started is None:
            try:
                await self._call(self._nvml.shutdown, "nvmlShutdown")
            except NvmlFailure as exc:
                log.warning("NVML shutdown failed: %s", exc)
        elif self._nvml.initialised:
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
            await self._call(self._nvml.ensure_init, "nvmlInit")
            start = await self._call(self._nvml.read_nvlink_all, "NVLink counters")
            began = time.monotonic()
            await asyncio.sleep(self.window_s)
            end = await self._call(self._nvml.read_end, "device activity")
            elapsed = max(time.monotonic() - began, 1e-6)
        except NvmlFailure as exc:
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
                sample.activity[index] = self._nvml.activity(index, before, after, elapsed)
            except NvmlFailure as exc:
                sample.errors.append(str(exc))
        self._report(sample)
        return sample

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
            raise NvmlFailure(f"an NVML call has not returned for {hung:.1f}s"
                              f" (driver hung?); not starting {what}")
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="quiesce-nvml")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self._timed, fn)
        try:
            return await asyncio.wait_for(future, self.call_timeout_s)
        except asyncio.TimeoutError:
            raise NvmlFailure(f"NVML did not answer within {self.call_timeout_s:.3f}s "
                              f"({what})") from None

    def _timed(self, fn: Callable[[], _T]) -> _T:
        with self._call_lock:
            self._call_started = time.monotonic()
        try:
            return fn()
        finally:
            with self._call_lock:
                self._call_started = None


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
