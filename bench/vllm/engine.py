"""The engine every phase shares, and what runs on it.

Sampling the CPU time that other processes use (:class:`CpuSample`, :func:`other_load`);
preparing the environment and starting one ``AsyncLLM`` with the test
``HoldingConnector`` (:func:`start_engine`, :func:`release`, :func:`hold`,
:func:`settle`); running requests to their end (:func:`generate`, :class:`Load`,
recording a stream's :class:`Trace`); and the three probe variants every phase reads
(:data:`VARIANTS`, :func:`probes`, :func:`per_variant`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quiesce import Role
from quiesce.adapters.vllm import VllmProbe

REPO = Path(__file__).resolve().parents[2]

PROMPT = "hello world"
STREAMS = 16
"""Concurrent decoding streams of the busy phases."""

WORKER_CPUS_ENV = "VLLM_CPU_OMP_THREADS_BIND"
UNPINNED = "auto"
"""vLLM's default binding: on 2 CPUs the worker's 2 OpenMP threads use both of them."""


def log(message: str) -> None:
    print(f"  [bench.vllm] {message}", file=sys.stderr, flush=True)



# -- other load on the machine ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CpuSample:
    at: float
    machine_busy: int
    """Busy clock ticks of every CPU together (/proc/stat: all but idle and iowait)."""
    ours: int
    """Clock ticks used by this process and its live descendants (the engine's processes)."""


def cpu_sample() -> CpuSample:
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    machine_busy = sum(fields) - fields[3] - fields[4]
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path("/proc", entry, "stat").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        rest = text[text.rindex(")") + 2:].split()
        parents[int(entry)] = int(rest[1])
        ticks[int(entry)] = int(rest[11]) + int(rest[12])
    ours = {os.getpid()}
    grew = True
    while grew:
        found = {pid for pid, ppid in parents.items() if ppid in ours} - ours
        grew = bool(found)
        ours |= found
    return CpuSample(time.monotonic(), machine_busy, sum(ticks.get(pid, 0) for pid in ours))


def other_load(before: CpuSample, after: CpuSample) -> float:
    """Share of all CPUs that other processes used between two samples (0 to 1)."""
    available = (after.at - before.at) * os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1)
    other = (after.machine_busy - before.machine_busy) - (after.ours - before.ours)
    return max(0.0, other / available) if available > 0 else 0.0


# -- the engine ---------------------------------------------------------------------------


def _pinned_worker_cpus() -> str:
    """The last CPU this process may use, for the model worker alone; "auto" if only one."""
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[-1]) if len(cpus) >= 2 else UNPINNED


def prepare_environment() -> None:
    """Offline, small KV cache, the repo importable by spawned engine processes, and the
    model worker's OpenMP threads pinned to a CPU of their own (unless the caller chose)."""
    os.environ.setdefault(WORKER_CPUS_ENV, _pinned_worker_cpus())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def start_engine(model: Path, release_dir: Path) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.integration.vllm.tiny_model import engine_kwargs, holding_connector

    args = AsyncEngineArgs(
        model=str(model), tokenizer=str(model), **engine_kwargs(),
        disable_log_stats=False,  # RequestOutput.metrics: EngineCore's token timestamps
        kv_transfer_config=holding_connector(release_dir))
    return AsyncLLM.from_engine_args(args)


def release(release_dir: Path) -> None:
    (release_dir / "release").touch()


def hold(release_dir: Path) -> None:
    (release_dir / "release").unlink(missing_ok=True)


async def settle(probe: VllmProbe, release_dir: Path, timeout_s: float = 30.0) -> None:
    """Release any held KV and wait until the engine is quiescent.

    A stream ends in the frontend before EngineCore's next step has freed (or, with the
    release file present, released) its KV: holding again at once would keep it.
    """
    release(release_dir)
    deadline = time.monotonic() + timeout_s
    while not (work := await probe.pending_work()).is_quiescent:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine did not settle: {work.summary()}")
        await asyncio.sleep(0.001)


@dataclasses.dataclass
class Trace:
    """One stream's outputs: (tokens so far, EngineCore timestamp, frontend timestamp)."""

    points: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)

    def step_intervals(self) -> tuple[list[float], list[float]]:
        """Intervals between consecutive outputs one token apart: EngineCore's, frontend's."""
        engine: list[float] = []
        frontend: list[float] = []
        for (n0, e0, f0), (n1, e1, f1) in itertools.pairwise(self.points):
            if n1 - n0 == 1 and e0 > 0:
                engine.append(e1 - e0)
                frontend.append(f1 - f0)
        return engine, frontend


async def generate(llm: Any, max_tokens: int, trace: Trace | None = None,
                   on_token: Callable[[], None] | None = None) -> int:
    """Run one request to its end (exactly ``max_tokens`` tokens); returns the count."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    produced = 0
    async for output in llm.generate(PROMPT, params, request_id=uuid.uuid4().hex):
        now = time.monotonic()
        previous, produced = produced, len(output.outputs[0].token_ids)
        if trace is not None:
            stats = output.metrics  # vLLM's RequestStateStats, updated in place
            engine_ts = float(getattr(stats, "last_token_ts", 0.0) or 0.0)
            trace.points.append((produced, engine_ts, now))
        if on_token is not None and previous == 0 and produced > 0:
            on_token()
    return produced


class Load:
    """``streams`` identical requests at once; ``decoding()`` while all of them decode."""

    def __init__(self, llm: Any, streams: int, max_tokens: int) -> None:
        self.llm = llm
        self.streams = streams
        self.max_tokens = max_tokens
        self.trace = Trace()
        self.started = 0
        self.finished = 0
        self.elapsed_s = 0.0

    def decoding(self) -> bool:
        return self.started == self.streams and self.finished == 0

    def _first_token(self) -> None:
        self.started += 1

    async def _one(self, index: int) -> int:
        produced = await generate(self.llm, self.max_tokens,
                                  self.trace if index == 0 else None, self._first_token)
        self.finished += 1
        return produced

    async def run(self) -> float:
        """Run the load to its end; returns tokens per second (every token, prefill included)."""
        begin = time.monotonic()
        produced = await asyncio.gather(*(self._one(i) for i in range(self.streams)))
        self.elapsed_s = time.monotonic() - begin
        if produced != [self.max_tokens] * self.streams:
            raise RuntimeError(f"streams produced {produced}, not {self.max_tokens} each")
        return sum(produced) / self.elapsed_s


VARIANTS = ("board", "snapshot", "has_work")
"""The default probe (the plugin's board), the same with utility calls instead
(``board=False``: the ``quiesce_snapshot`` utility), and ``has_work`` only (no plugin)."""


def per_variant() -> dict[str, list[float]]:
    """An empty list of read latencies per variant (the samples' ``reads``)."""
    return {v: [] for v in VARIANTS}


def probes(llm: Any) -> dict[str, VllmProbe]:
    return {"board": VllmProbe(llm, Role.PREFILL),
            "snapshot": VllmProbe(llm, Role.PREFILL, board=False),
            "has_work": VllmProbe(llm, Role.PREFILL, detailed=False)}
