"""The load for aiperf: a seeded mooncake trace.

:func:`write_trace` writes it (JSONL: ``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids``): Poisson arrivals at each :class:`Phase`'s rate, one
phase after the other; input lengths from ``input_lengths`` (uniform 64-512 tokens by
default), consistent with ``hash_ids`` and the block size; output lengths from
``output_lengths`` (a log-normal with a long tail by default: at the sim engine's
0.02 s a token, a few percent run longer than 5 s). Pure, deterministic for a seed,
milliseconds. Invalid arguments raise :class:`ValueError` naming the argument.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

BLOCK_SIZE = 64
"""Tokens per ``hash_ids`` block (aiperf's ``--isl-block-size``)."""


@dataclasses.dataclass(frozen=True)
class Phase:
    """``duration_s`` seconds of Poisson arrivals at ``rate_rps`` (0: no arrivals)."""

    rate_rps: float
    duration_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_rps) and self.rate_rps >= 0):
            raise ValueError(f"Phase.rate_rps must be a finite number >= 0, got {self.rate_rps!r}")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"Phase.duration_s must be a finite number > 0, "
                             f"got {self.duration_s!r}")


class LengthDistribution(Protocol):
    """Token counts of a trace: ``sample`` draws one (>= 1) from the trace's generator."""

    def sample(self, rng: random.Random) -> int: ...


@dataclasses.dataclass(frozen=True)
class UniformLengths:
    """Uniform integers in ``[low, high]``."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"UniformLengths needs 1 <= low <= high, got {self.low}, {self.high}")

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclasses.dataclass(frozen=True)
class LogNormalLengths:
    """``median * exp(sigma * N(0, 1))``, rounded and clipped to ``[minimum, maximum]``: a long
    right tail. The defaults (median 60, sigma 1.0, up to 600) put ~8 % of the requests over
    250 tokens (5 s at the sim engine's 0.02 s a token) and ~0.5 % at 600 (12 s)."""

    median: float = 60.0
    sigma: float = 1.0
    minimum: int = 8
    maximum: int = 600

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median) and self.median > 0):
            raise ValueError(f"LogNormalLengths.median must be > 0, got {self.median!r}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"LogNormalLengths.sigma must be >= 0, got {self.sigma!r}")
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"LogNormalLengths needs 1 <= minimum <= maximum, "
                             f"got {self.minimum}, {self.maximum}")

    def sample(self, rng: random.Random) -> int:
        value = round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
        return min(self.maximum, max(self.minimum, value))


DEFAULT_INPUT_LENGTHS = UniformLengths(64, 512)
DEFAULT_OUTPUT_LENGTHS = LogNormalLengths()


def arrival_times(phases: Sequence[Phase], rng: random.Random) -> list[float]:
    """Seconds from the trace start: a Poisson process at each phase's rate, in order."""
    times: list[float] = []
    start = 0.0
    for phase in phases:
        end = start + phase.duration_s
        if phase.rate_rps > 0:
            t = start + rng.expovariate(phase.rate_rps)
            while t < end:
                times.append(t)
                t += rng.expovariate(phase.rate_rps)
        start = end
    return times


def write_trace(
    path: Path,
    phases: Sequence[Phase],
    *,
    seed: int,
    input_lengths: LengthDistribution = DEFAULT_INPUT_LENGTHS,
    output_lengths: LengthDistribution = DEFAULT_OUTPUT_LENGTHS,
    block_size: int = BLOCK_SIZE,
) -> list[dict[str, Any]]:
    """Writes a mooncake trace for ``phases`` to ``path`` and returns its records.

    Each record: ``timestamp`` (integer ms from the benchmark start, non-decreasing: aiperf's
    fixed schedule sends it then), ``input_length``, ``output_length`` (aiperf sends it as
    the request's ``max_tokens``), ``hash_ids`` (``ceil(input_length / block_size)`` ids,
    unique across the trace, so no two prompts share a block). The same arguments give the
    same file. Raises ValueError for no phases, a bad block size or a distribution that
    draws a length < 1; a Phase validates itself.
    """
    if not phases:
        raise ValueError("write_trace needs at least one Phase")
    if not all(isinstance(p, Phase) for p in phases):
        raise ValueError("phases must be Phase instances")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    next_hash = 0
    for t in arrival_times(phases, rng):
        isl = input_lengths.sample(rng)
        osl = output_lengths.sample(rng)
        for name, value in (("input", isl), ("output", osl)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}_lengths drew {value!r}; lengths must be ints >= 1")
        blocks = -(-isl // block_size)
        records.append({
            "timestamp": int(t * 1000),
            "input_length": isl,
            "output_length": osl,
            "hash_ids": list(range(next_hash, next_hash + blocks)),
        })
        next_hash += blocks
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    tmp.replace(path)
    return records
