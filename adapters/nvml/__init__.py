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

The modules: :mod:`.probe` (:class:`GpuQuietProbe` and :func:`require_gpu_quiet`: the
verdict, the shared sample, the NVML thread and what a read costs), :mod:`.calls` (the
blocking NVML calls: what is read per device, where, and what each costs) and
:mod:`.activity` (the thresholds, one device's figures, the device list).

What a sample can and cannot show
---------------------------------
It is corroboration, never proof. Kernel activity and link bytes include every process
on the device (another engine sharing the GPU, a monitoring agent), so a shared GPU can
keep a drain from ending (BUSY: pick the devices and thresholds accordingly). A
transfer shorter than the PCIe counters' 20 ms sample, or one that starts after the
window, is not seen; NVLink counters catch every byte inside the window. NVML device
indices are NVML's own (``nvidia-smi``'s), not positions in ``CUDA_VISIBLE_DEVICES``.
"""

from .activity import DeviceActivity, GpuQuietThresholds, parse_devices
from .probe import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_WINDOW_S,
    GPU_ACTIVE_QUEUE,
    SOURCE,
    GpuQuietProbe,
    require_gpu_quiet,
)

__all__ = ["DEFAULT_CALL_TIMEOUT_S", "DEFAULT_WINDOW_S", "GPU_ACTIVE_QUEUE", "SOURCE",
           "DeviceActivity", "GpuQuietProbe", "GpuQuietThresholds", "parse_devices",
           "require_gpu_quiet"]
