"""Watching a worker from outside while it shuts down: its processes in ``/proc``, its
admin status, and what it leaves in ``/dev/shm``.

Used by :mod:`bench.shutdown`; standard library and httpx only, no engine imports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from tests.integration.worker_process import TOKEN

STATUS_POLL_S = 0.05
PROC_POLL_S = 0.005


def proc_state(pid: int) -> str | None:
    """The process's state letter, or None once it is gone (no /proc entry)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def proc_name(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    if "resource_tracker" in cmdline:
        return "resource_tracker"
    return comm


class ProcessWatch:
    """When each process of the worker is gone (exited: a zombie or no entry), wall clock."""

    def __init__(self, pids: dict[int, str]) -> None:
        self.names = pids
        self.gone: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set() and len(self.gone) < len(self.names):
            for pid in self.names:
                if pid not in self.gone and proc_state(pid) in (None, "Z", "X"):
                    self.gone[pid] = time.time()
            time.sleep(PROC_POLL_S)

    def wait(self, timeout: float) -> bool:
        self._thread.join(timeout)
        self._stop.set()
        return len(self.gone) == len(self.names)


@dataclasses.dataclass
class Status:
    at: float
    state: str
    since: float
    last_drain_elapsed_s: float | None


class StatusPoller:
    """GET /engine/status every ``STATUS_POLL_S`` until it shows ``drained`` or ``stopping``
    (or the admin server stops answering)."""

    def __init__(self, admin_url: str) -> None:
        self.url = f"{admin_url}/engine/status"
        self.statuses: list[Status] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _poll(self) -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2) as client:
            while not self._stop.is_set():
                try:
                    data = client.get(self.url).json()
                except (httpx.HTTPError, ValueError):
                    return  # the admin server closed: the worker is exiting
                last = data.get("last_drain") or {}
                status = Status(time.time(), str(data.get("state")),
                                float(data.get("since", 0.0)), last.get("elapsed_s"))
                self.statuses.append(status)
                if status.state in ("drained", "stopping"):
                    return  # all it needs: no requests of its own during the exit
                self._stop.wait(STATUS_POLL_S)

    def first(self, state: str) -> Status | None:
        return next((s for s in self.statuses if s.state == state), None)


def shm_names() -> set[str]:
    with contextlib.suppress(OSError):
        return set(os.listdir("/dev/shm"))
    return set()


def remove_left(names: Sequence[str]) -> None:
    """Remove what a run left in /dev/shm (recorded first), unless a live process maps it.

    A worker killed with its process group (a run that failed) takes multiprocessing's
    resource tracker with it, so nothing else would ever unlink its segments (two vLLM
    message-queue rings, ~400 MB of memory, per worker).
    """
    if not names:
        return
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            text = maps.read_text(errors="replace")
            mapped.update(name for name in names if f"/dev/shm/{name}" in text)
    for name in names:
        path = Path("/dev/shm", name)
        if name in mapped:
            continue
        with contextlib.suppress(OSError):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
