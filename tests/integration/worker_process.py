"""Start and stop a real reference worker (`quiesce serve`) and stream from it, on loopback.

Shared by the integration tests of the operator surface. Every process started
here is killed if the test leaves it running.
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
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import httpx

TOKEN = "test-token-0123456789"


def _events(lines: list[str]) -> Iterator[dict[str, object]]:
    """The worker's JSON event lines among everything it printed (engines log to stdout)."""
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):
            event = json.loads(line)
            if isinstance(event, dict) and "event" in event:
                yield event


@dataclass
class Worker:
    process: subprocess.Popen[str]
    lines: list[str]
    reader: threading.Thread
    port: int = 0
    admin_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def status(self) -> dict[str, object]:
        answer = httpx.get(f"{self.admin_url}/engine/status",
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        answer.raise_for_status()
        data: dict[str, object] = answer.json()
        return data

    def signal(self, sig: signal.Signals = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def finish(self, timeout: float) -> tuple[int | None, dict[str, object] | None]:
        """Wait up to ``timeout`` s for exit; SIGKILL past it and return code None."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            return None, None
        self.reader.join(timeout=10)
        exits = [e for e in _events(self.lines) if e.get("event") == "exit"]
        return self.process.returncode, (exits[-1] if exits else None)


def worker_env() -> dict[str, str]:
    return {**os.environ, "QUIESCE_ADMIN_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def start_worker(*args: str, engine: tuple[str, ...] = ("--engine", "sim"),
                 startup_timeout: float = 60.0,
                 env_changes: Mapping[str, str | None] | None = None) -> Iterator[Worker]:
    """Run ``quiesce serve`` on free loopback ports; kill it (and its children) on the way out.

    ``env_changes``: variables to set in the worker's environment (``None``: remove it).
    """
    env = worker_env()
    for name, value in (env_changes or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    process = subprocess.Popen(
        [sys.executable, "-m", "quiesce", "serve", *engine, "--port", "0",
         "--admin-port", "0", *args],
        stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:  # a thread, so that a full pipe can never block the worker
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if '"ready"' in line:
                ready.set()
        ready.set()  # exited

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    worker = Worker(process, lines, reader)
    try:
        ready.wait(startup_timeout)
        events = [e for e in _events(lines) if e.get("event") == "ready"]
        if not events:
            raise RuntimeError(f"worker did not report ready within {startup_timeout}s "
                               f"(exit code {process.poll()})")
        worker.port = int(events[0]["port"])  # type: ignore[call-overload]
        worker.admin_port = int(events[0]["admin_port"])  # type: ignore[call-overload]
        yield worker
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # engine processes too
        process.wait(timeout=30)


@dataclass
class StreamResult:
    status: int
    tokens: int
    done: bool
    error: str | None


async def stream_completion(url: str, max_tokens: int, *, started: asyncio.Event | None = None,
                            kv: dict[str, object] | None = None) -> StreamResult:
    """POST a streaming completion; count token chunks and whether ``[DONE]`` arrived."""
    body: dict[str, object] = {"prompt": "hello world", "max_tokens": max_tokens,
                               "stream": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    tokens, done, error = 0, False, None
    try:
        async with httpx.AsyncClient(timeout=60) as client, \
                client.stream("POST", f"{url}/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                await answer.aread()
                return StreamResult(answer.status_code, 0, False, answer.text)
            async for line in answer.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]["type"]
                    continue
                tokens += 1
                if started is not None:
                    started.set()
    except httpx.TransportError as exc:  # the worker went away mid-stream: a lost stream
        return StreamResult(0, tokens, False, f"transport error: {exc!r}")
    return StreamResult(200, tokens, done, error)


# -- how a signal reaches a worker's processes ---------------------------------------------
# The kubelet signals the main process only (Worker.signal); a terminal's Ctrl-C and init
# shims (dumb-init, tini -g) signal the process group; systemd (KillMode=control-group) and
# pkill signal every process.


def worker_processes(pid: int) -> list[int]:
    """``pid`` and every live descendant of it, read from ``/proc`` (parents first)."""
    from quiesce.signal_guard import descendants  # stdlib-only; both environments have it

    return [pid, *descendants(pid)]


def signal_group(pid: int, sig: signal.Signals = signal.SIGTERM) -> None:
    """Signal the process group of ``pid`` (``start_worker`` makes the worker its leader)."""
    os.killpg(os.getpgid(pid), sig)


def signal_every_process(pid: int, sig: signal.Signals = signal.SIGTERM) -> list[int]:
    """Signal ``pid`` and each of its descendants, one by one; returns the pids signalled
    (a process that exited in between is skipped)."""
    signalled = []
    for target in worker_processes(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, sig)
            signalled.append(target)
    return signalled


# -- how the kubelet deletes a pod ------------------------------------------------------


@dataclass
class Deletion:
    exit_code: int | None  # None: still running at the grace period, SIGKILLed
    prestop_code: int | None  # None: no preStop hook; -1: the hook ran past the grace period
    report: dict[str, object] | None  # the worker's own shutdown report


async def kubelet_delete(worker: Worker, grace_s: float,
                         prestop: Sequence[str] | None) -> Deletion:
    """Delete ``worker``'s pod as the kubelet does: run the preStop hook ``prestop`` (a
    command; ``None``: no hook) for at most ``grace_s``, then SIGTERM to the main process,
    then SIGKILL to every process once ``grace_s`` (terminationGracePeriodSeconds) has
    passed since the deletion began."""
    start = time.monotonic()
    prestop_code: int | None = None
    if prestop is not None:
        hook = await asyncio.create_subprocess_exec(
            *prestop, env=worker_env(), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        try:
            prestop_code = await asyncio.wait_for(hook.wait(), timeout=grace_s)
        except asyncio.TimeoutError:
            hook.kill()
            await hook.wait()
            prestop_code = -1
    worker.signal()
    left = max(0.0, grace_s - (time.monotonic() - start))
    code, report = await asyncio.to_thread(worker.finish, left)
    return Deletion(code, prestop_code, report)


def prestop_command(worker: Worker, grace_s: float, margin_s: float) -> list[str]:
    """The worker's preStop hook, ``quiesce prestop``, as a pod spec would run it."""
    return [sys.executable, "-m", "quiesce", "prestop", "--url", worker.admin_url,
            "--grace-period", str(grace_s), "--margin", str(margin_s)]
