"""SGLang's main-process SIGTERM drain, and how quiesce keeps it out (real TokenizerManager).

In a child process (signals in the test runner would be unsafe): a real
``TokenizerManager`` (made without its constructor; a ZMQ PULL socket stands in for the
detokenizer's output) runs its real ``auto_create_handle_loop``, which registers SGLang's
``SignalHandler`` and starts ``sigterm_watchdog``. Unchanged, SIGTERM sets
``gracefully_exit``, which starts SGLang's own drain-then-kill; after
:func:`own_main_process_signals` it does not, and a handler the worker registers after it
receives the signal.

In a scheduler-like child under a quiesce owner: SGLang's real ``load_plugins()`` runs
quiesce's plugin first thing (as ``run_scheduler_process`` does), then SGLang's real hf3fs
HiCache backend (``HiCacheHF3FS`` with its mock 3FS client) installs its own SIGINT/
SIGTERM/SIGQUIT handlers, which close its storage. The report must still be true (the
backend's handlers guarded as they were installed), and SIGTERM/SIGINT must not close the
storage until the worker permits it. ``SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION`` shows in the
report as a warning.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from quiesce.signal_guard import SignalOwnership, descendants
from tests.integration.sglang import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

CHILD = r"""
import asyncio, contextlib, json, os, signal, sys
import zmq, zmq.asyncio
from sglang.srt.managers.tokenizer_manager import SignalHandler, TokenizerManager
from quiesce.adapters.sglang.signals import own_main_process_signals

mode, ipc = sys.argv[1], sys.argv[2]

class NoWatchdog:  # stands in for SGLang's soft watchdog (a debugging aid)
    def disable(self):
        return contextlib.nullcontext()
    def feed(self):
        pass

async def main():
    tm = object.__new__(TokenizerManager)
    tm.event_loop, tm.asyncio_tasks, tm.rid_to_state = None, set(), {}
    tm.signal_handler_class, tm._gracefully_exit = SignalHandler, False
    tm.soft_watchdog = NoWatchdog()
    tm.recv_from_detokenizer = zmq.asyncio.Context().socket(zmq.PULL)
    tm.recv_from_detokenizer.bind(ipc)
    loop = asyncio.get_running_loop()
    worker = []
    if mode == "sglang":
        tm.auto_create_handle_loop()
    else:
        done = own_main_process_signals(tm)
        assert done and own_main_process_signals(tm)  # idempotent
        if mode == "quiesce+worker":  # the worker registers its handler after start()
            loop.add_signal_handler(signal.SIGTERM, worker.append, "SIGTERM")
    tasks = sorted(t.get_coro().__qualname__ for t in tm.asyncio_tasks)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.sleep(0.3)
    print(json.dumps({"gracefully_exit": tm.gracefully_exit, "worker": worker,
                      "handler_class": tm.signal_handler_class.__qualname__, "tasks": tasks}),
          flush=True)
    os._exit(0)

asyncio.run(main())
"""


def run(mode: str, tmp_path: Path) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, f"ipc://{tmp_path}/detok"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_unchanged_sglang_starts_its_own_drain_on_sigterm(tmp_path: Path) -> None:
    result = run("sglang", tmp_path)
    assert result["gracefully_exit"] is True  # sigterm_watchdog now drains, then kills
    assert result["tasks"] == ["print_exception_wrapper", "print_exception_wrapper"]


def test_after_own_main_process_signals_sglang_ignores_sigterm(tmp_path: Path) -> None:
    result = run("quiesce", tmp_path)
    assert result["gracefully_exit"] is False
    assert str(result["handler_class"]).startswith("DeferToQuiesce(")


def test_the_worker_registered_after_gets_sigterm(tmp_path: Path) -> None:
    result = run("quiesce+worker", tmp_path)
    assert result["gracefully_exit"] is False and result["worker"] == ["SIGTERM"]


HF3FS_CHILD = r"""
import sys, time
from sglang.srt.plugins import load_plugins
load_plugins()  # first thing, as in SGLang's scheduler process: quiesce guards it
import torch
from sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server import (
    Hf3fsLocalMetadataClient)
from sglang.srt.mem_cache.storage.hf3fs.storage_hf3fs import HiCacheHF3FS

class Storage(HiCacheHF3FS):
    def close(self):
        print("hf3fs storage closed", flush=True)
        super().close()

storage = Storage(rank=0, file_path=sys.argv[1], file_size=1 << 20, numjobs=1,
                  bytes_per_page=4096, entries=8, client_timeout=5, dtype=torch.float16,
                  metadata_client=Hf3fsLocalMetadataClient(), use_mock_client=True)
print("ready", flush=True)
while True:
    time.sleep(0.02)
"""


@pytest.fixture
def owner() -> Iterator[SignalOwnership]:
    ownership = SignalOwnership()
    ownership.claim()
    try:
        yield ownership
    finally:
        ownership.release()


def start_hf3fs(tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    environ = {**os.environ, **env}
    environ.pop("SGLANG_PLUGINS", None)
    process = subprocess.Popen([sys.executable, "-c", HF3FS_CHILD, str(tmp_path / "hf3fs")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=environ)
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip() == "ready":
            return process
    process.wait(timeout=30)
    raise AssertionError(f"the child never got ready: {process.stderr.read()[-3000:]}"
                         if process.stderr else "the child never got ready")


class Lines:
    """A stream's lines, read by a thread, so that waiting for one has a deadline (a
    failed guard must fail the test, not hang it)."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None
        self.queue: queue.Queue[str] = queue.Queue()

        def read() -> None:
            for line in stream:
                self.queue.put(line)

        threading.Thread(target=read, daemon=True).start()

    def next(self, timeout_s: float = 60) -> str:
        try:
            return self.queue.get(timeout=timeout_s)
        except queue.Empty:
            return ""


def test_hf3fs_handlers_installed_after_the_guard_are_guarded(
        owner: SignalOwnership, tmp_path: Path) -> None:
    process = start_hf3fs(tmp_path)
    try:
        report = owner.report()
        (mine,) = [p for p in report.processes if p.pid == process.pid]
        assert mine.protected, mine
        assert mine.how == "guarded (wraps HiCacheHF3FS.__init__.<locals>.<lambda>)", mine
        out, err = Lines(process.stdout), Lines(process.stderr)
        for sig in (signal.SIGTERM, signal.SIGINT):
            process.send_signal(sig)
            said = f"(pid {process.pid}) ignores {signal.Signals(sig).name}"
            while said not in (line := err.next()):  # past SGLang's own warnings
                assert line, f"the guard never said {said!r}"
        owner.permit_shutdown()
        process.send_signal(signal.SIGTERM)
        # only now does the backend's own handler run: its first output since "ready"
        assert out.next().strip() == "hf3fs storage closed"
    finally:
        process.kill()
        process.wait(timeout=30)


def test_killpg_on_scheduler_exception_is_a_warning_in_the_report(
        owner: SignalOwnership, tmp_path: Path) -> None:
    process = start_hf3fs(tmp_path, SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION="1")
    try:
        report = owner.report()
        (warning,) = report.warnings
        assert warning.startswith("SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1: ")
        assert f"pid {os.getpid()}" in warning and "WARNING" in report.summary()
        # the signals are still guarded (this test's process: another module's engine
        # may still be a child of this pytest process, started before this owner)
        mine = {process.pid, *descendants(process.pid)}
        guards = [p for p in report.processes if p.pid in mine]
        assert guards and all(p.protected for p in guards), report.summary()
    finally:
        process.kill()
        process.wait(timeout=30)
