"""NVML's blocking calls for the GPU-activity probe: opening the watched devices, reading
their counters, shutting NVML down. Every call here blocks; the probe (:mod:`.probe`)
runs them in its one NVML thread, never on the event loop.

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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

from .activity import DeviceActivity, GpuQuietThresholds

_ALL_LINKS: Final = 0xFFFFFFFF  # NVML's scope id for "summed over every NVLink"
_MB: Final = 1_000_000.0
_KIB: Final = 1024.0
_INSTALL_HINT: Final = "pip install 'quiesce[nvml]'"

log = logging.getLogger("quiesce.adapters.nvml")


class NvmlFailure(Exception):
    """One NVML step failed; the message is what the operator reads."""


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


class NvmlDevices:
    """``pynvml`` and the handles of the watched ``devices``. Every method blocks: call them
    in the probe's NVML thread only. ``nvml`` injects a module with ``pynvml``'s API (the
    unit tests' fake); by default the real ``pynvml`` is imported by :meth:`ensure_init`.
    """

    def __init__(self, devices: tuple[int, ...], thresholds: GpuQuietThresholds,
                 window_s: float, nvml: Any = None) -> None:
        self.devices = devices
        self.thresholds = thresholds
        self.window_s = window_s
        self._nvml_override = nvml
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self.initialised = False

    def activity(self, index: int, before: dict[str, float], after: dict[str, float],
                 elapsed: float) -> DeviceActivity:
        """Device ``index``'s figures over a window of ``elapsed`` seconds, from its readings
        at the window's start (``before``) and end (``after``)."""
        nvlink: dict[str, float | None] = {"tx": None, "rx": None}
        if self.thresholds.nvlink_mb_s is not None:
            for direction in ("tx", "rx"):
                delta = after[f"nvlink_{direction}_kib"] - before[f"nvlink_{direction}_kib"]
                if delta < 0:
                    raise NvmlFailure(f"gpu {index}: NVLink {direction} counter went backwards "
                                      f"(reset during the window?)")
                nvlink[direction] = delta * _KIB / elapsed / _MB
        return DeviceActivity(index, sm_util_pct=after.get("sm_util_pct"),
                              pcie_tx_mb_s=after.get("pcie_tx_mb_s"),
                              pcie_rx_mb_s=after.get("pcie_rx_mb_s"),
                              nvlink_tx_mb_s=nvlink["tx"], nvlink_rx_mb_s=nvlink["rx"])

    def ensure_init(self) -> None:
        """``nvmlInit`` and the devices' handles, once (again after a failure)."""
        if self.initialised:
            return
        if self._nvml is None:
            if self._nvml_override is not None:
                self._nvml = self._nvml_override
            else:
                try:
                    self._nvml = _load_pynvml()
                except ImportError as exc:
                    raise NvmlFailure(f"pynvml is not installed ({exc}): {_INSTALL_HINT}") \
                        from None
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:
            raise NvmlFailure(f"nvmlInit failed: {_describe(exc)}") from None
        try:
            count = int(nvml.nvmlDeviceGetCount())
            missing = [i for i in self.devices if i >= count]
            if missing:
                raise NvmlFailure(f"device index {', '.join(map(str, missing))} out of range: "
                                  f"NVML sees {count} device(s) (indices are NVML's, as "
                                  f"nvidia-smi shows them)")
            self._handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in self.devices}
        except NvmlFailure:
            self._shutdown_quietly(nvml)
            raise
        except Exception as exc:
            self._shutdown_quietly(nvml)
            raise NvmlFailure(f"opening devices {self.devices} failed: {_describe(exc)}") \
                from None
        self.initialised = True
        log.info("NVML initialised: %d device(s) visible; watching %s (window %.3fs)",
                 count, self.devices, self.window_s)

    @staticmethod
    def _shutdown_quietly(nvml: Any) -> None:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown after a failed start: %s", _describe(exc))

    def shutdown(self) -> None:
        """``nvmlShutdown``, if NVML was initialised."""
        if not self.initialised or self._nvml is None:
            return
        self.initialised = False
        self._handles = {}
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            raise NvmlFailure(_describe(exc)) from None

    def _per_device(self, read: Callable[[int, Any], dict[str, float]]
                    ) -> dict[int, tuple[dict[str, float], str | None]]:
        out: dict[int, tuple[dict[str, float], str | None]] = {}
        for index, handle in self._handles.items():
            try:
                out[index] = (read(index, handle), None)
            except NvmlFailure as exc:
                out[index] = ({}, str(exc))
            except Exception as exc:
                out[index] = ({}, f"gpu {index}: {_describe(exc)}")
        return out

    def read_nvlink_all(self) -> dict[int, tuple[dict[str, float], str | None]]:
        """Per device: the NVLink counters at the window's start, or why not."""
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
            raise NvmlFailure(f"gpu {index}: NVLink counters: {_describe(exc)}") from None
        out: dict[str, float] = {}
        for direction, value in zip(("tx", "rx"), values, strict=True):
            status = int(value.nvmlReturn)
            if status != 0:
                error = nvml.NVMLError(status)
                raise NvmlFailure(f"gpu {index}: NVLink {direction} counter: {_describe(error)}"
                                  f" (a device without NVLink: set nvlink_mb_s=None)")
            out[f"nvlink_{direction}_kib"] = float(_field_number(nvml, value))
        return out

    def read_end(self) -> dict[int, tuple[dict[str, float], str | None]]:
        """Per device: every enabled channel at the window's end, or why not."""
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
                raise NvmlFailure(f"gpu {index}: {step}: {_describe(exc)}") from None
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
        raise NvmlFailure(f"NVML field {int(value.fieldId)} has an unknown value type {kind}")
    number: int | float = getattr(value.value, member)
    return number
