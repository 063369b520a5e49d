"""Unregister → router: how long after a worker unregisters a watching router stops listing it.

etcd (``unregister_to_router_ms_etcd_*``): a throw-away etcd 3.4 on loopback
(:class:`~quiesce.adapters.etcd.local.LocalEtcd`, ``ci/setup_etcd.sh``), one
:class:`~quiesce.adapters.etcd.EtcdDiscovery` (the worker) and one
:class:`~quiesce.adapters.etcd.EtcdWatcher` (the router: its own gRPC channel and prefix
watch) in this process. Each sample: ``perf_counter`` right before ``unregister()``; the
router's change callback records ``perf_counter`` when the DELETE event is processed.
Then ``register()`` again and wait until the router lists it (``register_to_router``).

Dynamo (``unregister_to_router_ms_dynamo_*``, only where ``ci/setup_dynamo.sh`` built the
Dynamo environment): the real runtime 1.6.1, ``file`` discovery backend and ``tcp`` request
plane on loopback. A worker process (``tests/integration/test_dynamo_discovery.py``'s
worker) calls :class:`~quiesce.adapters.dynamo.DynamoDiscovery` ``unregister()`` on command
and reports ``time.monotonic()`` just before the call; a client process (the router) polls
``Client.instance_ids()`` (0.25 ms between reads) and records ``time.monotonic()`` when the
instance is gone. ``CLOCK_MONOTONIC`` is one clock for every process on Linux, so the
difference is comparable; the poll adds up to 0.25 ms.

Run: ``.venv/bin/python -m bench discovery`` (writes ``bench/results/discovery.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.results_format import Result
from bench.stats import percentile

NAME = "discovery"

SAMPLES = 1000
WARMUP = 20
DYNAMO_SAMPLES = 500
ROOT = Path(__file__).resolve().parents[1]
DYNAMO_PYTHON = Path(os.environ.get("DYNAMO_PYTHON", ROOT / ".venv-dynamo/bin/python"))
WORKER = "bench-worker"
ETCD_TTL_S = 10

HEADLINE = ("unregister_to_router_ms_etcd_p50", "unregister_to_router_ms_etcd_p99",
            "unregister_to_router_ms_dynamo_p50", "unregister_to_router_ms_dynamo_p99")


def _ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1e3, 4)


async def _etcd_samples(samples: int, warmup: int) -> dict[str, list[float]]:
    from quiesce.adapters.etcd import EtcdConfig, EtcdDiscovery, EtcdWatcher
    from quiesce.adapters.etcd.local import LocalEtcd

    server = LocalEtcd(name="quiesce-bench")
    await server.start(timeout_s=15)
    router = EtcdWatcher(server.host, server.port)
    worker = EtcdDiscovery(EtcdConfig(WORKER, "http://127.0.0.1:9", port=server.port,
                                      ttl_s=ETCD_TTL_S))
    seen: dict[bool, float] = {}

    def note(name: str, registered: bool) -> None:
        if name == WORKER:
            seen[registered] = time.perf_counter()

    router.watch(note)
    out: dict[str, list[float]] = {"unregister_to_router": [], "unregister_call": [],
                                   "register_to_router": []}
    try:
        await router.start()
        for i in range(warmup + samples):
            seen.clear()
            started = time.perf_counter()
            await worker.register()
            if not await router.wait_for(WORKER, True, 10.0):
                raise RuntimeError("the router never listed the worker")
            registered = seen[True] - started
            seen.clear()
            started = time.perf_counter()
            await worker.unregister()
            returned = time.perf_counter()
            if not await router.wait_for(WORKER, False, 10.0):
                raise RuntimeError("the router still lists the worker")
            if i >= warmup:
                out["register_to_router"].append(registered)
                out["unregister_call"].append(returned - started)
                out["unregister_to_router"].append(seen[False] - started)
    finally:
        await worker.close()
        await router.close()
        server.close()
    return out


def dynamo_samples(samples: int) -> dict[str, list[float]] | str:
    """Run the Dynamo part in the Dynamo environment; its samples, or why not."""
    if not DYNAMO_PYTHON.exists():
        return f"{DYNAMO_PYTHON} does not exist (run bash ci/setup_dynamo.sh)"
    try:
        done = subprocess.run(
            [str(DYNAMO_PYTHON), "-m", "bench.discovery", "--dynamo-child", str(samples)],
            cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
            env={**os.environ, "DYN_LOG": "error"})
    except subprocess.TimeoutExpired:
        return "the Dynamo run did not finish within 600 s"
    if done.returncode != 0:
        return f"the Dynamo run failed (rc {done.returncode}): {done.stderr[-800:]}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result: dict[str, list[float]] = json.loads(lines[-1])
    return result


async def _expect(stdout: asyncio.StreamReader, event: str) -> dict[str, Any]:
    """The worker's next JSON line with this ``event`` (30 s bound per line)."""
    while True:
        line = await asyncio.wait_for(stdout.readline(), 30.0)
        if not line:
            raise RuntimeError(f"the worker exited before {event!r}")
        if not line.startswith(b"{"):
            continue
        message: dict[str, Any] = json.loads(line)
        if message["event"] == "error":
            raise RuntimeError(f"worker: {message}")
        if message["event"] == event:
            return message


async def _until(client: Any, instance: int, listed: bool) -> float:
    """``time.monotonic()`` when the client (un)lists ``instance``; 10 s bound."""
    limit = time.monotonic() + 10.0
    while (instance in client.instance_ids()) != listed:
        if time.monotonic() > limit:
            raise RuntimeError("the router did not follow within 10 s")
        await asyncio.sleep(0.00025)
    return time.monotonic()


async def _dynamo_child(samples: int) -> dict[str, list[float]]:
    """In the Dynamo environment: one worker process, this process the router."""
    from quiesce.adapters.dynamo import LOOPBACK_ENV, loopback_runtime

    store = tempfile.mkdtemp(prefix="quiesce-dynamo-bench-")
    env = {**os.environ, **LOOPBACK_ENV, "DYN_FILE_KV": store, "PYTHONUNBUFFERED": "1"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.integration.test_dynamo_discovery", "worker", "W",
        cwd=ROOT, env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout

    expect = functools.partial(_expect, stdout)

    runtime = loopback_runtime(asyncio.get_running_loop(), store)
    out: dict[str, list[float]] = {"unregister_to_router": [], "unregister_call": [],
                                   "register_to_router": []}
    try:
        instance = int((await expect("ready"))["instance_id"])
        client = await runtime.endpoint("quiesce.backend.generate").client()
        await _until(client, instance, True)
        for i in range(WARMUP + samples):
            stdin.write(b"unregister\n")
            await stdin.drain()
            call = await expect("unregister")
            seen = await _until(client, instance, False)
            stdin.write(b"register\n")
            await stdin.drain()
            again = await expect("register")
            back = await _until(client, instance, True)
            if i >= WARMUP:
                out["unregister_to_router"].append(seen - call["started"])
                out["unregister_call"].append(call["returned"] - call["started"])
                out["register_to_router"].append(back - again["started"])
    finally:
        stdin.write(b"quit\n")
        await stdin.drain()
        try:
            await asyncio.wait_for(process.wait(), 20.0)
        except (TimeoutError, asyncio.TimeoutError):
            process.kill()
            await process.wait()
        runtime.shutdown()
        shutil.rmtree(store, ignore_errors=True)
    return out


def run() -> Result:
    etcd = asyncio.run(_etcd_samples(SAMPLES, WARMUP))
    metrics: dict[str, float] = {}
    _add(metrics, "etcd", etcd)
    dynamo = dynamo_samples(DYNAMO_SAMPLES)
    notes = [
        "unregister_to_router: from just before unregister() to the moment the router "
        "stops listing the worker. unregister_call: how long unregister() itself took. "
        "register_to_router: from just before register() to the router listing it again.",
        f"etcd: etcd 3.4 (Debian etcd-server) on 127.0.0.1 with a temporary data dir, "
        f"lease TTL {ETCD_TTL_S} s; worker (EtcdDiscovery, aetcd 1.0.0) and router "
        "(EtcdWatcher, its own gRPC channel and prefix watch) share this process and its "
        "event loop, so loop scheduling is included; the etcd server is a separate process. "
        "unregister = delete the key (what the router sees) + revoke the lease.",
    ]
    parameters: dict[str, object] = {"samples": SAMPLES, "warmup": WARMUP,
                                     "etcd_ttl_s": ETCD_TTL_S,
                                     "percentiles": "linear interpolation (numpy's default)"}
    if isinstance(dynamo, str):
        notes.append(f"dynamo: not measured: {dynamo}.")
    else:
        _add(metrics, "dynamo", dynamo)
        parameters["dynamo_samples"] = DYNAMO_SAMPLES
        notes.append(
            "dynamo: ai-dynamo-runtime 1.6.1, file discovery backend (DYN_FILE_KV in a temp "
            "dir) and tcp request plane on 127.0.0.1; worker process = DynamoDiscovery over "
            "the served endpoint (unregister_endpoint_instance), router = a Dynamo Client in "
            "another process polling instance_ids() every 0.25 ms; times on "
            "CLOCK_MONOTONIC, shared by both processes.")
    notes.append("2-core VM shared with other jobs: figures are upper bounds, noisy.")
    units = dict.fromkeys(metrics, "ms")
    return Result(name=NAME, metrics=metrics, units=units, parameters=parameters, notes=notes)


def _add(metrics: dict[str, float], backend: str, data: dict[str, list[float]]) -> None:
    for what in ("unregister_to_router", "unregister_call", "register_to_router"):
        values = data[what]
        metrics[f"{what}_ms_{backend}_p50"] = _ms(values, 50)
        metrics[f"{what}_ms_{backend}_p99"] = _ms(values, 99)
        if what == "unregister_to_router":
            metrics[f"{what}_ms_{backend}_max"] = _ms(values, 100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.discovery")
    parser.add_argument("--dynamo-child", type=int, metavar="N",
                        help="(internal) measure N Dynamo unregisters; print JSON samples")
    args = parser.parse_args(argv)
    if args.dynamo_child:
        print(json.dumps(asyncio.run(_dynamo_child(args.dynamo_child))), flush=True)
        return 0
    from bench.results_format import run_and_report
    run_and_report(NAME, run, HEADLINE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
