"""What the Dynamo replay's arms (:mod:`.run`) and its scale arm (:mod:`.scale`) share:
a warm-up, waiting for aiperf's first request at the frontend, keeping every process's
log, and the victim's part of a run's JSON."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from bench.replay import aiperf
from bench.replay.judge import RequestOutcome, read_outcomes
from tests.integration.dynamo.processes import Frontend
from tests.integration.worker_process import (
    Deletion,
    Worker,
    kubelet_delete,
    stream_completion,
)

WARM_UP_ROUNDS = 3
WARM_UP_CONCURRENCY = 4


async def warm_up(url: str, model: str, timeout_s: float) -> None:
    """A few rounds of concurrent short requests through the frontend before the load: a
    vLLM engine on the CPU takes seconds over its first forward passes (the prefill
    worker of a pair answered none of its first requests within 9 s when the load hit it
    cold), which would otherwise land on whichever requests come first in an arm.
    RuntimeError if one fails."""
    for round_ in range(WARM_UP_ROUNDS):
        results = await asyncio.gather(*(
            stream_completion(url, 4, prompt="warm up " * (4 + 6 * index + round_),
                              model=model, ignore_eos=True, include_usage=True,
                              timeout_s=timeout_s)
            for index in range(WARM_UP_CONCURRENCY)))
        failed = [r for r in results if not r.complete]
        if failed:
            raise RuntimeError(f"a warm-up request failed: {failed[0]}")


async def first_request(front: Frontend, load: asyncio.Task[aiperf.AiperfRun],
                        timeout_s: float, after: int = 0) -> None:
    """Until the frontend logs a request after its first ``after`` lines (those of a
    warm-up), or aiperf ended; RuntimeError after ``timeout_s`` without either."""
    deadline = time.monotonic() + timeout_s
    while not any("request received" in line for line in front.process.lines[after:]):
        if load.done():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"aiperf sent no request within {timeout_s:g}s")
        await asyncio.sleep(0.05)


def keep_logs(workdir: Path, front: Frontend, workers: list[Worker]) -> None:
    """Every process's output beside aiperf's artifacts (``frontend.log``, ``worker-N.log``)."""
    (workdir / "frontend.log").write_text("".join(front.process.lines))
    for index, worker in enumerate(workers):
        (workdir / f"worker-{index}.log").write_text("".join(worker.lines))


def victim_dict(exit_code: int | None, prestop_code: int | None,
                signal_to_exit_s: float | None, report: dict[str, Any] | None
                ) -> dict[str, object]:
    """The scaled-down worker in a run's JSON: how it exited, and its own report's verdict."""
    report = report or {}
    return {"exit_code": exit_code, "prestop_code": prestop_code,
            "signal_to_exit_s": signal_to_exit_s, "outcome": report.get("outcome"),
            "lost_requests": report.get("lost_requests")}


async def delete_during_load(load: asyncio.Task[aiperf.AiperfRun], victim: Worker,
                             grace_s: float, prestop: list[str] | None
                             ) -> tuple[Deletion, float, aiperf.AiperfRun]:
    """Delete ``victim`` as the kubelet does (``prestop`` hook if any, SIGTERM, SIGKILL at
    ``grace_s``) while aiperf's ``load`` runs, then wait for the load: the deletion, its
    seconds from start to the victim's exit, and aiperf's run. On any error aiperf is
    stopped (its process group killed) before the error propagates."""
    try:
        started = time.monotonic()
        deletion = await kubelet_delete(victim, grace_s, prestop)
        removal_s = time.monotonic() - started
        return deletion, removal_s, await load
    finally:
        await stop_load(load)


async def stop_load(load: asyncio.Task[aiperf.AiperfRun]) -> None:
    """Cancel aiperf's run if it still goes (which kills its process group) and wait."""
    if not load.done():
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load


def judged(run: aiperf.AiperfRun) -> list[RequestOutcome]:
    """Every request of aiperf's raw export, judged; RuntimeError with aiperf's log tail
    when there is no export (aiperf failed, was killed, or every request failed: aiperf
    0.13 then writes none)."""
    if not run.raw_export.is_file():
        log_tail = run.log.read_text(errors="replace")[-2000:] if run.log.is_file() else ""
        raise RuntimeError(f"aiperf wrote no raw export (exit {run.returncode}, timed out: "
                           f"{run.timed_out}); its log ends:\n{log_tail}")
    return read_outcomes(run.raw_export)
