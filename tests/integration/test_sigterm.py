"""Real signals to a real worker process: SIGTERM drains, a stuck KV forces, a second signal exits.

``sim_worker.py`` (beside this file) is a standalone worker process: SimEngine behind
the lifecycle's gate, a JSON-lines TCP face on 127.0.0.1, and ``Shutdown`` with its
signal handlers installed. The tests talk to it as clients and send it signals.

No timing asserts: every timeout here only keeps a broken build from hanging the
suite. Every worker process is killed in ``finally`` if it is still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from quiesce.shutdown import EXIT_CLEAN, EXIT_FORCED, EXIT_IMMEDIATE

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("sim_worker.py")
START_S = 30.0
"""Outer bound for the worker to start and for streams to produce a first token."""
EXIT_S = 30.0
"""Outer bound for the worker to finish its shutdown and exit."""
LATE_ATTEMPTS = 500
"""Bound on late clients sent while waiting for admission to close."""


@dataclasses.dataclass
class Client:
    """One streaming request over the worker's JSON-lines protocol."""

    request_id: str
    max_tokens: int
    remote_decode: bool = False
    never_pulled: bool = False
    tokens: list[int] = dataclasses.field(default_factory=list)
    done: bool = False
    error: dict[str, object] | None = None
    refused: bool = False
    eof: bool = False
    first_token: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def half_stream(self) -> bool:
        """Some tokens but neither ``done`` nor an explicit error: what must never happen."""
        return bool(self.tokens) and not self.done and self.error is None

    async def run(self, port: int) -> Client:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except ConnectionRefusedError:
            self.refused = True
            return self
        try:
            writer.write(json.dumps({
                "id": self.request_id, "max_tokens": self.max_tokens,
                "remote_decode": self.remote_decode, "never_pulled": self.never_pulled,
            }).encode() + b"\n")
            await writer.drain()
            while True:
                line = await reader.readline()
                if not line:
                    self.eof = True
                    return self
                message = json.loads(line)
                if "token" in message:
                    self.tokens.append(message["token"])
                    self.first_token.set()
                elif message.get("done") is True:
                    self.done = True
                    return self
                else:
                    self.error = message
                    return self
        except ConnectionResetError:
            self.eof = True
            return self
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@dataclasses.dataclass
class Worker:
    proc: asyncio.subprocess.Process
    port: int
    stderr_path: Path

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    async def exit(self, timeout: float = EXIT_S) -> tuple[int, dict[str, object] | None]:
        """Wait for the exit; return the exit code and the final JSON report (if printed)."""
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        assert self.proc.stdout is not None
        lines = (await self.proc.stdout.read()).decode().splitlines()
        report = json.loads(lines[-1]) if lines and lines[-1].strip() else None
        return code, report


@contextlib.asynccontextmanager
async def worker(tmp_path: Path, *args: str) -> AsyncIterator[Worker]:
    """Start ``sim_worker.py``; kill it on the way out if it is still running."""
    stderr_path = tmp_path / "worker.stderr"
    with stderr_path.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(WORKER), *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=stderr)
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), START_S)
            assert line, f"worker exited before printing its port:\n{stderr_path.read_text()}"
            yield Worker(proc, int(json.loads(line)["port"]), stderr_path)
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.wait()


async def wait_first_tokens(clients: list[Client]) -> None:
    await asyncio.wait_for(asyncio.gather(*(c.first_token.wait() for c in clients)), START_S)


async def until_admission_closed(port: int) -> Client:
    """Send short late requests until one is refused; none may get a half stream.

    A late request that arrives during the router grace is admitted and must be
    served in full; once the drain closed admission the answer must be the typed,
    retryable draining error (or a refused connection once the server is gone).
    """
    for attempt in range(LATE_ATTEMPTS):
        late = await asyncio.wait_for(Client(f"late{attempt}", max_tokens=1).run(port), START_S)
        assert not late.half_stream, late
        assert not late.eof, late  # the worker always answers before closing
        if late.refused or late.error is not None:
            return late
        assert late.done and late.tokens == [1], late
        await asyncio.sleep(0.01)
    raise AssertionError(f"admission still open after {LATE_ATTEMPTS} late requests")


def assert_rejected_retryably(late: Client) -> None:
    if late.refused:
        return
    assert late.error == {"error": "draining", "retryable": True}, late
    assert not late.tokens


async def test_sigterm_drains_every_admitted_stream_and_exits_clean(tmp_path: Path) -> None:
    async with worker(tmp_path, "--budget", "20", "--reserve", "3", "--grace", "0.2") as w:
        clients = [Client(f"s{i}", max_tokens=200, remote_decode=i % 3 == 0) for i in range(8)]
        tasks = [asyncio.create_task(c.run(w.port)) for c in clients]
        try:
            await wait_first_tokens(clients)
            w.signal(signal.SIGTERM)
            late = await asyncio.wait_for(until_admission_closed(w.port), EXIT_S)
            await asyncio.wait_for(asyncio.gather(*tasks), EXIT_S)
        finally:
            for task in tasks:
                task.cancel()
        code, report = await w.exit()
        stderr = w.stderr()

    assert code == EXIT_CLEAN, stderr
    assert_rejected_retryably(late)
    for client in clients:
        assert client.tokens == list(range(1, 201)), (client.request_id, client, stderr)
        assert client.done, client
        assert client.error is None, client
    assert report is not None, stderr
    assert report["drained"] is True
    assert report["aborted_requests"] == 0
    assert report["exit_code"] == EXIT_CLEAN
    assert report["signal"] == "SIGTERM"
    stages = report["stages"]
    assert isinstance(stages, list)
    assert [(s["stage"], s["outcome"]) for s in stages] == [
        ("drain", "completed"), ("stop", "completed"), ("abort", "skipped"),
        ("engine_shutdown", "completed"), ("close", "skipped")]
    assert report["outcome"] == "drained" and report["lost_requests"] == 0
    requests = report["requests"]
    assert isinstance(requests, dict) and requests["completed"] >= len(clients)
    # the process is gone: a new client is refused, never half served
    after = await asyncio.wait_for(Client("after-exit", max_tokens=5).run(w.port), START_S)
    assert after.refused, after


async def test_never_pulled_kv_forces_exit_within_the_budget(tmp_path: Path) -> None:
    async with worker(tmp_path, "--budget", "1.5", "--reserve", "0.5", "--grace", "0") as w:
        client = Client("held", max_tokens=20, remote_decode=True, never_pulled=True)
        task = asyncio.create_task(client.run(w.port))
        try:
            await wait_first_tokens([client])
            w.signal(signal.SIGTERM)
            code, report = await w.exit()
            await asyncio.wait_for(task, EXIT_S)
        finally:
            task.cancel()
        stderr = w.stderr()

    assert code == EXIT_FORCED, stderr
    assert report is not None, stderr
    assert report["drained"] is False
    assert report["exit_code"] == EXIT_FORCED
    aborted = report["aborted_requests"]
    assert isinstance(aborted, int) and aborted >= 1, report
    # the stream itself had ended before the budget ran out; only its held KV was aborted
    assert client.tokens == list(range(1, 21)), client
    assert client.done, client


async def test_second_sigterm_exits_immediately(tmp_path: Path) -> None:
    async with worker(tmp_path, "--budget", "60", "--reserve", "5", "--grace", "0") as w:
        client = Client("long", max_tokens=10_000)
        task = asyncio.create_task(client.run(w.port))
        try:
            await wait_first_tokens([client])
            w.signal(signal.SIGTERM)
            # the drain closed admission, so the first signal has been handled
            assert_rejected_retryably(
                await asyncio.wait_for(until_admission_closed(w.port), EXIT_S))
            w.signal(signal.SIGTERM)
            code, report = await w.exit(timeout=10.0)
            await asyncio.wait_for(task, EXIT_S)
        finally:
            task.cancel()
        stderr = w.stderr()

    assert code == EXIT_IMMEDIATE, stderr
    assert report is None  # no report: it did not finish the shutdown
    assert "second signal (SIGTERM)" in stderr
    assert not client.done
    assert len(client.tokens) < 10_000


async def test_two_signals_delivered_together_exit_immediately(tmp_path: Path) -> None:
    """SIGINT and SIGTERM that reach the process in one batch still count as two.

    The worker is stopped (SIGSTOP) while both are sent, so they are delivered
    together on SIGCONT and the event loop reads both from its wakeup pipe at once.
    """
    async with worker(tmp_path, "--budget", "60", "--reserve", "5", "--grace", "0") as w:
        client = Client("long", max_tokens=10_000)
        task = asyncio.create_task(client.run(w.port))
        try:
            await wait_first_tokens([client])
            w.signal(signal.SIGSTOP)
            w.signal(signal.SIGINT)
            w.signal(signal.SIGTERM)
            w.signal(signal.SIGCONT)
            try:
                code, _report = await w.exit(timeout=10.0)
            except asyncio.TimeoutError:
                pytest.fail("worker still running 10 s after SIGINT and SIGTERM were delivered "
                            f"together: the second signal was swallowed\n{w.stderr()}")
            await asyncio.wait_for(task, EXIT_S)
        finally:
            task.cancel()
        stderr = w.stderr()

    assert code == EXIT_IMMEDIATE, stderr
    assert not client.done
