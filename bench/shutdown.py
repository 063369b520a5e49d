"""Exit after drained: from the moment the real vLLM worker is drained to its process being gone.

Runs in the vLLM environment (``make bench`` runs it there)::

    .venv-vllm/bin/python -m bench.shutdown [--runs N] [--budget S] [--delivery NAME ...]

Each run starts ``quiesce serve --engine vllm`` on the tiny random-weight Llama of
``tests/integration/vllm/tiny_model.py`` (built once, shared by every run), starts
``STREAMS`` streaming completions, and once every stream has its first token delivers
the shutdown one way:

- ``kubelet``: ``quiesce prestop`` (admin drain, waits until drained), then SIGTERM to
  the main process, as the kubelet does;
- ``term_main``: SIGTERM to the main process only;
- ``term_group``: SIGTERM to the worker's process group (an init shim, ``kill -- -PGID``);
- ``term_all``: SIGTERM to every process of the worker, one by one (all descendants read
  from ``/proc``; systemd's control-group kill, ``pkill``);
- ``int_group``: SIGINT to the process group (a terminal's Ctrl-C).

It reads every stream to its end (a 200 answer whose SSE events carry an error, or that
never sent ``[DONE]``, is a lost stream), polls the admin API's status until it shows the
drain over, and watches each process of the worker in ``/proc`` (every 5 ms) until it is
gone. Deliveries the worker does not survive cleanly are recorded, not failed.

Writes ``bench/results/shutdown.json`` (format: :mod:`bench.results_format`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.results_format import Result, run_and_report
from bench.stats import median
from bench.watch import (
    PROC_POLL_S,
    STATUS_POLL_S,
    ProcessWatch,
    StatusPoller,
    proc_name,
    remove_left,
    shm_names,
)
from tests.integration.worker_process import (
    StreamResult,
    signal_every_process,
    signal_group,
    stream_completion,
    worker_env,
    worker_processes,
)

NAME = "shutdown"
REPO = Path(__file__).resolve().parent.parent

DELIVERIES = ("kubelet", "term_main", "term_group", "term_all", "int_group")
STREAMS = 4
TOKENS = 48
ROUTER_GRACE_S = 0.2
WORKER_BUDGET_S = 30.0
PRESTOP_GRACE_S = 30.0
MAX_MODEL_LEN = 512
DTYPE = "float32"
RUNS = 3
"""Runs per delivery at most; rounds of one run per delivery, while the time budget lasts."""
TIME_BUDGET_S = 330.0
"""No run starts once the runs so far plus one more (at their mean) would pass this."""
STARTUP_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 60.0
TARGET_S = 1.0
NOISE = re.compile(r"Traceback|Exception ignored|[Ww]arning|leaked|Error|error:")
"""What counts as noise when printed after the worker's exit line."""


def _log(message: str) -> None:
    print(f"  [bench.shutdown] {message}", file=sys.stderr, flush=True)


# -- one run ----------------------------------------------------------------------------------


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


# -- the benchmark ----------------------------------------------------------------------------


def _runs_plan(deliveries: Sequence[str], runs: int) -> list[tuple[str, int]]:
    """Rounds of one run per delivery, the order rotated each round."""
    plan = []
    for index in range(runs):
        shift = index % len(deliveries)
        plan += [(d, index) for d in (*deliveries[shift:], *deliveries[:shift])]
    return plan


def measure(model: Path, deliveries: Sequence[str], runs: int, budget_s: float,
            progress: Callable[[str], None] = _log) -> list[Run]:
    done: list[Run] = []
    started = time.monotonic()
    for delivery, index in _runs_plan(deliveries, runs):
        elapsed = time.monotonic() - started
        mean = elapsed / len(done) if done else 0.0
        if index > 0 and elapsed + mean > budget_s:
            progress(f"time budget {budget_s:g}s: stopping after {len(done)} runs")
            break
        run = asyncio.run(one_run(model, delivery, index))
        done.append(run)
        d = run.to_dict()
        progress(f"{delivery} #{index}: exit {d['exit_after_drained_s']}s after drained "
                 f"(all processes {d['all_gone_after_drained_s']}s), lost {run.lost}, "
                 f"noise {len(run.noise)}, exit code {run.exit_code}"
                 + (f", error: {run.error}" if run.error else ""))
    return done


def build_result(done: Sequence[Run], deliveries: Sequence[str], runs: int,
                 budget_s: float, model_note: str) -> Result:
    metrics: dict[str, float] = {}
    units: dict[str, str] = {}
    verdicts = []
    for delivery in deliveries:
        mine = [r for r in done if r.delivery == delivery]
        series: dict[str, list[float | None]] = {
            "exit_after_drained_s": [r.after_drained(r.main_gone) for r in mine],
            "all_gone_after_drained_s": [r.after_drained(r.all_gone) for r in mine],
            "exit_line_after_drained_s": [r.after_drained(r.exit_line_at) for r in mine],
            "engine_shutdown_stage_s": [r.stage_s("engine_shutdown") for r in mine],
        }
        for key, maybe in series.items():
            values = [v for v in maybe if v is not None]
            if values:
                metrics[f"{key}_{delivery}"] = round(median(values), 4)
                units[f"{key}_{delivery}"] = "s"
        lost = sum(r.lost for r in mine)
        noise = sum(r.noisy for r in mine)
        shm = sum(len(r.shm_left) for r in mine)
        for key, value in (("lost_streams", lost), ("exit_noise_lines", noise),
                           ("shm_left", shm), ("runs", len(mine))):
            metrics[f"{key}_{delivery}"] = value
            units[f"{key}_{delivery}"] = "count"
        p50 = metrics.get(f"exit_after_drained_s_{delivery}")
        met = p50 is not None and p50 <= TARGET_S and lost == 0 and noise == 0 and shm == 0
        verdicts.append(f"{delivery}: {'met' if met else 'NOT met'} (p50 "
                        f"{'n/a' if p50 is None else f'{p50:g} s'}, {lost} lost, "
                        f"{noise} noise lines, {shm} /dev/shm entries left)")
    from quiesce.adapters.vllm import installed_vllm_version

    return Result(
        name=NAME, metrics=metrics, units=units,
        parameters={
            "vllm_version": installed_vllm_version() or "not installed",
            "model": model_note,
            "worker": {"engine": "vllm", "max_model_len": MAX_MODEL_LEN, "dtype": DTYPE,
                       "router_grace_s": ROUTER_GRACE_S, "budget_s": WORKER_BUDGET_S,
                       "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                 "1")},
            "streams": STREAMS, "tokens_per_stream": TOKENS,
            "prestop_grace_period_s": PRESTOP_GRACE_S,
            "runs_per_delivery_max": runs, "time_budget_s": budget_s,
            "status_poll_s": STATUS_POLL_S, "process_poll_s": PROC_POLL_S,
            "runs": [r.to_dict() for r in done],
        },
        notes=[
            f"Target: exit_after_drained_s <= {TARGET_S:g} s (p50) with no lost stream, "
            "nothing printed at exit and nothing left in /dev/shm, per delivery: "
            + "; ".join(verdicts) + ".",
            "exit_after_drained_s_<delivery>: p50 over the runs of (main process gone) - "
            "(worker drained). Drained is the worker's own lifecycle transition, read from "
            "the admin API (GET /engine/status polled every "
            f"{STATUS_POLL_S * 1e3:g} ms from before the signal until it shows 'drained' or "
            "'stopping', so that it adds no requests of its own to the exit): drained.since when a "
            "status showed 'drained' (always on the kubelet path, after quiesce prestop); "
            "otherwise draining.since + last_drain.elapsed_s (the drain run's start and "
            "length, read once the worker is 'stopping', or else the exit report's drain stage, "
            "which the shutdown starts together with the drain run). Each run's source is in "
            "parameters.runs[].drained_source. drained_after_lower_bound_s compares it "
            "with the lower bound the drain could reach: the later of the last stream's end "
            "(as the client saw it) and the router grace's end (draining.since + "
            f"{ROUTER_GRACE_S:g} s). Gone = the process's /proc entry is a zombie or absent "
            f"(polled every {PROC_POLL_S * 1e3:g} ms); all times are wall-clock on one machine.",
            "all_gone_after_drained_s: the same to the last of the worker's processes "
            "(main, EngineCore, the model runner, multiprocessing's resource tracker) gone. "
            "exit_line_after_drained_s: to the worker's exit report line (as received); "
            "engine_shutdown_stage_s: the report's engine_shutdown stage (vLLM's "
            "AsyncLLM.shutdown, which waits for EngineCore, which waits for its model "
            "runner).",
            f"Each run: a fresh worker, {STREAMS} streams of {TOKENS} tokens; the delivery "
            "starts once every stream has its first token, so the drain waits for them. "
            "kubelet: quiesce prestop (admin drain, waits for drained), then SIGTERM to the "
            "main process; term_main: SIGTERM to the main process; term_group / int_group: "
            "SIGTERM / SIGINT to the process group (os.killpg); term_all: SIGTERM to every "
            "process of the worker one by one (main and every descendant from /proc). "
            "Every stream is read to its end: a non-200 answer, an SSE error event or a "
            "missing [DONE] is a lost stream (lost_streams_<delivery>, over all runs).",
            "exit_noise_lines_<delivery>: lines the worker's processes printed (stdout and "
            "stderr) after its exit report that look like a traceback, warning or error "
            "(e.g. AsyncLLM.__del__'s TypeError, the resource tracker's 'leaked "
            "shared_memory' warning, nanobind leak reports), plus any traceback or 'leaked' "
            "line after the signal; samples per run in parameters.runs[].exit_noise. "
            "shm_left_<delivery>: /dev/shm entries that appeared during the run and were "
            "still there once every process was gone (removed after being counted, unless a "
            "live process maps them). parameters.runs[].shutdown_warnings: "
            "WARNING/ERROR log lines between the signal and the exit report (the signal "
            "guard logs each signal an engine process ignored).",
            f"Runs: rounds of one run per delivery (order rotated), at most {runs} per "
            f"delivery, none started past a {budget_s:g} s budget; a 2-CPU machine shared "
            "with other work moves every figure here (the engine's teardown is CPU-bound).",
        ],
    )


def run(runs: int = RUNS, budget_s: float = TIME_BUDGET_S,
        deliveries: Sequence[str] = DELIVERIES) -> Result:
    from tests.integration.vllm.tiny_model import build_tiny_llama  # needs torch

    with tempfile.TemporaryDirectory(prefix="quiesce-bench-shutdown-") as tmp:
        model = build_tiny_llama(Path(tmp) / "tiny-llama")
        done = measure(model, deliveries, runs, budget_s)
    return build_result(done, deliveries, runs, budget_s,
                        "tiny random-weight Llama from tests/integration/vllm/tiny_model.py "
                        f"(served in {DTYPE}, max_model_len {MAX_MODEL_LEN})")


HEADLINE = tuple(f"exit_after_drained_s_{d}" for d in DELIVERIES) + tuple(
    f"lost_streams_{d}" for d in DELIVERIES) + tuple(f"exit_noise_lines_{d}" for d in DELIVERIES)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shutdown",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=RUNS, help="runs per delivery at most")
    parser.add_argument("--budget", type=float, default=TIME_BUDGET_S,
                        help="seconds after which no run starts")
    parser.add_argument("--delivery", action="append", choices=DELIVERIES,
                        help="only these deliveries (repeatable; default: all)")
    args = parser.parse_args(argv)
    deliveries = tuple(args.delivery or DELIVERIES)
    run_and_report(NAME, lambda: run(args.runs, args.budget, deliveries), HEADLINE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
