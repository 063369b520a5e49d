"""The results format every benchmark of the project writes, and its human summary.

One JSON file per benchmark, ``bench/results/<name>.json``::

    {
      "name": "drain_lag",
      "metrics": {"quiesce_p99_ms": 0.31, ...},        # numbers only
      "units": {"quiesce_p99_ms": "ms", ...},          # one unit per metric
      "environment": {"python": ..., "cpu_count": ..., "packages": {...},
                      "date": "2026-01-01T00:00:00Z", "platform": ...},
      "parameters": {...},                             # optional: what was run
      "notes": ["...", ...]                            # optional: how it was measured
    }

``notes`` is a list of sentences or short paragraphs. A benchmark builds a
:class:`Result`; :func:`write_result` validates it, adds the environment and writes
the file; :func:`summary` is the short text ``python -m bench`` prints.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"

RELEVANT_PACKAGES = ("quiesce",)
"""Packages whose versions every result records (quiesce has no runtime dependencies)."""

@dataclasses.dataclass(frozen=True)
class Result:
    """What one benchmark measured. ``units`` must name a unit for every metric."""

    name: str
    metrics: Mapping[str, float]
    units: Mapping[str, str]
    parameters: Mapping[str, object] = dataclasses.field(default_factory=dict)
    notes: Sequence[str] = ()

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"benchmark name {self.name!r} must be a plain identifier")
        for metric, value in self.metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{self.name}: metric {metric!r} is not a number: {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{self.name}: metric {metric!r} is not finite: {value!r}")
        if set(self.metrics) != set(self.units):
            missing = sorted(set(self.metrics) ^ set(self.units))
            raise ValueError(f"{self.name}: metrics and units differ on {missing}")


def package_versions(names: Sequence[str] = RELEVANT_PACKAGES) -> dict[str, str]:
    versions: dict[str, str] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def environment() -> dict[str, object]:
    """Where the benchmark ran: interpreter, CPUs, package versions, UTC date, platform."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "cpu_count": os.cpu_count(),
        "packages": dict(package_versions()),
        "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "platform": platform.platform(),
    }


def to_json(result: Result) -> dict[str, object]:
    document: dict[str, object] = {
        "name": result.name,
        "metrics": dict(result.metrics),
        "units": {metric: result.units[metric] for metric in result.metrics},
        "environment": environment(),
    }
    if result.parameters:
        document["parameters"] = dict(result.parameters)
    if result.notes:
        document["notes"] = list(result.notes)
    return document


def write_result(result: Result, directory: Path = RESULTS_DIR) -> Path:
    """Write ``<directory>/<name>.json`` (replacing an older one) and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result.name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(to_json(result), indent=2, allow_nan=False) + "\n",
                   encoding="utf-8")
    tmp.replace(path)
    return path


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


def summary(result: Result, headline: Sequence[str] | None = None) -> str:
    """A few lines for the terminal: the headline metrics (all if none given)."""
    shown = [m for m in (headline if headline is not None else result.metrics)
             if m in result.metrics]
    width = max((len(m) for m in shown), default=0)
    lines = [f"{result.name}:"]
    lines += [f"  {m:<{width}}  {_number(result.metrics[m])} {result.units[m]}" for m in shown]
    return "\n".join(lines)


def run_and_report(name: str, benchmark: Callable[[], Result], headline: Sequence[str]) -> Path:
    """Run one benchmark, write its file, print its summary and targets; returns the path."""
    print(f"running {name} ...", flush=True)
    started = time.monotonic()
    result = benchmark()
    path = write_result(result, RESULTS_DIR)
    print(summary(result, headline))
    for note in result.notes:
        if note.startswith("Target"):
            print(f"  {note}")
    print(f"  ({time.monotonic() - started:.1f}s; all metrics in "
          f"{path.relative_to(RESULTS_DIR.parent.parent)})", flush=True)
    return path
