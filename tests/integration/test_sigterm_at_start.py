"""``quiesce serve`` signalled as soon as it owns its signals (its ``starting`` line),
before or while its engine starts and it registers: it ends with a report and exit code,
no hang, no process left. (While serving, while draining and after drained:
test_sigterm.py, test_kubelet_sequence.py; the Dynamo wrapper:
tests/integration/dynamo/test_vllm_worker.py.)"""

from __future__ import annotations

import signal
import sys

import pytest

from tests.integration.worker_process import running, tail, worker_env

EXIT_S = 30.0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_at_start_ends_drained_with_nothing_served(sig: signal.Signals) -> None:
    command = [sys.executable, "-m", "quiesce", "serve", "--engine", "sim", "--port", "0",
               "--admin-port", "0", "--budget", "10", "--reserve", "2"]
    with running(command, worker_env(), '"event": "starting"', timeout_s=EXIT_S,
                 name="quiesce serve") as worker:
        worker.signal(sig)
        code, report = worker.finish(EXIT_S)
    assert code == 0 and report is not None, tail(worker.lines)
    assert report["outcome"] == "drained" and report["lost_requests"] == 0, report
    assert report["signal"] == sig.name
