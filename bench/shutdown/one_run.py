"""One run of the shutdown benchmark (:mod:`bench.shutdown`): a fresh
``quiesce serve --engine vllm``, ``STREAMS`` streams, one delivery of the shutdown, and what
the worker did until every process of it was gone (its drained moment, its exit report,
what it printed, what it left in ``/dev/shm``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.watch import ProcessWatch, StatusPoller, proc_name, remove_left, shm_names
from tests.integration.worker_process import (
    StreamResult,
    signal_every_process,
    signal_group,
    stream_completion,
    worker_env,
    worker_processes,
)

REPO = Path(__file__).resolve().parents[2]

DELIVERIES = ("kubelet", "term_main", "term_group", "term_all", "int_group")
STREAMS = 4
TOKENS = 48
ROUTER_GRACE_S = 0.2
WORKER_BUDGET_S = 30.0
PRESTOP_GRACE_S = 30.0
MAX_MODEL_LEN = 512
DTYPE = "float32"
STARTUP_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 60.0
NOISE = re.compile(r"Traceback|Exception ignored|[Ww]arning|leaked|Error|error:")
"""What counts as noise when printed after the worker's exit line."""


@dataclasses.dataclass
class Run:
    delivery: str
    index: int
    drained_at: float | None = None
    drained_source: str = ""
    drain_started_at: float | None = None
    signal_at: float = 0.0
    last_stream_end: float = 0.0
    exit_line_at: float | None = None
    gone: dict[str, float] = dataclasses.field(default_factory=dict)
    exit_code: int | None = None
    report: dict[str, object] | None = None
    streams: list[StreamResult] = dataclasses.field(default_factory=list)
    noise: list[str] = dataclasses.field(default_factory=list)
    shutdown_warnings: list[str] = dataclasses.field(default_factory=list)
    shm_left: list[str] = dataclasses.field(default_factory=list)
    prestop_code: int | None = None
    error: str | None = None
    wall_s: float = 0.0

    @property
    def lost(self) -> int:
        return sum(1 for r in self.streams
                   if r.status != 200 or not r.done or r.error is not None)

    def after_drained(self, at: float | None) -> float | None:
        if at is None or self.drained_at is None:
            return None
        return round(at - self.drained_at, 4)

    @property
    def main_gone(self) -> float | None:
        return self.gone.get("main")

    @property
    def all_gone(self) -> float | None:
        return max(self.gone.values()) if self.gone and "main" in self.gone else None

    def stage_s(self, name: str) -> float | None:
        stages = (self.report or {}).get("stages")
        for stage in stages if isinstance(stages, list) else []:
            if isinstance(stage, dict) and stage.get("stage") == name:
                value = stage.get("elapsed_s")
                return float(value) if isinstance(value, (int, float)) else None
        return None

    @property
    def noisy(self) -> int:
        return len(self.noise)

    def to_dict(self) -> dict[str, object]:
        lower = (max(self.last_stream_end, self.drain_started_at + ROUTER_GRACE_S)
                 if self.drain_started_at is not None else None)
        return {
            "delivery": self.delivery, "run": self.index,
            "exit_after_drained_s": self.after_drained(self.main_gone),
            "all_gone_after_drained_s": self.after_drained(self.all_gone),
            "exit_line_after_drained_s": self.after_drained(self.exit_line_at),
            "gone_after_drained_s": {name: self.after_drained(at)
                                     for name, at in sorted(self.gone.items())},
            "drained_source": self.drained_source,
            "drained_after_lower_bound_s": (None if lower is None or self.drained_at is None
                                            else round(self.drained_at - lower, 4)),
            "signal_after_drained_s": self.after_drained(self.signal_at),
            "exit_code": self.exit_code, "prestop_exit_code": self.prestop_code,
            "outcome": (self.report or {}).get("outcome"),
            "engine_shutdown_stage_s": self.stage_s("engine_shutdown"),
            "streams": len(self.streams), "lost_streams": self.lost,
            "lost_detail": [dataclasses.asdict(r) for r in self.streams
                            if r.status != 200 or not r.done or r.error is not None],
            "exit_noise": self.noise[:20], "shutdown_warnings": self.shutdown_warnings[:20],
            "shm_left": self.shm_left, "error": self.error, "wall_s": round(self.wall_s, 1),
        }


def _deliver(delivery: str, pid: int) -> None:
    if delivery in ("kubelet", "term_main"):
        os.kill(pid, signal.SIGTERM)
    elif delivery == "term_group":
        signal_group(pid, signal.SIGTERM)
    elif delivery == "term_all":
        signal_every_process(pid, signal.SIGTERM)
    elif delivery == "int_group":
        signal_group(pid, signal.SIGINT)
    else:
        raise ValueError(f"unknown delivery {delivery!r}")


async def _prestop(admin_url: str, env: dict[str, str]) -> int:
    prestop = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "quiesce", "prestop", "--url", admin_url,
        "--grace-period", str(PRESTOP_GRACE_S), env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return await asyncio.wait_for(prestop.wait(), timeout=PRESTOP_GRACE_S)
    except asyncio.TimeoutError:
        prestop.kill()
        return -1


def _env() -> dict[str, str]:
    env = worker_env()
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


class WorkerProcess:
    """``quiesce serve --engine vllm`` with stdout and stderr read (timestamped) in a thread."""

    def __init__(self, model: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "quiesce", "serve", "--engine", "vllm", "--model",
             str(model), "--max-model-len", str(MAX_MODEL_LEN), "--dtype", DTYPE,
             "--port", "0", "--admin-port", "0", "--router-grace", str(ROUTER_GRACE_S),
             "--budget", str(WORKER_BUDGET_S)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            if line.startswith('{"event": "ready"'):
                self.ready.set()
        self.ready.set()

    def ports(self) -> tuple[int, int] | None:
        for _, text in self.lines:
            if text.startswith('{"event": "ready"'):
                event = json.loads(text)
                return int(event["port"]), int(event["admin_port"])
        return None

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        self.reader.join(10)


async def _streams_then_signal(run: Run, worker: WorkerProcess, env: dict[str, str],
                               watch: ProcessWatch) -> None:
    ports = worker.ports()
    assert ports is not None
    url, admin_url = (f"http://127.0.0.1:{port}" for port in ports)
    first_token = asyncio.Event()
    ends: list[float] = []

    async def stream() -> StreamResult:
        result = await stream_completion(url, TOKENS, started=first_token)
        ends.append(time.time())
        return result

    streams = [asyncio.create_task(stream()) for _ in range(STREAMS)]
    await asyncio.wait_for(first_token.wait(), timeout=120)
    watch.start()
    if run.delivery == "kubelet":
        run.prestop_code = await _prestop(admin_url, env)
    run.signal_at = time.time()
    _deliver(run.delivery, worker.process.pid)
    run.streams = list(await asyncio.gather(*streams))
    run.last_stream_end = max(ends) if ends else run.signal_at


async def one_run(model: Path, delivery: str, index: int) -> Run:
    run = Run(delivery, index)
    started = time.monotonic()
    env = _env()
    shm_before = shm_names()
    worker = WorkerProcess(model, env)
    poller: StatusPoller | None = None
    try:
        poller = await _measure(run, worker, env)
    except Exception as exc:  # recorded, not raised: the other runs still count
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        worker.close()
        run.wall_s = time.monotonic() - started
    _read_output(run, worker.lines)
    if poller is not None:
        _drained_at(run, poller)
    run.shm_left = sorted(shm_names() - shm_before)
    remove_left(run.shm_left)
    return run


async def _measure(run: Run, worker: WorkerProcess, env: dict[str, str]) -> StatusPoller | None:
    """Streams, the delivery, and the worker's exit; None if the worker never got ready."""
    await asyncio.to_thread(worker.ready.wait, STARTUP_TIMEOUT_S)
    ports = worker.ports()
    if ports is None:
        run.error = f"not ready within {STARTUP_TIMEOUT_S:g}s (exit {worker.process.poll()})"
        return None
    main = worker.process.pid
    names = {pid: ("main" if pid == main else proc_name(pid)) for pid in worker_processes(main)}
    watch = ProcessWatch(names)
    poller = StatusPoller(f"http://127.0.0.1:{ports[1]}")
    poller.start()
    await _streams_then_signal(run, worker, env, watch)
    try:
        run.exit_code = await asyncio.to_thread(worker.process.wait, EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        run.error = f"still running {EXIT_TIMEOUT_S:g}s after the signal: SIGKILLed"
    await asyncio.to_thread(watch.wait, EXIT_TIMEOUT_S)
    poller.stop()
    run.gone = {names[pid]: at for pid, at in watch.gone.items()}
    return poller


def _drained_at(run: Run, poller: StatusPoller) -> None:
    """The worker's own drained moment, from the admin API's status (wall clock).

    ``drained.since`` when a status showed ``drained`` (always after ``quiesce prestop``);
    otherwise the drain run's start (``draining.since``) plus its length
    (``last_drain.elapsed_s``, read in ``stopping``), or, if the admin server closed before
    a ``stopping`` status was read, plus the exit report's drain stage (the shutdown starts
    the drain run, so the two begin together); else ``stopping.since``, which comes right
    after drained in the same task.
    """
    draining, drained = poller.first("draining"), poller.first("drained")
    stopping = poller.first("stopping")
    drain_stage = run.stage_s("drain")
    run.drain_started_at = draining.since if draining is not None else None
    if drained is not None:
        run.drained_at, run.drained_source = drained.since, "status drained.since"
    elif draining is not None and stopping is not None \
            and stopping.last_drain_elapsed_s is not None:
        run.drained_at = draining.since + stopping.last_drain_elapsed_s
        run.drained_source = "status draining.since + last_drain.elapsed_s"
    elif draining is not None and drain_stage is not None:
        run.drained_at = draining.since + drain_stage
        run.drained_source = "status draining.since + exit report's drain stage"
    elif stopping is not None:
        run.drained_at, run.drained_source = stopping.since, "status stopping.since"
    else:
        run.drained_source = "not observed"


def _read_output(run: Run, lines: list[tuple[float, str]]) -> None:
    exit_index = None
    for i, (at, text) in enumerate(lines):
        if text.startswith('{"event": "exit"'):
            exit_index, run.exit_line_at = i, at
            with contextlib.suppress(ValueError):
                run.report = json.loads(text)
    if exit_index is not None:
        run.noise = [text for _, text in lines[exit_index + 1:] if NOISE.search(text)]
    run.noise += [text for at, text in lines[:exit_index]
                  if at >= run.signal_at and ("Traceback" in text or "leaked" in text)]
    run.shutdown_warnings = [text for at, text in lines[:exit_index]
                             if at >= run.signal_at and re.search(r"\b(WARNING|ERROR)\b", text)]
