"""DynamoDiscovery and the draining shutdown against the real Dynamo runtime (1.6.1).

Runs in the Dynamo environment (``bash ci/setup_dynamo.sh``; ``.venv-dynamo/bin/pytest
tests/integration/test_dynamo_discovery.py``); elsewhere it skips, saying so.

Two worker processes (this module run as ``python -m tests.integration.test_dynamo_discovery
worker NAME``) serve ``quiesce.backend.generate`` with the runtime's ``file`` discovery
backend and ``tcp`` request plane, all on 127.0.0.1, each with the real
:class:`~quiesce.lifecycle.Lifecycle` over :class:`DynamoDiscovery` and the
:func:`gated` handler. The test process is the Dynamo client (router) that routes to them.
Workers take commands on stdin and answer JSON lines on stdout. Every wait is bounded;
latencies are printed, never asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from quiesce.admission import AdmissionGate
from quiesce.budget import Deadline
from quiesce.drain import DrainConfig
from quiesce.probe import PendingWork, Probe, Role

try:
    import dynamo.runtime  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
except ImportError:
    HAVE_DYNAMO = False
else:
    HAVE_DYNAMO = True

from quiesce.adapters.dynamo import (
    LOOPBACK_ENV,
    DynamoDiscovery,
    gated,
    install_signal_handlers,
    loopback_runtime,
)

ROOT = Path(__file__).resolve().parents[2]
ENDPOINT = "quiesce.backend.generate"
SKIP_REASON = ("ai-dynamo-runtime is not installed here: run bash ci/setup_dynamo.sh, then "
               ".venv-dynamo/bin/pytest tests/integration/"
               "test_dynamo_discovery.py")


class IdleEngine(Probe):
    """The workers' engine is the handler itself: nothing outlives a stream."""

    def __init__(self) -> None:
        super().__init__(Role.AGGREGATED, "test.idle")

    async def pending_work(self) -> PendingWork:
        return PendingWork.idle(self.role, self.source)


# -- the worker process ---------------------------------------------------------------

def emit(**event: Any) -> None:
    print(json.dumps(event, default=str), flush=True)


async def worker(name: str) -> int:
    from quiesce.lifecycle import DrainRun, Lifecycle

    loop = asyncio.get_running_loop()
    runtime = loopback_runtime(loop)
    endpoint = runtime.endpoint(ENDPOINT)
    gate = AdmissionGate()

    async def generate(request: dict[str, Any], context: Any = None) -> AsyncIterator[Any]:
        for i in range(int(request.get("n", 3))):
            if request.get("delay"):
                await asyncio.sleep(float(request["delay"]))
            yield {"worker": name, "i": i}

    served = asyncio.ensure_future(endpoint.serve_endpoint(gated(generate, gate)))
    me = endpoint.connection_id()
    client = await endpoint.client()
    deadline = Deadline.after(20.0)
    delay = 0.001
    while me not in client.instance_ids():  # serve_endpoint registers in the background
        if deadline.expired() or served.done():
            emit(event="error", detail="own instance never listed")
            return 2
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
    discovery = DynamoDiscovery(endpoint, registered=True)
    lifecycle = Lifecycle(gate=gate, probe=IdleEngine(), discovery=discovery,
                          config=DrainConfig(router_grace_s=0.2, registration_timeout_s=10.0))
    shutdown_event = asyncio.Event()
    install_signal_handlers(loop, runtime, discovery, shutdown_event, gate=gate,
                            probe=lifecycle.probe, grace_period_s=0.2, budget_s=20.0,
                            on_done=lambda report: emit(event="shutdown",
                                                        report=report.to_dict()))
    emit(event="ready", name=name, instance_id=me)

    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    background: set[asyncio.Task[None]] = set()

    async def report_when_done(run: DrainRun) -> None:
        report = await run.wait()
        emit(event="drain_done", report=None if report is None else report.to_dict(),
             status=lifecycle.status().to_dict())

    commands = asyncio.ensure_future(reader.readline())
    while True:
        done, _ = await asyncio.wait({commands, served}, return_when=asyncio.FIRST_COMPLETED)
        if served in done:
            break
        line = commands.result().decode().strip()
        if not line or line == "quit":
            runtime.shutdown()
            await asyncio.wait({served}, timeout=20.0)
            break
        commands = asyncio.ensure_future(reader.readline())
        if line == "drain":
            run = await lifecycle.drain(budget_s=20.0)
            emit(event="draining", generation=run.generation)

            background.add(loop.create_task(report_when_done(run)))
        elif line == "resume":
            await lifecycle.resume()
            emit(event="resumed", status=lifecycle.status().to_dict())
        elif line in ("unregister", "register"):  # raw calls, timed (the benchmark)
            started = time.monotonic()
            await getattr(discovery, line)()
            emit(event=line, started=started, returned=time.monotonic())
        else:
            emit(event="error", detail=f"unknown command {line!r}")
    commands.cancel()
    emit(event="exit")
    return 0


# -- the test (the Dynamo client) ------------------------------------------------------

class Worker:
    def __init__(self, process: asyncio.subprocess.Process, name: str) -> None:
        self.process = process
        self.name = name
        self.instance_id = 0

    async def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{command}\n".encode())
        await self.process.stdin.drain()

    async def expect(self, event: str, timeout_s: float = 20.0) -> dict[str, Any]:
        assert self.process.stdout is not None
        deadline = Deadline.after(timeout_s)
        while True:
            try:
                line = await asyncio.wait_for(self.process.stdout.readline(),
                                              deadline.remaining())
            except (TimeoutError, asyncio.TimeoutError):
                pytest.fail(f"worker {self.name}: no {event!r} within {timeout_s:g}s")
            if not line:
                pytest.fail(f"worker {self.name} exited before {event!r}")
            if not line.startswith(b"{"):
                continue  # not ours
            message: dict[str, Any] = json.loads(line)
            assert message["event"] != "error", message
            if message["event"] == event:
                return message


def child_env(store: Path) -> dict[str, str]:
    return {**os.environ, **LOOPBACK_ENV, "DYN_FILE_KV": str(store),
            "DYN_LOG": os.environ.get("DYN_LOG", "warn"), "PYTHONUNBUFFERED": "1"}


async def start_worker(name: str, store: Path) -> Worker:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.integration.test_dynamo_discovery", "worker", name,
        cwd=ROOT, env=child_env(store), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    started = Worker(process, name)
    ready = await started.expect("ready", 60.0)
    started.instance_id = int(ready["instance_id"])
    return started


async def stop_worker(worker: Worker) -> None:
    if worker.process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            worker.process.kill()
        await asyncio.wait_for(worker.process.wait(), 20.0)


async def until_listed(client: Any, instance_id: int, listed: bool, timeout_s: float) -> float:
    """Seconds until ``instance_id`` is (or is not) among the client's instances; fails
    after ``timeout_s``. Polls the client's watched snapshot (1 ms doubling to 20 ms)."""
    started = time.monotonic()
    deadline = Deadline.after(timeout_s)
    delay = 0.0005
    while (instance_id in client.instance_ids()) != listed:
        if deadline.expired():
            pytest.fail(f"instance {instance_id:x} still {'un' if listed else ''}listed "
                        f"after {timeout_s:g}s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.02)
    return time.monotonic() - started


def _plain(item: Any) -> dict[str, Any]:
    data = item.data() if hasattr(item, "data") else item
    assert isinstance(data, dict), data
    return data


async def collect(stream: Any) -> list[dict[str, Any]]:
    return [_plain(item) async for item in stream]


async def in_flight(client: Any, request: dict[str, Any],
                    instance_id: int) -> asyncio.Future[list[dict[str, Any]]]:
    """A stream to ``instance_id`` that has delivered its first item; the future gives
    every item once the stream ends."""
    stream = await client.direct(request, instance_id)
    first = _plain(await asyncio.wait_for(stream.__anext__(), 20.0))

    async def rest() -> list[dict[str, Any]]:
        return [first, *await collect(stream)]

    return asyncio.ensure_future(rest())


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[Any, Worker, Worker]]:
    if not HAVE_DYNAMO:
        pytest.skip(SKIP_REASON)
    store = tmp_path / "dynamo_store_kv"
    store.mkdir()
    for key, value in child_env(store).items():
        if key.startswith("DYN_"):
            os.environ[key] = value
    runtime = loopback_runtime(asyncio.get_running_loop(), str(store))
    workers: list[Worker] = []
    try:
        workers.append(await start_worker("A", store))
        workers.append(await start_worker("B", store))
        client = await runtime.endpoint(ENDPOINT).client()
        for w in workers:
            await until_listed(client, w.instance_id, True, 20.0)
        yield client, workers[0], workers[1]
    finally:
        for w in workers:
            await stop_worker(w)
        runtime.shutdown()


async def test_drained_worker_leaves_the_router_its_stream_finishes_and_resume_returns_it(
        cluster: tuple[Any, Worker, Worker]) -> None:
    client, a, _ = cluster
    long = await in_flight(client, {"n": 20, "delay": 0.05}, a.instance_id)
    await a.send("drain")
    await a.expect("draining")
    gone_after = await until_listed(client, a.instance_id, False, 10.0)
    print(f"\nthe client stopped listing A {1e3 * gone_after:.1f} ms after the drain began")
    assert not long.done()  # A's stream is still in flight while routers already left
    picked = [(await collect(await client.round_robin({"n": 1})))[0]["worker"]
              for _ in range(8)]
    assert picked == ["B"] * 8

    tokens = await asyncio.wait_for(long, 20.0)
    assert [t["worker"] for t in tokens] == ["A"] * 20 and tokens[-1]["i"] == 19
    done = await a.expect("drain_done")
    assert done["report"]["drained"] is True
    assert done["status"]["state"] == "drained"
    assert done["status"]["discovery_registered"] is False
    assert done["status"]["requests"]["ended_since_drain"]["completed"] >= 1
    assert done["status"]["requests"]["ended_since_drain"]["lost"] == 0

    await a.send("resume")
    resumed = await a.expect("resumed")
    assert resumed["status"]["state"] == "serving"
    assert resumed["status"]["discovery_registered"] is True
    await until_listed(client, a.instance_id, True, 10.0)
    picked = [(await collect(await client.round_robin({"n": 1})))[0]["worker"]
              for _ in range(8)]
    assert set(picked) == {"A", "B"}


async def test_sigterm_drains_instead_of_a_fixed_grace_and_exits_cleanly(
        cluster: tuple[Any, Worker, Worker]) -> None:
    client, a, _ = cluster
    # longer than Dynamo's default 5 s grace: a fixed grace would abort it
    long = await in_flight(client, {"n": 30, "delay": 0.2}, a.instance_id)
    a.process.send_signal(signal.SIGTERM)
    await until_listed(client, a.instance_id, False, 10.0)
    picked = [(await collect(await client.round_robin({"n": 1})))[0]["worker"]
              for _ in range(4)]
    assert picked == ["B"] * 4
    tokens = await asyncio.wait_for(long, 30.0)
    assert len(tokens) == 30 and {t["worker"] for t in tokens} == {"A"}
    report = (await a.expect("shutdown", 30.0))["report"]
    assert report["drained"] is True and report["left_inflight"] == 0
    stages = {s["stage"]: s["outcome"] for s in report["stages"]}
    assert stages["unregister"] == "completed" and stages["inflight"] == "completed"
    assert stages["runtime_shutdown"] == "completed"
    await a.expect("exit", 30.0)
    assert await asyncio.wait_for(a.process.wait(), 30.0) == 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        sys.exit(asyncio.run(worker(sys.argv[2])))
    sys.exit("usage: python -m tests.integration.test_dynamo_discovery worker NAME")
