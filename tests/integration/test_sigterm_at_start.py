"""``quiesce serve`` signalled as soon as it owns its signals (its ``starting`` line),
before or while its engine starts and it registers: it ends with a report and exit code,
no hang, no process left. (While serving, while draining and after drained:
test_sigterm.py, test_kubelet_sequence.py; the Dynamo wrapper:
tests/integration/dynamo/test_vllm_worker.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from tests.integration.worker_process import json_events, worker_env

EXIT_S = 30.0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_at_start_ends_drained_with_nothing_served(sig: signal.Signals) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "quiesce", "serve", "--engine", "sim", "--port", "0",
         "--admin-port", "0", "--budget", "10", "--reserve", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env(),
        start_new_session=True)
    lines: list[str] = []
    starting = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if '"event": "starting"' in line:
                starting.set()
        starting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert starting.wait(EXIT_S), "".join(lines)
        process.send_signal(sig)
        code = process.wait(timeout=EXIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(timeout=5)
    exits = [e for e in json_events(lines) if e.get("event") == "exit"]
    assert code == 0 and exits, "".join(lines)
    report = exits[-1]
    assert report["outcome"] == "drained" and report["lost_requests"] == 0, report
    assert report["signal"] == sig.name
