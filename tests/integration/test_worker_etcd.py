"""``quiesce serve --etcd``: the reference worker registered in a real etcd.

A real etcd on loopback (Debian's etcd-server, ``ci/setup_etcd.sh``) and real worker
processes: the worker's key appears with its address when it is ready, disappears when
its drain begins (before the worker exits), and bad or unreachable etcd settings stop
the worker at start with exit code 2 and one line naming the problem.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

from quiesce.adapters.etcd.local import LocalEtcd
from tests.integration.real_parts import require_etcd
from tests.integration.worker_process import start_worker, stream_completion, worker_env

pytestmark = pytest.mark.slow

require_etcd()

from quiesce.adapters.etcd import EtcdWatcher  # noqa: E402

PREFIX = "/quiesce/test-worker"


async def test_worker_is_listed_while_serving_and_unlisted_before_it_exits(
        etcd: LocalEtcd) -> None:
    watcher = EtcdWatcher(etcd.host, etcd.port, PREFIX)
    await watcher.start()
    seen_exit_code: list[int | None] = []

    def on_change(name: str, registered: bool) -> None:
        if not registered:  # the moment the router stops picking it: the worker still runs
            seen_exit_code.append(worker.process.poll())

    watcher.watch(on_change)
    try:
        with start_worker("--etcd", f"{etcd.host}:{etcd.port}", "--etcd-prefix", PREFIX,
                          "--name", "w-a", "--decode-step", "0.01", "--router-grace", "0.2",
                          "--budget", "10") as worker:
            assert await watcher.wait_for("w-a", True, timeout_s=10)
            value = watcher.instances["w-a"]
            assert value["address"] == worker.url and value["role"] == "aggregated", value
            assert worker.status()["discovery_registered"] is True

            started = asyncio.Event()  # the stream is admitted and running
            stream = asyncio.create_task(stream_completion(worker.url, 100, started=started))
            await asyncio.wait_for(started.wait(), timeout=30)
            worker.signal()
            assert await watcher.wait_for("w-a", False, timeout_s=10)
            code, report = await asyncio.to_thread(worker.finish, 30)
            result = await stream
    finally:
        await watcher.close()
    assert seen_exit_code == [None], "unlisted only after the worker exited"
    assert code == 0 and report is not None and report["drained"] is True, report
    assert result.status == 200 and result.done and result.tokens == 100, result


@pytest.mark.parametrize(("etcd_arg", "message"), [
    ("no-port", "etcd: must be HOST:PORT"),
    ("127.0.0.1:70000", "etcd: must be HOST:PORT"),
])
def test_bad_etcd_endpoint_exits_2_naming_it(etcd_arg: str, message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "quiesce", "serve", "--port", "0",
                           "--admin-port", "0", "--etcd", etcd_arg],
                          capture_output=True, text=True, env=worker_env(), timeout=60,
                          check=False)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr


def test_unreachable_etcd_stops_the_worker_at_start_with_exit_2() -> None:
    with socket.socket() as sock:  # a free loopback port where nothing listens
        sock.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
    done = subprocess.run([sys.executable, "-m", "quiesce", "serve", "--port", "0",
                           "--admin-port", "0", "--etcd", endpoint, "--name", "w-b"],
                          capture_output=True, text=True, env=worker_env(), timeout=60,
                          check=False)
    assert done.returncode == 2, done.stderr
    assert "etcd register not confirmed" in done.stderr, done.stderr
    assert '"ready"' not in done.stdout, "a worker that could not register must not be ready"
