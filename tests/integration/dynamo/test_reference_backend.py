"""The reference worker registered as a Dynamo backend (``quiesce serve --dynamo``): its
simulated engine behind Dynamo's real frontend (ai-dynamo 1.6.1), under quiesce's drain
and under Dynamo's own graceful-shutdown helper.

Each stream is read to its end through the frontend (``stream_completion``): a 200 with
an error event inside is a lost request. A stream of ``TOKENS`` tokens lasts about
``TOKENS × STEP_S`` = 3 s; Dynamo's helper gets a 1 s grace here (its own
``DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS``; 5 s as shipped) so that the test stays short
and the streams still outlive it. One frontend per module; each test starts its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.integration.dynamo.processes import (
    GRACE_ENV,
    assert_drained,
    dynamo_env,
    exit_report,
    free_port,
    streams_then,
    wait_for_model,
)
from tests.integration.dynamo.reference import reference_worker
from tests.integration.worker_process import (
    StreamResult,
    Worker,
    running,
    tail,
)

STREAMS = 4
TOKENS = 150
STEP_S = 0.02
EXIT_TIMEOUT_S = 60.0


async def _streams_then(url: str, model: str, act: Callable[[], object]
                        ) -> list[StreamResult]:
    return await streams_then(url, model, act, streams=STREAMS, tokens=TOKENS, timeout_s=60)


def _listed(url: str, model: str) -> bool:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        data = httpx.get(f"{url}/v1/models", timeout=2).json().get("data", [])
        return any(entry.get("id") == model for entry in data)
    return True  # unknown: counted as still listed


def _unlisted_within(url: str, model: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _listed(url, model):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


async def test_quiesce_completes_every_stream_and_exits_drained(
        tiny_model: Path, cluster_dir: Path, frontend_url: str) -> None:
    """SIGTERM mid-stream: quiesce unregisters the model card and the instance, keeps
    admitting through the router grace, waits for every admitted stream and the idle
    engine, then exits 0 drained; the frontend no longer lists the model."""
    model = str(tiny_model)
    with reference_worker(cluster_dir / "store", tiny_model, decode_step_s=STEP_S) as worker:
        await asyncio.to_thread(wait_for_model, frontend_url, model)
        status = worker.status()
        assert status["state"] == "serving" and status["dynamo"] == {
            "endpoint": "dynamo.backend.generate", "shutdown": "quiesce"}, status
        results = await _streams_then(frontend_url, model, worker.signal)
        code, _ = await asyncio.to_thread(worker.finish, EXIT_TIMEOUT_S)
    assert all(r.complete for r in results), f"{results}\n{tail(worker.lines)}"
    assert_drained(worker, code, STREAMS)
    assert await asyncio.to_thread(_unlisted_within, frontend_url, model, 10.0), \
        "the model card outlived the worker"


async def test_dynamo_default_cuts_the_streams_at_its_grace(
        tiny_model: Path, cluster_dir: Path, frontend_url: str) -> None:
    """The same worker with Dynamo's own helper (``--dynamo-shutdown dynamo``): it
    unregisters the instance, sleeps its grace, then the handlers abort what is left, as
    dynamo.vllm's do. The client sees HTTP 200 and an error event: the field report."""
    model = str(tiny_model)
    env = {**dynamo_env(cluster_dir / "store"), GRACE_ENV: "1"}
    with reference_worker(cluster_dir / "store", tiny_model, shutdown="dynamo",
                          decode_step_s=STEP_S, env=env) as worker:
        await asyncio.to_thread(wait_for_model, frontend_url, model)
        results = await _streams_then(frontend_url, model, worker.signal)
        code, _ = await asyncio.to_thread(worker.finish, EXIT_TIMEOUT_S)
    lost = [r for r in results if not r.complete]
    assert len(lost) == STREAMS, f"{results}\n{tail(worker.lines)}"
    for result in lost:  # the blind spot: a 200 whose stream ends in an error event
        assert result.status == 200 and result.errors and result.finish_reason is None, result
    report = exit_report(worker)
    assert code == 5 and report is not None, tail(worker.lines)
    assert report["shutdown"] == "dynamo" and report["lost_requests"] == STREAMS, report


HELD_MARK = "quiesce-test: the model card is registered, held"
HELD_CARD = """\
import asyncio, os, pathlib, sys
import dynamo.llm
from quiesce.ops.cli import main

register = dynamo.llm.register_model

async def held_register_model(*args, **kwargs):
    await register(*args, **kwargs)
    print(os.environ["QUIESCE_TEST_HELD_MARK"], flush=True)
    release = pathlib.Path(os.environ["QUIESCE_TEST_RELEASE"])
    while not release.exists():
        await asyncio.sleep(0.05)

dynamo.llm.register_model = held_register_model
sys.exit(main(["--verbose", "serve", *sys.argv[1:]]))
"""
"""``quiesce serve`` whose Dynamo model registration (``dynamo.llm.register_model``, as
:mod:`quiesce.adapters.dynamo.backend` calls it) is held once the card is published,
until the file ``QUIESCE_TEST_RELEASE`` exists; everything else is the real worker."""


def _wait_for_line(worker: Worker, text: str, timeout_s: float = EXIT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in worker.lines):
        assert worker.process.poll() is None and time.monotonic() < deadline, \
            tail(worker.lines)
        time.sleep(0.02)


async def test_sigterm_while_the_card_registers_never_serves(
        tiny_model: Path, cluster_dir: Path, frontend_url: str, tmp_path: Path) -> None:
    """SIGTERM while Dynamo registers the model card: the endpoint is never served (no
    ready line), the drain takes the card off, exit 0 drained; the frontend does not
    list the model afterwards."""
    model = str(tiny_model)
    release = tmp_path / "release"
    env = {**dynamo_env(cluster_dir / "store"), "QUIESCE_TEST_HELD_MARK": HELD_MARK,
           "QUIESCE_TEST_RELEASE": str(release)}
    command = [sys.executable, "-c", HELD_CARD, "--dynamo", "--model", model,
               "--dynamo-discovery-backend", "file", "--admin-port", str(free_port()),
               "--budget", "30", "--decode-step", str(STEP_S)]
    with running(command, env, HELD_MARK, timeout_s=60,
                 name="quiesce serve --dynamo (card held)") as worker:
        worker.signal()
        await asyncio.to_thread(_wait_for_line, worker, "shutdown requested by SIGTERM")
        release.touch()
        code, _ = await asyncio.to_thread(worker.finish, EXIT_TIMEOUT_S)
    report = exit_report(worker)
    assert code == 0 and report is not None, tail(worker.lines)
    assert report["outcome"] == "drained" and report["lost_requests"] == 0, report
    assert not any('"event": "ready"' in line for line in worker.lines), tail(worker.lines)
    assert await asyncio.to_thread(_unlisted_within, frontend_url, model, 10.0), \
        "the model card outlived the worker"
