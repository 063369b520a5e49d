"""SGLang's main-process SIGTERM drain, and how quiesce keeps it out (real TokenizerManager).

In a child process (signals in the test runner would be unsafe): a real
``TokenizerManager`` (made without its constructor; a ZMQ PULL socket stands in for the
detokenizer's output) runs its real ``auto_create_handle_loop``, which registers SGLang's
``SignalHandler`` and starts ``sigterm_watchdog``. Unchanged, SIGTERM sets
``gracefully_exit``, which starts SGLang's own drain-then-kill; after
:func:`own_main_process_signals` it does not, and a handler the worker registers after it
receives the signal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
