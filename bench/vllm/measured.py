"""What one run of the vLLM benchmark measured: :func:`bench.vllm.run.run` collects it,
:func:`bench.vllm.result.result` turns it into the Result."""

from __future__ import annotations

import dataclasses

from bench.vllm.busy import BusySamples
from bench.vllm.detection import Drain
from bench.vllm.engine import UNPINNED
from bench.vllm.idle import IdleSamples
from bench.vllm.throughput import Round


@dataclasses.dataclass
class Unpinned:
    """The throughput comparison again, with vLLM's default worker binding."""

    rounds: list[Round]
    other_load: float
    startup_s: float


@dataclasses.dataclass
class Measured:
    idle: IdleSamples
    busy: BusySamples
    rounds: list[Round]
    drains: list[Drain]
    """With the default probe (board, change notification)."""
    snapshot_drains: list[Drain]
    """With ``board=False``: a utility call per read, polled with the drain's backoff."""
    startup_s: float
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    other_load: dict[str, float]
    """Per phase: the share of all CPUs other processes used (see
    :func:`bench.vllm.engine.other_load`)."""
    worker_cpus: str = UNPINNED
    unpinned: Unpinned | None = None
    publish_cost: dict[str, float] = dataclasses.field(default_factory=dict)
    """From :mod:`bench.vllm.publish`: the board's per-step cost inside EngineCore."""
