"""Time limits: an absolute :class:`Deadline` and the shutdown's one :class:`Budget`.

Everything is measured on a monotonic clock and fixed once, at the moment the
limit starts (a SIGTERM, an admin drain), so that stages that run one after the
other can never add up to more than the caller allowed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from quiesce.errors import ConfigError

Clock = Callable[[], float]


def check_seconds(field: str, value: float | None, *, allow_none: bool = False,
                  allow_zero: bool = True) -> None:
    """Raise :class:`ConfigError` naming ``field`` unless ``value`` is a usable duration."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ConfigError(field, f"must be a number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(field, f"must be {bound} seconds, got {value!r}")
    if math.isinf(value):
        raise ConfigError(field, "must be finite; leave it unset for no limit")


class Deadline:
    """An absolute point on the monotonic clock; ``None`` seconds means no limit."""

    __slots__ = ("_at", "_clock")

    def __init__(self, at: float, clock: Clock = time.monotonic) -> None:
        self._at = at
        self._clock = clock

    @classmethod
    def after(cls, seconds: float | None, clock: Clock = time.monotonic) -> Deadline:
        return cls(math.inf if seconds is None else clock() + seconds, clock)

    @property
    def at(self) -> float:
        return self._at

    @property
    def bounded(self) -> bool:
        return not math.isinf(self._at)

    def remaining(self) -> float:
        """Seconds left, never negative; ``inf`` when unbounded."""
        return max(0.0, self._at - self._clock())

    def expired(self) -> bool:
        return self._clock() >= self._at

    def earlier(self, seconds: float | None) -> Deadline:
        """This deadline or ``seconds`` from now, whichever comes first."""
        if seconds is None:
            return self
        return Deadline(min(self._at, self._clock() + seconds), self._clock)


class Budget:
    """One absolute deadline shared by every shutdown stage, with a reserve for cleanup.

    A stage gets ``min(its cap, time left - cleanup reserve)``; cleanup gets all that
    is left. Created when the shutdown starts (the first signal).
    """

    def __init__(self, total_s: float, cleanup_reserve_s: float,
                 clock: Clock = time.monotonic) -> None:
        check_seconds("total_s", total_s, allow_zero=False)
        check_seconds("cleanup_reserve_s", cleanup_reserve_s)
        if cleanup_reserve_s >= total_s:
            raise ConfigError("cleanup_reserve_s",
                              f"{cleanup_reserve_s}s must be smaller than total_s={total_s}s")
        self.total_s = total_s
        self.cleanup_reserve_s = cleanup_reserve_s
        self.started_at = clock()
        self.deadline = Deadline(self.started_at + total_s, clock)
        self._clock = clock

    def remaining(self) -> float:
        return self.deadline.remaining()

    def elapsed(self) -> float:
        return self._clock() - self.started_at

    def allowance(self, cap: float | None = None) -> float:
        """Seconds a non-cleanup stage may use: ``min(cap, remaining - reserve)``, >= 0."""
        left = max(0.0, self.remaining() - self.cleanup_reserve_s)
        return left if cap is None else min(cap, left)

    def cleanup_allowance(self, cap: float | None = None) -> float:
        """Seconds the cleanup stages may use: everything that is left (bounded by ``cap``)."""
        left = self.remaining()
        return left if cap is None else min(cap, left)
