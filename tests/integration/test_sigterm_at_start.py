"""``quiesce serve`` signalled at the points of its life around serving: as soon as it owns
its signals (its ``starting`` line, before or while its engine starts), during its
registration (etcd stalled), while an operator's drain runs, and after drained. Each ends
with a truthful report and exit code, no hang, and no registration left behind. (While
serving: test_kubelet_sequence.py, test_worker_etcd.py and the vLLM tier's
test_vllm_signals.py; a signal during a signal's drain: test_sigterm.py; the Dynamo
wrapper: tests/integration/dynamo/test_vllm_worker.py and
test_vllm_worker_deliveries.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import sys
import time

import httpx
import pytest

from quiesce.adapters.etcd import EtcdWatcher
from quiesce.adapters.etcd.local import LocalEtcd
from quiesce.signal_guard import descendants
from tests.integration.real_parts import require_etcd
from tests.integration.worker_process import (
    TOKEN,
    Worker,
    running,
    start_worker,
    stream_completion,
    tail,
    worker_env,
)

EXIT_S = 30.0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_at_start_ends_drained_with_nothing_served(sig: signal.Signals) -> None:
    command = [sys.executable, "-m", "quiesce", "serve", "--engine", "sim", "--port", "0",
               "--admin-port", "0", "--budget", "10", "--reserve", "2"]
    with running(command, worker_env(), '"event": "starting"', timeout_s=EXIT_S,
                 name="quiesce serve") as worker:
        worker.signal(sig)
        code, report = worker.finish(EXIT_S)
    assert code == 0 and report is not None, tail(worker.lines)
    assert report["outcome"] == "drained" and report["lost_requests"] == 0, report
    assert report["signal"] == sig.name


# -- during registration, while an operator's drain runs, after drained ---------------------

PREFIX = "/quiesce/test-signal-points"
SERVE = ("--engine", "sim", "--decode-step", "0.01", "--router-grace", "0.2", "--budget",
         "10", "--reserve", "2")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening(port: int) -> bool:
    """Whether a socket listens on ``port`` (read from /proc/net/tcp: connecting would
    leave a connection in its backlog)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    return True
    return False


def _pid_of(marker: str) -> int:
    """The pid of this test's child process whose command line contains ``marker``."""
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if marker.encode() in cmdline.read():
                return pid
    raise LookupError(f"no child process with {marker!r} in its command line")


def _admin(worker: Worker, path: str, body: dict[str, object] | None = None
           ) -> dict[str, object]:
    answer = httpx.post(f"{worker.admin_url}{path}", json=body,
                        headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert answer.status_code in (200, 202), answer.text
    data: dict[str, object] = answer.json()
    return data


def _wait_for_line(worker: Worker, text: str, timeout_s: float = EXIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in worker.lines):
        assert worker.process.poll() is None, tail(worker.lines)
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s}s:\n" \
                                            f"{tail(worker.lines)}"
        time.sleep(0.02)


@dataclasses.dataclass
class Registering:
    """How a worker signalled during its registration ended: exit code, exit report,
    everything it printed, and what etcd lists under the prefix afterwards."""

    code: int | None
    report: dict[str, object] | None
    lines: list[str]
    listed: dict[str, object]


def _signal_registering(worker: Worker, api_port: int, etcd_pid: int
                        ) -> tuple[int | None, dict[str, object] | None]:
    """SIGTERM once ``worker`` registers (its serving port listens: it does that right
    before registering; a stopped etcd keeps it there); etcd back once it took the
    signal; then its exit."""
    deadline = time.monotonic() + EXIT_S
    while not _listening(api_port):
        assert time.monotonic() < deadline and worker.process.poll() is None, \
            tail(worker.lines)
        time.sleep(0.02)
    assert not any('"event": "ready"' in line for line in worker.lines)
    worker.signal(signal.SIGTERM)
    _wait_for_line(worker, "shutdown requested by SIGTERM")
    os.kill(etcd_pid, signal.SIGCONT)
    return worker.finish(EXIT_S)


async def _sigterm_during_registration() -> Registering:
    """etcd stops answering (SIGSTOP) while the worker registers: its ports listen (what it
    does right before registering) but registration cannot finish. SIGTERM then; once the
    worker logged that it took it, etcd answers again."""
    require_etcd()
    etcd = LocalEtcd()
    await etcd.start(timeout_s=15)
    etcd_pid = _pid_of(str(etcd.data_dir))
    api_port, admin_port = _free_port(), _free_port()
    command = [sys.executable, "-m", "quiesce", "--verbose", "serve", *SERVE,
               "--port", str(api_port), "--admin-port", str(admin_port),
               "--etcd", f"{etcd.host}:{etcd.port}", "--etcd-prefix", PREFIX,
               "--name", "w-registering"]
    try:
        os.kill(etcd_pid, signal.SIGSTOP)
        with running(command, worker_env(), '"event": "starting"', timeout_s=EXIT_S,
                     name="quiesce serve") as worker:
            code, report = await asyncio.to_thread(_signal_registering, worker, api_port,
                                                   etcd_pid)
        watcher = EtcdWatcher(etcd.host, etcd.port, PREFIX)
        await watcher.start()
        listed: dict[str, object] = dict(watcher.instances)
        await watcher.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(etcd_pid, signal.SIGCONT)
        etcd.close()
    return Registering(code, report, worker.lines, listed)


async def test_a_sigterm_during_registration_ends_drained_and_unlisted() -> None:
    """Exit 0 drained with nothing lost, and the worker's key is not left in etcd."""
    ended = await _sigterm_during_registration()
    assert ended.code == 0 and ended.report is not None, tail(ended.lines)
    assert ended.report["outcome"] == "drained", ended.report
    assert ended.report["lost_requests"] == 0 and ended.report["signal"] == "SIGTERM"
    assert "w-registering" not in ended.listed, ended.listed


async def test_a_sigterm_during_registration_never_serves() -> None:
    """What the worker's docstring promises: signalled before ``ready``, it never serves."""
    ended = await _sigterm_during_registration()
    assert ended.code == 0, tail(ended.lines)
    assert not any('"event": "ready"' in line for line in ended.lines), tail(ended.lines)


async def test_a_sigterm_while_an_operators_drain_runs_completes_the_stream() -> None:
    """``POST /engine/drain`` waits for a stream when the SIGTERM comes: the shutdown takes
    the drain over, the stream completes, exit 0 drained with it counted completed."""
    with start_worker(*SERVE[2:]) as worker:
        started = asyncio.Event()
        stream = asyncio.create_task(stream_completion(worker.url, 300, started=started))
        await asyncio.wait_for(started.wait(), EXIT_S)
        drain = _admin(worker, "/engine/drain")
        assert drain["state"] == "draining" and drain["inflight_requests"] == 1, drain
        worker.signal(signal.SIGTERM)
        code, report = await asyncio.to_thread(worker.finish, EXIT_S)
        result = await stream
    assert result.status == 200 and result.done and not result.errors, result
    assert result.tokens == 300, result
    assert code == 0 and report is not None, tail(worker.lines)
    assert report["outcome"] == "drained" and report["drained"] is True, report
    assert report["requests"] == {"completed": 1, "lost": 0, "client_gone": 0,
                                  "rejected": 0}, report


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_after_drained_exits_clean(sig: signal.Signals) -> None:
    """Drained by the admin API with nothing in flight, then the signal: exit 0, drained."""
    with start_worker(*SERVE[2:]) as worker:
        drained = _admin(worker, "/engine/drain", {"wait": True, "wait_timeout_s": EXIT_S})
        assert drained["state"] == "drained", drained
        worker.signal(sig)
        code, report = worker.finish(EXIT_S)
    assert code == 0 and report is not None, tail(worker.lines)
    assert report["outcome"] == "drained" and report["drained"] is True, report
    assert report["signal"] == sig.name and report["lost_requests"] == 0, report
