"""vLLM's own server (``vllm serve``) with quiesce's middleware, on the real CPU engine.

One ``vllm serve`` per scenario (each ends its server): the tiny model, engine steps
paced to 20 ms so that every stream is still running when the signal lands. Each stream
is read to its end, every event: a 200 with an error event inside is a lost request.

- the four ways a worker is really stopped (:data:`serve_process.DELIVERIES`), each
  under streaming load: every stream completes with every token, readiness fails at
  once, a request after the router grace gets the typed, retryable 503, and the server
  exits 0 with quiesce's report ``drained``, nothing lost. The first also drains and
  resumes through the admin API first, and reads quiesce's metrics in vLLM's /metrics;
- EngineCore killed mid-drain: the streams it cut are counted lost, the report is never
  ``drained`` and the exit code is not 0; killed with no signal at all (vLLM's watchdog
  stops its server on its own): the same streams lost, the exit line ``server_stopped``
  and exit code 5, where vLLM alone exits 0;
- a bad quiesce setting: vLLM refuses to start, naming it, before the engine loads.

The middleware's own refusal (no claim in its process) is tests/unit/test_vllm_serve_face.py.

The NIXL prefill/decode pair of two ``vllm serve`` is test_vllm_serve_disagg.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.vllm.conftest import SKIP_REASON
from tests.integration.vllm.serve_process import (
    DELIVERIES,
    deliver,
    engine_core_pids,
    paced,
    serve_command,
    serve_env,
    vllm_serve,
)
from tests.integration.worker_process import (
    StreamResult,
    Worker,
    drain_and_resume,
    ready_status,
    refused_while_draining,
    stream_completion,
)

pytest.importorskip("vllm", reason=SKIP_REASON)

pytestmark = [pytest.mark.slow]

STREAMS = 6
TOKENS = 120
STEP_S = 0.02
"""120 tokens at 20 ms a step: every stream lasts ~2.4 s, longer than the router grace."""
SETTINGS = "--budget 30 --router-grace 0.3"
EXIT_S = 60.0


async def load_then(worker: Worker, act: object, count: int = STREAMS,
                    tokens: int = TOKENS) -> list[StreamResult]:
    """``count`` streaming completions; once each has its first token, ``act()``; then
    every stream is read to its end."""
    started = [asyncio.Event() for _ in range(count)]
    streams = [asyncio.create_task(stream_completion(
        worker.url, tokens, started=event, ignore_eos=True, prompt=f"hello {n} world",
        timeout_s=60)) for n, event in enumerate(started)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    await asyncio.to_thread(act)  # type: ignore[arg-type]
    return list(await asyncio.gather(*streams))


def check_serving(worker: Worker, *, resume: bool) -> None:
    """Every engine process guarded; with ``resume``, a drain and resume through the admin
    API, and quiesce's metrics on vLLM's own /metrics."""
    status = worker.status()
    assert status["signal_guard"]["protected"] is True, status["signal_guard"]  # type: ignore[index]
    if resume:
        drain_and_resume(worker)
        metrics = httpx.get(f"{worker.url}/metrics", timeout=10).text
        assert 'quiesce_state{state="serving"} 1.0' in metrics


@pytest.mark.parametrize("how", DELIVERIES)
async def test_every_delivery_under_streaming_load_drains_with_nothing_lost(
        tiny_model: Path, how: str) -> None:
    with vllm_serve(tiny_model, "--kv-transfer-config", paced(STEP_S),
                    quiesce_args=SETTINGS) as worker:
        await asyncio.to_thread(check_serving, worker, resume=how == "main")
        refusals: list[dict[str, object]] = []

        def signal_then_probe() -> None:
            signalled = deliver(worker.process.pid, how)
            assert len(signalled) >= (1 if how == "main" else 3), signalled
            assert ready_status(worker) == 503
            refusals.append(refused_while_draining(worker))

        streams = await load_then(worker, signal_then_probe)
        code, report = worker.finish(EXIT_S)
    assert [s for s in streams if not s.complete] == [], streams
    assert refusals[0]["type"] == "worker_draining" and refusals[0]["retryable"] is True
    assert code == 0, worker.lines[-30:]
    assert report is not None and report["drained"] is True and report["lost_requests"] == 0
    assert report["signal"] == ("SIGINT" if how == "int" else "SIGTERM")
    requests = report["requests"]
    assert isinstance(requests, dict) and requests["completed"] >= STREAMS


@pytest.mark.parametrize("signalled", [True, False], ids=["mid-drain", "no-signal"])
async def test_engine_core_killed_is_lost_never_drained(tiny_model: Path,
                                                        signalled: bool) -> None:
    with vllm_serve(tiny_model, "--kv-transfer-config", paced(STEP_S),
                    quiesce_args="--budget 12 --reserve 3 --router-grace 0.2") as worker:
        (engine_core,) = engine_core_pids(worker.process.pid)

        def kill_the_engine() -> None:
            if signalled:
                os.kill(worker.process.pid, signal.SIGTERM)
                time.sleep(0.5)  # the drain is waiting on the streams
            os.kill(engine_core, signal.SIGKILL)

        streams = await load_then(worker, kill_the_engine, tokens=400)
        code, report = worker.finish(EXIT_S)
    cut = [s for s in streams if not s.complete]
    assert cut, "every stream completed although its engine was killed"
    assert all(s.errors for s in cut)
    assert code not in (0, None), worker.lines[-30:]
    assert report is not None and report["drained"] is False
    assert isinstance(report["lost_requests"], int) and report["lost_requests"] >= len(cut)
    if not signalled:  # vLLM's watchdog stopped its server: vLLM's own path exits 0
        assert report["outcome"] == "server_stopped", report
        assert code == 5, worker.lines[-30:]


def test_a_bad_setting_refuses_the_start_naming_it(tiny_model: Path) -> None:
    command = serve_command(tiny_model, 1)
    done = subprocess.run(command, env=serve_env("--budget 10 --reserve 10"), text=True,
                          capture_output=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "quiesce refuses to start: --reserve" in done.stderr
    assert "Starting vLLM" not in done.stdout + done.stderr  # before the engine
