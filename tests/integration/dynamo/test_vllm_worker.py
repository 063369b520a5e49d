"""Dynamo's own ``dynamo.vllm`` worker behind Dynamo's real frontend: as shipped, and under
``quiesce dynamo vllm`` (real ai-dynamo 1.6.1, real vLLM 0.31 engine on the CPU).

Each stream is read to its end through the frontend (``stream_completion``): a 200 with an
error event inside is a lost request. The engine is paced (each step at least
``STEP_S``), so a stream of ``TOKENS`` tokens lasts several seconds, longer than Dynamo's
5 s grace. One frontend per module; each test starts its own worker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from quiesce.signal_guard import descendants
from tests.integration.dynamo.processes import (
    assert_drained,
    dynamo_env,
    exit_report,
    free_port,
    quiesce_worker,
    shipped_worker,
    streams_then,
    vllm_args,
    wait_for_model,
)
from tests.integration.worker_process import (
    StreamResult,
    running,
    signal_group,
    tail,
)

STREAMS = 3
TOKENS = 300  # about 6 s at the paced step: past Dynamo's 5 s grace
EXIT_TIMEOUT_S = 90.0


def _args(tiny_model: Path, cluster_dir: Path) -> list[str]:
    return vllm_args(tiny_model, cluster_dir / "chat.jinja")


async def _streams_then(url: str, model: str, act: Callable[[], object]
                        ) -> list[StreamResult]:
    return await streams_then(url, model, act, streams=STREAMS, tokens=TOKENS)


def _alive(pids: list[int]) -> list[int]:
    """The pids of ``pids`` that still exist (zombies of this test's children aside)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(")")[-1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        alive.append(pid)
    return alive


def _outlived(pids: list[int], grace_s: float = 10.0) -> list[int]:
    """The pids of ``pids`` still alive ``grace_s`` after the worker exited (orphans)."""
    deadline = time.monotonic() + grace_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(pids)


async def test_dynamo_as_shipped_cuts_the_streams_at_its_grace(
        tiny_model: Path, cluster_dir: Path, frontend_url: str) -> None:
    """The field report, reproduced: Dynamo's helper unregisters, sleeps 5 s, then its
    handlers abort what is left. The client sees HTTP 200 and an error event."""
    model = str(tiny_model)
    with shipped_worker(cluster_dir / "store", _args(tiny_model, cluster_dir)) as worker:
        wait_for_model(frontend_url, model)
        results = await _streams_then(frontend_url, model, worker.signal)
        code, _ = await asyncio.to_thread(worker.finish, EXIT_TIMEOUT_S)
    lost = [r for r in results if not r.complete]
    assert lost, f"every stream completed: {results}"
    for result in lost:  # the blind spot: a 200 whose stream ends in an error event
        assert result.status == 200 and result.errors and result.finish_reason is None
    assert code is not None, "Dynamo's worker did not exit"


@pytest.mark.parametrize("delivery", ["sigterm-group", "sigint-group"])
async def test_quiesce_completes_every_stream_and_exits_drained(
        tiny_model: Path, cluster_dir: Path, frontend_url: str, delivery: str) -> None:
    """The same worker under quiesce: a signal to the whole process group (an init shim's
    SIGTERM, a terminal's Ctrl-C) reaches vLLM's processes too, and still every stream
    completes, then the worker exits 0 with ``drained``. (The kubelet's preStop and
    SIGTERM to the main process: test_replay.py.)"""
    model = str(tiny_model)
    sig = signal.SIGINT if delivery.startswith("sigint") else signal.SIGTERM
    with quiesce_worker(cluster_dir / "store", _args(tiny_model, cluster_dir)) as worker:
        wait_for_model(frontend_url, model)
        guard = worker.status()["signal_guard"]
        assert isinstance(guard, dict) and guard["protected"] is True, guard
        pids = [worker.process.pid, *descendants(worker.process.pid)]

        def deliver() -> None:
            if delivery.endswith("group"):
                signal_group(worker.process.pid, sig)
            else:
                worker.signal(sig)

        results = await _streams_then(frontend_url, model, deliver)
        code, _ = await asyncio.to_thread(worker.finish, EXIT_TIMEOUT_S)
    assert all(r.complete for r in results), f"{results}\n{tail(worker.lines)}"
    assert_drained(worker, code, STREAMS)
    assert not _outlived(pids), "engine processes outlived the worker"


async def test_sigterm_during_model_load_stops_without_serving(
        tiny_model: Path, cluster_dir: Path) -> None:
    """A SIGTERM while vLLM loads the model: the worker never serves, stops its engine,
    reports drained (nothing was admitted) and exits 0, leaving no process behind."""
    command = [sys.executable, "-m", "quiesce", "dynamo", "vllm", "--admin-port",
               str(free_port()), "--budget", "30", "--", *_args(tiny_model, cluster_dir)]
    with running(command, dynamo_env(cluster_dir / "store"), "Starting to load model",
                 name="quiesce dynamo vllm") as worker:
        pids = [worker.process.pid, *descendants(worker.process.pid)]
        worker.signal(signal.SIGTERM)
        code, _ = await asyncio.to_thread(worker.finish, EXIT_TIMEOUT_S)
        pids += [pid for pid in descendants(worker.process.pid) if pid not in pids]
    report = exit_report(worker)
    assert code == 0 and report is not None, tail(worker.lines)
    assert report["outcome"] == "drained" and report["lost_requests"] == 0, report
    assert not any('"event": "ready"' in line for line in worker.lines)
    assert not _outlived(pids), "engine processes outlived the worker"


async def test_sigterm_as_soon_as_it_owns_its_signals_stops_cleanly(
        tiny_model: Path, cluster_dir: Path) -> None:
    """A SIGTERM right after start, before Dynamo or vLLM are even imported."""
    command = [sys.executable, "-m", "quiesce", "dynamo", "vllm", "--admin-port",
               str(free_port()), "--", *_args(tiny_model, cluster_dir)]
    with running(command, dynamo_env(cluster_dir / "store"), '"event": "starting"',
                 name="quiesce dynamo vllm") as worker:
        worker.signal(signal.SIGTERM)
        code, _ = await asyncio.to_thread(worker.finish, EXIT_TIMEOUT_S)
    report = exit_report(worker)
    assert code == 0 and report is not None and report["outcome"] == "drained", \
        tail(worker.lines)


async def test_a_second_signal_while_draining_exits_at_once(
        tiny_model: Path, cluster_dir: Path, frontend_url: str) -> None:
    """While streams drain, a second signal forces the exit (code 4) and takes the engine's
    processes with it."""
    model = str(tiny_model)
    with quiesce_worker(cluster_dir / "store", _args(tiny_model, cluster_dir)) as worker:
        wait_for_model(frontend_url, model)
        pids = [worker.process.pid, *descendants(worker.process.pid)]

        def twice() -> None:
            worker.signal(signal.SIGTERM)
            time.sleep(1.5)  # the drain is running: its router grace alone is 5 s
            worker.signal(signal.SIGTERM)

        await _streams_then(frontend_url, model, twice)
        code, _ = await asyncio.to_thread(worker.finish, EXIT_TIMEOUT_S)
    assert code == 4, tail(worker.lines)
    assert not _outlived(pids), "engine processes outlived the forced exit"
