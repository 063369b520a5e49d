"""Truth on every shutdown path, with the real vLLM engine on the CPU.

`quiesce serve --engine vllm` under streaming load, stopped the ways a worker really is:

- SIGTERM to the main process (the kubelet);
- SIGTERM to the whole process group (an init shim: dumb-init, ``tini -g``);
- SIGINT to the whole process group (Ctrl-C in a terminal);
- SIGTERM to every process of the worker, one by one (systemd's control-group kill,
  ``pkill -f``).

Each must drain and lose nothing: every stream is read to its end and must deliver
exactly its ``max_tokens`` (``ignore_eos``) with finish reason ``length`` and no error
event; the worker reports ``drained`` with zero lost requests and exits 0 within its
budget, printing no traceback and no leaked-resource warning. Processes are listed
with psutil, independently of the worker's own /proc reader.

The report is checked too: EngineCore's entry must say that vLLM's own handler is what
the guard wraps (vLLM 0.31 installs it after quiesce's plugin ran; 0.32 before), at
start and when read again from ``GET /engine/status``.

The forced case: EngineCore is SIGKILLed mid-drain; status and the exit report must
count every lost stream and never say drained.

The GPU suite (tests/gpu/test_vllm.py) collects this module for the CUDA build.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.vllm.conftest import SKIP_REASON
from tests.integration.worker_process import TOKEN, StreamResult, stream_completion, worker_env

pytest.importorskip("vllm", reason=SKIP_REASON)
psutil = pytest.importorskip("psutil", reason="psutil comes with vLLM's environment")

pytestmark = [pytest.mark.slow]

BUDGET_S = 60.0
STREAMS = 12
MAX_TOKENS = 300
STEP_S = 0.01
PACED = json.dumps({
    "kv_connector": "PacedConnector", "kv_role": "kv_producer",
    "kv_connector_module_path": "tests.integration.vllm.paced_connector",
    "kv_connector_extra_config": {"step_s": STEP_S}})
"""Every engine step takes at least STEP_S, so a stream of MAX_TOKENS lasts about 3 s
(tests/integration/vllm/paced_connector.py): the streams are all in the engine when
the signal comes, by construction rather than by luck."""
ENGINE_CORE = "VLLM::EngineCore"
"""EngineCore's process title as psutil reads it (vLLM sets it)."""
KILLED_STREAMS = 16

EXIT_NOISE = ("Traceback", "Exception ignored", "leaked shared_memory", "resource_tracker")
"""What must not appear in a clean worker's output."""


@dataclass
class ServedWorker:
    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    port: int = 0
    admin_port: int = 0

    def events(self, kind: str) -> list[dict[str, object]]:
        found = []
        for line in list(self.lines):
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if isinstance(event, dict) and event.get("event") == kind:
                    found.append(event)
        return found

    def status(self) -> dict[str, object]:
        answer = httpx.get(f"http://127.0.0.1:{self.admin_port}/engine/status",
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        answer.raise_for_status()
        data: dict[str, object] = answer.json()
        return data

    def processes(self) -> list[Any]:
        """The worker's main process and every descendant (psutil.Process objects)."""
        main = psutil.Process(self.process.pid)
        return [main, *main.children(recursive=True)]


@contextlib.contextmanager
def serve(model: Path, *extra: str) -> Iterator[ServedWorker]:
    """`quiesce serve --engine vllm` in a session of its own (as a container's PID 1 would
    be), stdout and stderr read together so the test sees everything it printed."""
    from tests.integration.vllm.tiny_model import engine_kwargs

    kwargs = engine_kwargs()
    args = [sys.executable, "-m", "quiesce", "serve", "--engine", "vllm", "--model", str(model),
            "--dtype", kwargs["dtype"], "--port", "0", "--admin-port", "0",
            "--budget", str(BUDGET_S), "--router-grace", "0.2",
            "--kv-transfer-config", PACED, *extra]
    if "gpu_memory_utilization" in kwargs:
        args += ["--gpu-memory-utilization", str(kwargs["gpu_memory_utilization"])]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=worker_env(), start_new_session=True)
    worker = ServedWorker(process)
    ready = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            worker.lines.append(line)
            if '"event": "ready"' in line:
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        ready.wait(300)
        events = worker.events("ready")
        assert events, "worker never ready:\n" + "".join(worker.lines[-40:])
        event = events[0]
        worker.port = int(event["port"])  # type: ignore[call-overload]
        worker.admin_port = int(event["admin_port"])  # type: ignore[call-overload]
        yield worker
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        reader.join(timeout=10)


async def stream(worker: ServedWorker, started: asyncio.Event) -> StreamResult:
    """One stream of exactly MAX_TOKENS tokens (``ignore_eos``), read to its end."""
    return await stream_completion(
        f"http://127.0.0.1:{worker.port}", MAX_TOKENS, started=started,
        prompt="hello world the quick brown fox", ignore_eos=True, include_usage=True,
        timeout_s=120)


def in_engine(status: dict[str, object]) -> int:
    """Requests the engine itself is generating (its scheduler's running + waiting)."""
    pending = status.get("pending_work")
    if not isinstance(pending, dict):
        return 0
    return sum(n for n in (pending.get("running"), pending.get("waiting"))
               if isinstance(n, int))


def when_generating(worker: ServedWorker, count: int, act: Callable[[], None]) -> None:
    """Call ``act`` as soon as the engine is generating at least ``count`` requests.

    The engine's own view (the probe's scheduler counts in ``GET /engine/status``), read
    in a thread of its own (``asyncio.to_thread``) so the test's busy event loop adds no
    delay: a client reads its stream long after the engine finished it, so neither the
    client's first token nor the worker's in-flight count says that generation runs."""
    deadline = time.monotonic() + 120
    while in_engine(worker.status()) < count:
        assert time.monotonic() < deadline, f"never {count} requests generating at once"
        time.sleep(0.002)
    act()


def deliver(worker: ServedWorker, how: str) -> None:
    """Send the stop signal the way ``how`` names."""
    if how == "main":
        worker.process.send_signal(signal.SIGTERM)
    elif how == "group":
        os.killpg(worker.process.pid, signal.SIGTERM)
    elif how == "group-sigint":
        os.killpg(worker.process.pid, signal.SIGINT)
    elif how == "every-process":
        for process in worker.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGTERM)
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", ["main", "group", "group-sigint", "every-process"])
async def test_signal_under_streaming_load_loses_nothing(tiny_model: Path, how: str) -> None:
    with serve(tiny_model) as worker:
        ready = worker.events("ready")[0]
        guard = ready["signal_guard"]
        assert isinstance(guard, dict) and guard["protected"] is True, guard
        engine_processes = worker.processes()[1:]
        assert len(engine_processes) >= 2  # EngineCore and its model runner, at least
        # what is guarded is EngineCore's own handler, whichever vLLM installed it first
        # (0.31 installs it after quiesce's plugin ran, 0.32 before), and the report
        # read now (GET /engine/status) agrees with the one at start
        (core,) = [p for p in engine_processes if p.name() == ENGINE_CORE]
        for report in (guard, worker.status()["signal_guard"]):
            assert isinstance(report, dict) and report["protected"] is True, report
            (entry,) = [p for p in report["processes"] if p["pid"] == core.pid]
            assert entry["how"].endswith("run_engine_core.<locals>.signal_handler)"), entry

        started = [asyncio.Event() for _ in range(STREAMS)]
        streams = [asyncio.create_task(stream(worker, s)) for s in started]
        # the signal comes while the engine generates every one of them
        await asyncio.to_thread(when_generating, worker, STREAMS,
                                lambda: deliver(worker, how))
        signalled = time.monotonic()
        code = await asyncio.to_thread(worker.process.wait, BUDGET_S + 30)
        elapsed = time.monotonic() - signalled
        results = await asyncio.gather(*streams)

    output = "".join(worker.lines)
    (report,) = worker.events("exit")
    assert code == 0, output[-4000:]
    assert report["outcome"] == "drained" and report["drained"] is True, report
    assert report["lost_requests"] == 0, report
    requests = report["requests"]
    assert isinstance(requests, dict), report
    # all were generating at the signal: each ended during the drain, completed
    assert requests == {"completed": STREAMS, "lost": 0, "client_gone": 0, "rejected": 0}, \
        report
    assert elapsed < BUDGET_S, elapsed
    for result in results:
        assert result.complete, result
    for noise in EXIT_NOISE:
        assert noise not in output, f"{noise!r} printed:\n{output[-4000:]}"
    for process in engine_processes:  # the engine's processes are gone with the worker
        assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE


async def test_engine_killed_mid_drain_reports_every_lost_request(tiny_model: Path) -> None:
    """What the clients saw and what the worker reports must agree, stream for stream."""
    with serve(tiny_model, "--budget", "20", "--reserve", "4") as worker:
        started = [asyncio.Event() for _ in range(KILLED_STREAMS)]
        streams = [asyncio.create_task(stream(worker, s)) for s in started]
        (engine_core,) = [p for p in worker.processes() if p.name() == ENGINE_CORE]
        drains: list[httpx.Response] = []

        def drain_then_kill() -> None:
            drains.append(httpx.post(f"http://127.0.0.1:{worker.admin_port}/engine/drain",
                                     headers={"Authorization": f"Bearer {TOKEN}"}, json={},
                                     timeout=10))
            engine_core.kill()

        await asyncio.to_thread(when_generating, worker, KILLED_STREAMS, drain_then_kill)
        assert drains[0].status_code == 202, drains[0].text
        results = await asyncio.gather(*streams)
        cut = sum(1 for r in results if not r.complete)
        assert cut >= 1, results  # the engine died under running streams
        assert all(r.errors for r in results if not r.complete), results  # each was told

        status = await asyncio.to_thread(worker.status)
        assert status["state"] == "draining", status  # never drained
        requests = status["requests"]
        assert isinstance(requests, dict)
        assert requests["ended_since_drain"]["lost"] == cut, requests

        worker.process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(worker.process.wait, 60)

    (report,) = worker.events("exit")
    assert code != 0
    assert report["drained"] is False and report["outcome"] in ("forced", "lost"), report
    assert report["lost_requests"] == cut, report
