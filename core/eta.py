"""Drain ETA: how long until a worker's pending work is done, if nothing new arrives.

A probe that can estimate it attaches a :class:`DrainEta` to its
:class:`~quiesce.probe.PendingWork` (``eta``); one that cannot leaves it ``None``.
It is informational only: it never changes a verdict and never makes a worker
drained or not (only the counters do).

Fields:

- ``expected_s``: the point estimate (``None``: unknown, ``reason`` says why);
- ``upper_s``: a bound the drain should not exceed (``None``: no bound can be given,
  e.g. a request without ``max_tokens``, or KV held for a remote reader with no lease);
- ``basis``: what it was computed from, for the operator (``"remaining tokens x step
  time"``).

:meth:`DrainEta.combine` joins views of the same worker (the parts of an
:class:`~quiesce.probe.AllOf`, the data-parallel ranks): the work ends when the slowest
part ends, so each field is the largest; unknown or unbounded in any part that has an
estimate makes it unknown or unbounded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from quiesce.errors import ConfigError


def _check(field: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise ConfigError(field, f"must be a finite number of seconds >= 0 or None, "
                          f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class DrainEta:
    """Seconds until the pending work is done: a point estimate and an upper bound."""

    expected_s: float | None
    upper_s: float | None
    basis: str
    reason: str | None = None
    """Why ``expected_s`` is unknown or ``upper_s`` unbounded (else ``None``)."""

    def __post_init__(self) -> None:
        _check("expected_s", self.expected_s)
        _check("upper_s", self.upper_s)
        if self.expected_s is not None and self.upper_s is not None \
                and self.expected_s > self.upper_s:
            raise ConfigError("expected_s", f"{self.expected_s} is above the upper bound "
                              f"{self.upper_s}")
        if (self.expected_s is None or self.upper_s is None) and not self.reason:
            raise ConfigError("reason", "an unknown estimate or a missing bound needs a reason")

    @classmethod
    def unknown(cls, basis: str, reason: str) -> DrainEta:
        return cls(None, None, basis, reason)

    def to_dict(self) -> dict[str, object]:
        return {"expected_s": None if self.expected_s is None else round(self.expected_s, 3),
                "upper_s": None if self.upper_s is None else round(self.upper_s, 3),
                "basis": self.basis, "reason": self.reason}

    def summary(self) -> str:
        """``~3.2 s (at most 7.5 s)``, or ``unknown: <reason>``."""
        if self.expected_s is None:
            return f"unknown: {self.reason}"
        bound = (f"at most {self.upper_s:.1f} s" if self.upper_s is not None
                 else f"no bound: {self.reason}")
        return f"~{self.expected_s:.1f} s ({bound})"

    @classmethod
    def combine(cls, etas: Iterable[DrainEta | None]) -> DrainEta | None:
        """The slowest of the parts that estimate (``None`` if none does)."""
        given = [e for e in etas if e is not None]
        if not given:
            return None
        if len(given) == 1:
            return given[0]
        reasons = "; ".join(sorted({e.reason for e in given if e.reason}))
        expected = [e.expected_s for e in given]
        upper = [e.upper_s for e in given]
        return cls(None if None in expected else max(e for e in expected if e is not None),
                   None if None in upper else max(u for u in upper if u is not None),
                   "+".join(sorted({e.basis for e in given})), reasons or None)
