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
from dataclasses import dataclass, field

import httpx

TOKEN = "test-token-0123456789"


def json_events(lines: list[str]) -> Iterator[dict[str, object]]:
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
        exits = [e for e in json_events(self.lines) if e.get("event") == "exit"]
        return self.process.returncode, (exits[-1] if exits else None)


@contextlib.contextmanager
def running(command: Sequence[str], env: dict[str, str], ready: str,
            timeout_s: float = 120.0, name: str = "process") -> Iterator[Worker]:
    """Start ``command``; wait until a line of its output contains ``ready``; kill its
    group on the way out. A process that exits or stays silent raises with its output."""
    process = subprocess.Popen(list(command), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:  # a thread: a full pipe must never block the process
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if ready in line:
                seen.set()
        seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    worker = Worker(process, lines, reader)
    try:
        seen.wait(timeout_s)
        if not any(ready in line for line in lines):
            raise RuntimeError(f"{name} not ready within {timeout_s}s (exit code "
                               f"{process.poll()}):\n{tail(lines)}")
        yield worker
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def tail(lines: list[str], count: int = 40) -> str:
    return "".join(lines[-count:])


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
        events = [e for e in json_events(lines) if e.get("event") == "ready"]
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
    """What one streaming completion delivered, every event read to the end of the stream.

    ``status``: the HTTP status (0: no answer came). ``tokens``: the usage chunk's
    ``completion_tokens`` when one came, else the number of chunks that carried choices
    (one a token on the sim worker). ``done``: ``data: [DONE]`` arrived. ``finish_reason``:
    the last one a choice carried. ``errors``: in the order they came, a non-200 answer's
    body, each error event's ``error`` object, a transport error (the connection broke).
    """

    max_tokens: int
    status: int = 0
    tokens: int = 0
    done: bool = False
    finish_reason: str | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def error(self) -> str | None:
        """The first of ``errors``; ``None`` when the client was told of none."""
        return self.errors[0] if self.errors else None

    @property
    def complete(self) -> bool:
        """Every token asked for and a clean end: 200, ``[DONE]``, no error, finish reason
        ``length`` and exactly ``max_tokens`` tokens (as ``ignore_eos`` asks)."""
        return (self.status == 200 and self.done and not self.errors
                and self.finish_reason == "length" and self.tokens == self.max_tokens)


async def stream_completion(url: str, max_tokens: int, *, started: asyncio.Event | None = None,
                            kv: dict[str, object] | None = None, prompt: str = "hello world",
                            ignore_eos: bool = False, include_usage: bool = False,
                            timeout_s: float = 60.0, model: str | None = None) -> StreamResult:
    """POST a streaming completion to ``url``'s ``/v1/completions`` and read it to its end.

    ``started`` is set at the first chunk with choices; ``kv`` is sent as
    ``kv_transfer_params``; ``model`` names the model (a router that serves several needs
    it); ``include_usage`` asks for the usage chunk (``tokens`` then
    counts tokens, not chunks); ``timeout_s`` bounds each network operation. Never raises
    for what the worker answers or a connection that breaks: both land in the result.
    """
    body: dict[str, object] = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    if model is not None:  # Dynamo's frontend routes by it
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    result = StreamResult(max_tokens)
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client, \
                client.stream("POST", f"{url}/v1/completions", json=body) as answer:
            result.status = answer.status_code
            if answer.status_code != 200:
                await answer.aread()
                result.errors.append(answer.text)
            else:
                await _read_events(answer, result, started, include_usage)
    except httpx.TransportError as exc:  # the worker went away mid-stream: a lost stream
        result.errors.append(f"transport error: {exc!r}")
    return result


async def _read_events(answer: httpx.Response, result: StreamResult,
                       started: asyncio.Event | None, usage_asked: bool) -> None:
    """Fold every server-sent event of a 200 ``answer`` into ``result`` (its docstring).
    A stream that ended without the usage chunk it was asked for counts no tokens and
    says so in ``errors``."""
    chunks, usage_tokens = 0, None
    async for line in answer.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            result.done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            result.errors.append(str(chunk["error"]))
            continue
        if chunk.get("usage"):
            usage_tokens = int(chunk["usage"]["completion_tokens"])
        choices = chunk.get("choices") or []
        if choices:
            chunks += 1
            if started is not None:
                started.set()
        for choice in choices:
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        result.tokens = chunks if usage_tokens is None else usage_tokens
    if usage_asked and usage_tokens is None:
        result.tokens = 0
        result.errors.append("the stream ended without the usage chunk it asked for")


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


# -- what a worker leaves behind ----------------------------------------------------------


def live_pids(pids: Sequence[int]) -> list[int]:
    """The pids of ``pids`` that still run (a zombie, dead but not yet reaped, does not)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[-1].split()[0]
        except OSError:  # gone
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def outliving(pids: Sequence[int], grace_s: float = 10.0) -> list[int]:
    """The pids of ``pids`` still running after up to ``grace_s`` (call it once the worker
    exited: what it returns are orphans)."""
    deadline = time.monotonic() + grace_s
    while live_pids(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return live_pids(pids)


def ready_status(worker: Worker) -> int:
    """``GET /quiesce/ready`` on the engine server's own port."""
    return int(httpx.get(f"{worker.url}/quiesce/ready", timeout=10).status_code)


def refused_while_draining(worker: Worker, within_s: float = 10.0) -> dict[str, object]:
    """POST completions to the engine server until one is refused by quiesce's gate (a
    503 with ``Retry-After: 1``); returns its error object. Raises if none is within
    ``within_s`` or an answer is neither 200 nor 503."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        answer = httpx.post(f"{worker.url}/v1/completions",
                            json={"prompt": "late", "max_tokens": 2}, timeout=30)
        if answer.status_code == 503:
            assert answer.headers["retry-after"] == "1"
            error: dict[str, object] = answer.json()["error"]
            return error
        assert answer.status_code == 200, answer.text
        time.sleep(0.05)
    raise AssertionError(f"no request was refused within {within_s}s")


def drain_and_resume(worker: Worker) -> None:
    """Through the admin API: drain (readiness fails, new requests refused), resume
    (readiness back, one request served to its end)."""
    admin = {"Authorization": f"Bearer {TOKEN}"}
    answer = httpx.post(f"{worker.admin_url}/engine/drain", json={"wait": True,
                        "wait_timeout_s": 30}, headers=admin, timeout=60)
    assert answer.status_code == 200 and answer.json()["state"] == "drained", answer.text
    assert ready_status(worker) == 503
    assert refused_while_draining(worker)["type"] == "worker_draining"
    answer = httpx.post(f"{worker.admin_url}/engine/resume", headers=admin, timeout=30)
    assert answer.status_code == 200 and answer.json()["state"] == "serving", answer.text
    assert ready_status(worker) == 200
    done = httpx.post(f"{worker.url}/v1/completions", json={
        "prompt": "back", "max_tokens": 3, "ignore_eos": True}, timeout=60)  # random weights
    assert done.status_code == 200, done.text
    assert done.json()["choices"][0]["finish_reason"] == "length", done.text
