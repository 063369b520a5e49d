"""What Kubernetes does to a pod, against a real reference-worker process under load.

There is no cluster on this machine, so the test performs the kubelet's sequence
itself: run the preStop hook (``quiesce prestop``), then SIGTERM, then SIGKILL once
the grace period is over. It asserts zero lost streams and an exit before SIGKILL,
in every run; and, when a KV transfer is never pulled, a forced outcome that is
reported, still before SIGKILL.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.worker_process import (
    Deletion,
    StreamResult,
    Worker,
    kubelet_delete,
    prestop_command,
    start_worker,
    stream_completion,
)

pytestmark = pytest.mark.slow

GRACE_S = 12.0  # terminationGracePeriodSeconds
MARGIN_S = 6.0  # prestop drains for GRACE_S - MARGIN_S; the worker budget (3 s) fits in it
WORKER_ARGS = ("--decode-step", "0.01", "--router-grace", "0.3", "--budget", "3",
               "--reserve", "1")


async def delete(worker: Worker) -> Deletion:
    """preStop, then SIGTERM, then SIGKILL once the grace period is over."""
    return await kubelet_delete(worker, GRACE_S, prestop_command(worker, GRACE_S, MARGIN_S))


@pytest.mark.parametrize("run", [1, 2])
async def test_scale_down_under_streaming_load_loses_nothing(run: int) -> None:
    with start_worker(*WORKER_ARGS) as worker:
        started = asyncio.Event()
        streams = [asyncio.create_task(stream_completion(worker.url, 120 + 10 * i,
                                                         started=started))
                   for i in range(8)]
        streams += [asyncio.create_task(stream_completion(
            worker.url, 1, kv={"do_remote_decode": True}))]
        await asyncio.wait_for(started.wait(), timeout=30)
        deletion = await delete(worker)
        results: list[StreamResult] = await asyncio.gather(*streams)
    assert deletion.exit_code == 0, "the worker had to be SIGKILLed or exited forced"
    assert deletion.prestop_code == 0
    assert deletion.report is not None and deletion.report["drained"] is True
    for result in results:
        assert result.status == 200 and result.done and result.error is None, result
    assert [r.tokens for r in results[:8]] == [120 + 10 * i for i in range(8)]


async def test_kv_never_pulled_is_forced_and_reported_before_sigkill() -> None:
    with start_worker(*WORKER_ARGS) as worker:
        held = await stream_completion(worker.url, 1, kv={"do_remote_decode": True,
                                                          "sim_never_pulled": True})
        assert held.done
        assert worker.status()["state"] == "serving"
        deletion = await delete(worker)
    assert deletion.prestop_code == 1, "prestop must say the drain did not finish"
    assert deletion.exit_code == 3, "forced shutdown (exit 3) before SIGKILL"
    assert deletion.report is not None
    assert deletion.report["drained"] is False
    assert deletion.report["aborted_requests"] == 1
