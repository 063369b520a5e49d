"""The operator CLI (``quiesce status|drain|resume|prestop``) against a real reference worker.

One ``quiesce serve --engine sim`` process serves the whole module (admin token set
in its environment, ports picked by the OS and read from its "ready" line); every
test starts from ``serving`` (the ``serving`` fixture resumes it). The test whose
request holds KV for a decoder that never pulls it gets a worker of its own: only
an abort frees that KV, so it would keep every later drain from finishing.

The CLI runs as a subprocess (``python -m quiesce ...``) exactly as an operator or
a kubelet runs it; streaming requests go to ``/v1/completions`` with httpx from
threads. Loopback only. No timing asserts: every timeout here only keeps a broken
build from hanging the suite. Every process is stopped (SIGTERM, then kill).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

TOKEN = "cli-test-token-7f3a"
START_S = 30.0
"""Outer bound for a worker to print its ready line and for a stream's first token."""
CLI_S = 60.0
"""Outer bound for one CLI run."""
EXIT_S = 30.0
"""Outer bound for a worker to shut down after SIGTERM."""
STREAM_S = 60.0
"""Outer bound for one streaming request."""
STREAM_TOKENS = 100
STATUS_KEYS = {"state", "generation", "inflight_requests", "accepting", "discovery_registered",
               "since", "seconds_in_state", "last_error", "pending_work", "drain", "last_drain"}


@dataclasses.dataclass
class Worker:
    proc: subprocess.Popen[str]
    port: int
    admin_port: int
    stderr_path: Path

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def status(self) -> dict[str, Any]:
        """The status read directly (not through the CLI under test)."""
        response = httpx.get(f"{self.admin_url}/engine/status", trust_env=False, timeout=10.0,
                             headers={"Authorization": f"Bearer {TOKEN}"})
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def resume(self) -> dict[str, Any]:
        response = httpx.post(f"{self.admin_url}/engine/resume", trust_env=False, timeout=10.0,
                              headers={"Authorization": f"Bearer {TOKEN}"})
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def _clean_env() -> dict[str, str]:
    """This process's environment without any quiesce setting that could leak into a test."""
    return {k: v for k, v in os.environ.items() if not k.startswith("QUIESCE_")}


def _read_ready(proc: subprocess.Popen[str], stderr_path: Path) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + START_S
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or proc.poll() is not None:
            raise AssertionError(f"worker not ready (exit {proc.poll()}): "
                                 f"{stderr_path.read_text(errors='replace')}")
        readable, _, _ = select.select([proc.stdout], [], [], min(remaining, 0.5))
        if not readable:
            continue
        line = proc.stdout.readline()
        if not line:
            continue
        event: dict[str, Any] = json.loads(line)
        if event.get("event") == "ready":
            return event


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM and wait; kill if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(EXIT_S)
    if proc.stdout is not None:
        proc.stdout.close()


@contextlib.contextmanager
def running_worker(directory: Path, *extra: str) -> Iterator[Worker]:
    """Start ``quiesce serve --engine sim`` on free loopback ports; stop it on the way out."""
    stderr_path = directory / "worker.stderr"
    env = {**_clean_env(), "QUIESCE_ADMIN_TOKEN": TOKEN}
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "quiesce", "serve", "--engine", "sim", "--port", "0",
             "--admin-port", "0", "--router-grace", "0.2", "--decode-step", "0.01",
             "--budget", "6", "--reserve", "1", *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        ready = _read_ready(proc, stderr_path)
        yield Worker(proc, int(ready["port"]), int(ready["admin_port"]), stderr_path)
    except BaseException:
        proc.kill()
        raise
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    with running_worker(tmp_path_factory.mktemp("worker")) as started:
        yield started


@pytest.fixture
def serving(worker: Worker) -> Worker:
    """The module's worker, back to serving whatever the previous test left."""
    assert worker.resume()["state"] == "serving", worker.stderr()
    return worker


def cli(*args: str, token: str | None = TOKEN,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m quiesce ARGS``; the token (if any) comes from the environment."""
    full_env = _clean_env()
    if token is not None:
        full_env["QUIESCE_ADMIN_TOKEN"] = token
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "quiesce", *args], capture_output=True,
                          text=True, timeout=CLI_S, env=full_env, stdin=subprocess.DEVNULL,
                          check=False)


def explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


# -- streaming load ------------------------------------------------------------------

@dataclasses.dataclass
class Stream:
    status: int = 0
    lines: list[str] = dataclasses.field(default_factory=list)
    started: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def tokens(self) -> int:
        return sum(1 for line in self.lines if line.startswith("data: {")
                   and "choices" in json.loads(line[len("data: "):]))

    @property
    def completed(self) -> bool:
        return self.status == 200 and bool(self.lines) and self.lines[-1] == "data: [DONE]"


def _run_stream(port: int, stream: Stream, max_tokens: int) -> Stream:
    try:
        with httpx.Client(trust_env=False, timeout=STREAM_S) as client, client.stream(
                "POST", f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": "hello there", "max_tokens": max_tokens,
                      "stream": True}) as response:
            stream.status = response.status_code
            for line in response.iter_lines():
                if line:
                    stream.lines.append(line)
                    stream.started.set()
    finally:
        stream.started.set()  # never leave the test waiting on a stream that failed
    return stream


@contextlib.contextmanager
def streaming_load(port: int, count: int = 3,
                   max_tokens: int = STREAM_TOKENS) -> Iterator[list[Stream]]:
    """``count`` streaming requests, each admitted and producing tokens when this yields.

    On the way out every stream has ended (or the outer timeout failed the test).
    """
    streams = [Stream() for _ in range(count)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=count) as pool:
        futures = [pool.submit(_run_stream, port, s, max_tokens) for s in streams]
        for stream in streams:
            assert stream.started.wait(START_S), "a stream produced no first token"
        for stream, future in zip(streams, futures, strict=True):
            if future.done():
                future.result()  # raise now if a stream failed before the test acted
            assert stream.status == 200, stream.lines
        yield streams
        for future in futures:
            future.result(timeout=STREAM_S)


def assert_all_completed(streams: list[Stream]) -> None:
    for stream in streams:
        assert stream.completed, stream.lines[-3:]
        assert stream.tokens == STREAM_TOKENS
        assert not any('"error"' in line for line in stream.lines)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- tests ---------------------------------------------------------------------------

def test_status_human_summary(serving: Worker) -> None:
    result = cli("status", "--url", serving.admin_url)
    assert result.returncode == 0, explain(result)
    out = result.stdout
    for label in ("state:", "in-flight:", "pending work:", "registration:", "last error:",
                  "requests:", "signal guard:", "drain cost:"):
        assert label in out, out
    assert "0 lost" in out and "refused at the gate" in out
    assert "drain cost:" in out and "0 ms (eta)" in out
    assert "serving" in out
    assert "quiescent" in out
    assert "registered with discovery" in out
    assert result.stderr == ""


def test_status_json_and_url_from_environment(serving: Worker) -> None:
    result = cli("status", "--json", env={"QUIESCE_ADMIN_URL": serving.admin_url})
    assert result.returncode == 0, explain(result)
    status = json.loads(result.stdout)
    assert status.keys() >= STATUS_KEYS
    assert status["state"] == "serving"
    assert isinstance(status["generation"], int)
    assert status["pending_work"]["verdict"] == "quiescent"


def test_wrong_token_exits_4_with_one_line(serving: Worker, tmp_path: Path) -> None:
    result = cli("status", "--url", serving.admin_url, token="wrong-token")
    assert result.returncode == 4, explain(result)
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "401" in result.stderr
    assert "Traceback" not in result.stderr

    result = cli("status", "--url", serving.admin_url, token=None)
    assert result.returncode == 4, explain(result)

    # --token-file wins over the environment
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    result = cli("status", "--url", serving.admin_url, "--token-file", str(token_file),
                 token="wrong-token")
    assert result.returncode == 0, explain(result)


def test_unreachable_worker_exits_3_with_one_line() -> None:
    result = cli("status", "--url", f"http://127.0.0.1:{free_port()}", "--timeout", "5")
    assert result.returncode == 3, explain(result)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "cannot connect" in result.stderr
    assert "Traceback" not in result.stderr


def test_drain_wait_lets_every_stream_finish_then_resume(serving: Worker) -> None:
    with streaming_load(serving.port) as streams:
        result = cli("drain", "--wait", "--url", serving.admin_url)
    assert result.returncode == 0, explain(result)
    assert "drained" in result.stdout
    assert f"{len(streams)} completed, 0 lost" in result.stdout  # how each stream ended
    assert "draining" in result.stderr  # the progress display
    assert_all_completed(streams)
    assert serving.status()["state"] == "drained"

    result = cli("resume", "--url", serving.admin_url)
    assert result.returncode == 0, explain(result)
    assert "serving" in result.stdout
    assert serving.status()["state"] == "serving"


def test_drain_wait_json_prints_the_final_status(serving: Worker) -> None:
    result = cli("drain", "--wait", "--json", "--budget", "30", "--url", serving.admin_url)
    assert result.returncode == 0, explain(result)
    status = json.loads(result.stdout)
    assert status["state"] == "drained"
    assert status["last_drain"]["drained"] is True


def test_invalid_budget_exits_2_and_changes_nothing(serving: Worker) -> None:
    before = serving.status()
    for bad in (["--budget", "-1"], ["--budget=-1"], ["--budget", "0"], ["--budget", "nan"],
                ["--budget", "soon"]):
        result = cli("drain", *bad, "--url", serving.admin_url)
        assert result.returncode == 2, explain(result)
        assert "--budget" in result.stderr
    after = serving.status()
    assert after["state"] == "serving"
    assert after["generation"] == before["generation"]


def test_prestop_under_load_drains_within_the_grace_period(serving: Worker) -> None:
    with streaming_load(serving.port) as streams:
        result = cli("prestop", "--url", serving.admin_url, "--margin", "5",
                     env={"QUIESCE_GRACE_PERIOD_S": "40"})
    assert result.returncode == 0, explain(result)
    assert "within 35s" in result.stderr  # budget = grace period - margin
    assert "drained" in result.stdout
    assert_all_completed(streams)
    assert serving.status()["state"] == "drained"


def test_prestop_without_time_left_is_a_usage_error(serving: Worker) -> None:
    result = cli("prestop", "--url", serving.admin_url, "--grace-period", "3", "--margin", "5")
    assert result.returncode == 2, explain(result)
    assert serving.status()["state"] == "serving"


def test_unmeetable_budget_exits_1_with_the_reason_then_resume(tmp_path: Path) -> None:
    # A worker of its own: this request's KV is never pulled, so it stays held until
    # the worker's shutdown aborts it, and no later drain could finish.
    # A short shutdown budget: SIGTERM in the teardown aborts the held KV at its end.
    with running_worker(tmp_path, "--budget", "2", "--reserve", "0.5") as stuck:
        response = httpx.post(
            f"http://127.0.0.1:{stuck.port}/v1/completions", trust_env=False, timeout=STREAM_S,
            json={"prompt": "prefill me", "max_tokens": 4,
                  "kv_transfer_params": {"do_remote_decode": True, "sim_never_pulled": True}})
        assert response.status_code == 200, response.text
        held = stuck.status()["pending_work"]
        assert held["kv_sends_held"] == 1

        result = cli("drain", "--wait", "--budget", "0.5", "--url", stuck.admin_url)
        assert result.returncode == 1, explain(result)
        last = result.stderr.strip().splitlines()[-1]
        assert "not drained" in last
        assert "kv_sends_held" in last  # what is still pending, and the worker's last error
        assert "timed_out" in last
        assert stuck.status()["state"] == "draining"

        result = cli("resume", "--url", stuck.admin_url, "--json")
        assert result.returncode == 0, explain(result)
        assert json.loads(result.stdout)["state"] == "serving"
        assert stuck.status()["state"] == "serving"


def test_an_unreadable_gpu_keeps_a_worker_that_requires_it_quiet_from_draining(
        tmp_path: Path) -> None:
    # The real pynvml on a machine without an NVIDIA driver: NVML cannot answer, so the
    # idle engine is not enough and the worker never claims drained (fail closed).
    # tests/gpu/test_nvml.py reads a real H200.
    with running_worker(tmp_path, "--require-gpu-quiet", "0") as worker:
        pending = worker.status()["pending_work"]
        assert pending["verdict"] == "unknown"
        assert any("NVML" in reason for reason in pending["reasons"]), pending
        assert "GPUs cannot be read" in worker.stderr()
        result = cli("drain", "--wait", "--budget", "0.5", "--url", worker.admin_url)
        assert result.returncode == 1, explain(result)
        assert "NVML" in result.stderr
        assert worker.status()["state"] == "draining"


def test_a_bad_gpu_list_exits_2_before_anything_starts() -> None:
    result = cli("serve", "--engine", "sim", "--require-gpu-quiet", "0,x", "--port", "0",
                 "--admin-port", "0")
    assert result.returncode == 2, explain(result)
    assert "require_gpu_quiet" in result.stderr
