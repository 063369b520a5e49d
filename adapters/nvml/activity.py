"""What counts as GPU activity: the thresholds a device must stay under, the figures one
device showed over a window, and the list of NVML devices to watch.

Pure value objects, no NVML call: invalid values raise
:class:`~quiesce.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from quiesce.errors import ConfigError
from quiesce.probe import Detail


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
