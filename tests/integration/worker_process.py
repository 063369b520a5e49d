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
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

TOKEN = "test-token-0123456789"


@dataclass
class Worker:
    process: subprocess.Popen[str]
    port: int
    admin_port: int

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
        """Wait up to ``timeout`` s for exit; kill (SIGKILL) past it and return code None."""
        try:
            out, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            return None, None
        report = None
        for line in out.splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if isinstance(event, dict) and event.get("event") == "exit":
                    report = event
        return self.process.returncode, report


def worker_env() -> dict[str, str]:
    return {**os.environ, "QUIESCE_ADMIN_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def start_worker(*args: str, startup_timeout: float = 60.0) -> Iterator[Worker]:
    """Run ``quiesce serve --engine sim`` on free loopback ports; kill it on the way out."""
    process = subprocess.Popen(
        [sys.executable, "-m", "quiesce", "serve", "--engine", "sim", "--port", "0",
         "--admin-port", "0", *args],
        stdout=subprocess.PIPE, text=True, env=worker_env())
    try:
        assert process.stdout is not None
        ready = _read_ready(process, startup_timeout)
        yield Worker(process, int(ready["port"]), int(ready["admin_port"]))
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _read_ready(process: subprocess.Popen[str], timeout: float) -> dict[str, int]:
    import selectors

    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    if not selector.select(timeout):
        raise RuntimeError(f"worker did not report ready within {timeout}s")
    line = process.stdout.readline()
    event = json.loads(line)
    assert event["event"] == "ready", line
    return {"port": event["port"], "admin_port": event["admin_port"]}


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
