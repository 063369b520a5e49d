"""A throw-away single-node etcd on loopback, for tests, benchmarks and demos.

``LocalEtcd`` runs the ``etcd`` binary (Debian's ``etcd-server``; ``ci/setup_etcd.sh``
installs it) on 127.0.0.1 with two free ports and a temporary data directory. ``start``
waits for health with a doubling backoff inside its timeout; ``stop`` terminates it
(SIGTERM, then SIGKILL after a bound) and keeps the data directory, so that ``start``
again is an etcd *restart* with the same keys and leases; ``close`` stops it and removes
the directory. Standard library only: health is etcd's ``GET /health`` over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from quiesce.budget import Deadline, check_seconds
from quiesce.errors import ConfigError, QuiesceError

__all__ = ["EtcdNotAvailable", "LocalEtcd", "etcd_binary"]


class EtcdNotAvailable(QuiesceError):
    """The etcd binary is missing, or it did not become healthy in time."""


def etcd_binary() -> str | None:
    """The path of ``etcd`` on PATH, or None."""
    return shutil.which("etcd")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalEtcd:
    """One etcd member on loopback. Not thread-safe; one per test or benchmark."""

    def __init__(self, binary: str | None = None, name: str = "quiesce-test") -> None:
        found = binary or etcd_binary()
        if found is None:
            raise EtcdNotAvailable("the etcd binary is not on PATH: run ci/setup_etcd.sh "
                                   "(apt-get install etcd-server)")
        if not name.replace("-", "").isalnum():
            raise ConfigError("name", f"must be alphanumeric with dashes, got {name!r}")
        self.binary = found
        self.name = name
        self.host = "127.0.0.1"
        self.port = _free_port()
        self.peer_port = _free_port()
        self.data_dir = Path(tempfile.mkdtemp(prefix="quiesce-etcd-"))
        self.log_path = self.data_dir.with_suffix(".log")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=0.5) as reply:
                return bool(json.loads(reply.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def start_sync(self, timeout_s: float = 10.0) -> None:
        """Start (or restart) etcd and wait until healthy; EtcdNotAvailable after
        ``timeout_s`` (the process is stopped then)."""
        check_seconds("timeout_s", timeout_s, allow_zero=False)
        if self.running:
            return
        peer = f"http://{self.host}:{self.peer_port}"
        args = [self.binary, "--name", self.name, "--data-dir", str(self.data_dir / "data"),
                "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{self.name}={peer}", "--log-level", "warn"]
        with self.log_path.open("ab") as log:
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
        self._process = process
        deadline = Deadline.after(timeout_s)
        delay = 0.01
        while not self._healthy():
            code = process.poll()
            if code is not None:
                self._process = None
                raise EtcdNotAvailable(f"etcd exited with {code}; log: {self.log_tail()}")
            if deadline.expired():
                self.stop()
                raise EtcdNotAvailable(f"etcd not healthy within {timeout_s:g}s; "
                                       f"log: {self.log_tail()}")
            time.sleep(min(delay, deadline.remaining()))
            delay = min(delay * 2, 0.2)

    async def start(self, timeout_s: float = 10.0) -> None:
        await asyncio.to_thread(self.start_sync, timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop etcd (SIGTERM, SIGKILL after ``timeout_s``); the data directory stays."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL etcd at once (a crash); the data directory stays."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(5.0)

    def close(self) -> None:
        """Stop etcd and remove its data directory and log."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.log_path.unlink()

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"
