"""The disaggregated pair, as an operator runs it: two processes on the CPU, a prefill
worker (NIXL ``kv_producer``) and a decode worker (``kv_consumer``), each with vLLM's real
``NixlConnector`` over NIXL's UCX backend and its own side-channel port
(``VLLM_NIXL_SIDE_CHANNEL_PORT``, read by the spawned EngineCore), and a tiny proxy in
this process (:mod:`tests.integration.vllm.disagg_proxy`) that sends each completion to
the prefill worker (one token, KV held for a remote decode) and then, streaming, to the
decode worker, which pulls the KV from the prefill worker over NIXL. The workers' NIXL
agents run without their progress thread (``nixl_cpu/sitecustomize.py``: it busy-polls a
whole core per engine, which two engines on this two-core machine cannot afford); NIXL
then progresses in the calls vLLM's connector makes on each engine step. Neither vLLM's
NIXL connector (same ``sitecustomize.py``) nor its CPU backend
(:data:`.nixl_workers.NO_CPU_BINDING`) pins a worker's main thread to a core: both
pinned both workers to the same one.

Two faces of the prefill worker are tested, each as its own process: vLLM's own server
with quiesce's middleware (``vllm serve ... --middleware``, :mod:`.serve_process`) and
``quiesce serve --engine vllm --role prefill``. The decode worker is a ``vllm serve``
with the middleware (its role, decode, from its ``kv_consumer``), so the pair of the
first face is two ``vllm serve`` behind a proxy that passes ``kv_transfer_params``.

The scenario: several requests go through the proxy; their prefills finish, so the
prefill worker has no admitted request left but holds their KV; the decode side is slow
to pull (the proxy holds the decode requests back: deterministic). Then the prefill
worker is signalled — SIGTERM to its main process only (the kubelet), to its whole
process group (a terminal, an init shim), to every one of its processes (systemd,
``pkill``), and SIGINT to its group (Ctrl-C) — and its drain must wait for the KV sends
(``kv_sends_held``), with vLLM's own processes alive, until the decoder pulls. Then the
decode streams complete with every token and the prefill worker exits 0, drained, with
no request lost.

Engine start-up is slow (~25–50 s each on two CPU cores): the decode worker is started
once for the module, a fresh prefill worker for each delivery (it exits at the end of
each). Three of the four deliveries, across the faces (:data:`DELIVERIES`; the
fourth, SIGTERM to the main process only, is the last test's, and the four on ``vllm
serve`` under aggregated streaming load are test_vllm_serve.py's). The last test
is the negative: a prefill worker whose decoder never pulls ends its
drain timed out at its budget, exit code 3, never ``drained``. NIXL's own safety net, the
lease on held blocks (``kv_lease_duration``), is set far longer than any scenario here
(and each test checks that no lease expired), so a ``drained`` can only come from the
decoder's pull.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.vllm.conftest import SKIP_REASON
from tests.integration.vllm.disagg_proxy import DecodeStream, DisaggProxy, completion
from tests.integration.vllm.nixl_workers import (
    DECODE_TOKENS,
    LEASE_EXPIRED,
    nixl_worker,
)
from tests.integration.vllm.serve_process import deliver
from tests.integration.worker_process import Worker

pytest.importorskip("vllm", reason=SKIP_REASON)

pytestmark = [pytest.mark.slow]

BUDGET_S = 25.0
"""The prefill worker's shutdown budget: ample for a pull that takes a second or two."""
NEVER_PULLED_BUDGET_S = 8.0
NEVER_PULLED_RESERVE_S = 2.0
"""Budget and cleanup reserve of the prefill worker whose decoder never pulls: its drain
gets the 6 s between them."""
REQUESTS = 3
HOLD_S = 1.0
"""How long the decode side keeps waiting once the drain is seen waiting on the KV."""
WAIT_S = 120.0
"""Bound of every wait on a worker (a hang fails the test instead of stalling it)."""
POLL_S = 0.05


@pytest.fixture(scope="module")
def decode_worker(tiny_model: Path) -> Iterator[Worker]:
    with nixl_worker(tiny_model, "decode", "--budget", str(BUDGET_S)) as worker:
        yield worker
        worker.signal(signal.SIGTERM)
        worker.finish(BUDGET_S + 30)


def held(status: dict[str, Any]) -> Any:
    work = status.get("pending_work") or {}
    return work.get("kv_sends_held")


class StatusWatch:
    """Reads a worker's ``GET /engine/status`` every :data:`POLL_S` until its admin API
    goes away (the worker exits), keeping every answer."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.seen: list[dict[str, Any]] = []
        self.ended: str | None = None
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                self.seen.append(await asyncio.to_thread(self.worker.status))
            except (httpx.HTTPError, OSError) as exc:
                self.ended = repr(exc)
                return
            await asyncio.sleep(POLL_S)

    async def until(self, check: Callable[[dict[str, Any]], bool], what: str,
                    timeout: float = WAIT_S, since: int | None = None) -> dict[str, Any]:
        """The first status for which ``check`` holds, among those read from now on (or
        from the ``since``-th one)."""
        start = len(self.seen) if since is None else since
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for status in self.seen[start:]:
                if check(status):
                    return status
            start = len(self.seen)
            if self.task.done():
                pytest.fail(f"{what}: the admin API went away ({self.ended}); last status "
                            f"{self.seen[-1] if self.seen else None}")
            await asyncio.sleep(POLL_S)
        pytest.fail(f"{what}: not seen within {timeout}s; last status "
                    f"{self.seen[-1] if self.seen else None}")

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def until_prefilled(proxy: DisaggProxy, tasks: list[asyncio.Task[DecodeStream]],
                          count: int) -> None:
    """Until ``count`` requests have their prefill answered and wait to be decoded."""
    deadline = time.monotonic() + WAIT_S
    while proxy.waiting_to_decode < count:
        for task in tasks:
            if task.done():
                task.result()  # a failed prefill raises here
                pytest.fail("a request went on to decode before it was released")
        assert time.monotonic() < deadline, "prefills did not finish in time"
        await asyncio.sleep(POLL_S)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def tail(worker: Worker, lines: int = 40) -> str:
    return "".join(worker.lines[-lines:])


def stage(report: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(s for s in report["stages"] if s["stage"] == name)
    return found


DELIVERIES = [
    pytest.param("vllm", "group", id="vllm-serve-sigterm-process-group"),
    pytest.param("vllm", "every", id="vllm-serve-sigterm-every-process"),
    pytest.param("quiesce", "int", id="quiesce-serve-sigint-process-group"),
]
"""(face of the prefill worker, delivery of :data:`.serve_process.DELIVERIES`)."""


@pytest.mark.parametrize(("face", "how"), DELIVERIES)
async def test_prefill_worker_leaves_only_after_the_decoder_pulled_its_kv(
        tiny_model: Path, decode_worker: Worker, face: str, how: str) -> None:
    sig = signal.SIGINT if how == "int" else signal.SIGTERM
    with nixl_worker(tiny_model, "prefill", "--budget", str(BUDGET_S), face=face) as prefill:
        proxy = DisaggProxy(prefill.url, decode_worker.url)
        release = asyncio.Event()  # the decode side is slow to pull: it waits for this
        tasks = [asyncio.create_task(proxy.complete(completion(), hold=release))
                 for _ in range(REQUESTS)]
        watch: StatusWatch | None = None
        try:
            await until_prefilled(proxy, tasks, REQUESTS)

            # every stream on the prefill worker ended; its engine holds the KV for D
            watch = StatusWatch(prefill)
            before = await watch.until(lambda s: held(s) == REQUESTS,
                                       f"{REQUESTS} KV sends held before the signal")
            assert before["state"] == "serving", before
            assert before["inflight_requests"] == 0, before

            signalled = deliver(prefill.process.pid, how)
            assert len(signalled) >= (1 if how == "main" else 2), signalled  # engine too
            draining = await watch.until(
                lambda s: (s["state"] == "draining" and (s.get("drain") or {}).get("stage")
                           == "engine" and held(s) == REQUESTS),
                f"drain waiting on {REQUESTS} KV sends after {sig.name} to {how}")
            assert draining["accepting"] is False and draining["inflight_requests"] == 0

            # it keeps waiting while the decoder has not pulled; none of its processes exit
            await asyncio.sleep(HOLD_S)
            waiting = await watch.until(lambda s: True, "prefill worker status")
            assert waiting["state"] == "draining", waiting
            assert held(waiting) == REQUESTS, waiting  # a dead engine would read unknown
            assert prefill.process.poll() is None, tail(prefill)
            alive = [pid for pid in signalled if pid_alive(pid)]
            assert alive == signalled, f"signalled {signalled}, alive {alive}\n{tail(prefill)}"

            # the decoder pulls now; the prefill worker is notified, frees the KV, drains
            release.set()
            results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
            # the worker exits within a second of drained: its exit report is the record
            code, report = await asyncio.to_thread(prefill.finish, BUDGET_S + 30)
        finally:
            for task in tasks:
                task.cancel()
            if watch is not None:
                await watch.stop()

    for result in results:  # each decode stream was read to its end: every token
        logs = f"{result}\nprefill:\n{tail(prefill)}\ndecode:\n{tail(decode_worker)}"
        assert result.complete, logs
        assert result.finish_reason == "length", logs  # ignore_eos: max_tokens generated
        assert result.completion_tokens == DECODE_TOKENS, logs

    assert report is not None, f"exit code {code}, no exit report\n{tail(prefill)}"
    assert code == 0, report
    assert report["drained"] is True and report["outcome"] == "drained", report
    assert report["signal"] == sig.name, report
    assert report["lost_requests"] == 0 and report["aborted_requests"] == 0, report
    drain = stage(report, "drain")
    assert drain["outcome"] == "completed", report
    assert drain["elapsed_s"] >= HOLD_S, report  # it waited for the pull
    assert stage(report, "abort")["outcome"] == "skipped", report

    assert report["requests"] == {"completed": 0, "lost": 0, "client_gone": 0,
                                  "rejected": 0}, report  # every stream ended before the signal
    assert watch is not None
    last = watch.seen[-1]  # the last status the admin API gave before the worker left
    assert last["requests"]["ended_total"] == {"completed": REQUESTS, "lost": 0,
                                               "client_gone": 0, "rejected": 0}, last
    # the decoder's reads freed the KV, not the lease
    assert not [line for line in prefill.lines if LEASE_EXPIRED in line], tail(prefill)


async def test_prefill_worker_whose_decoder_never_pulls_times_out_never_drained(
        tiny_model: Path, decode_worker: Worker) -> None:
    with nixl_worker(tiny_model, "prefill", "--budget", str(NEVER_PULLED_BUDGET_S),
                     "--reserve", str(NEVER_PULLED_RESERVE_S), face="quiesce") as prefill:
        proxy = DisaggProxy(prefill.url, decode_worker.url)
        kv_params = await proxy.prefill(completion())  # and the decoder never asks
        assert kv_params["remote_port"], kv_params
        watch = StatusWatch(prefill)
        try:
            await watch.until(lambda s: held(s) == 1, "the KV send held before the signal")
            deliver(prefill.process.pid, "main")
            code, report = await asyncio.to_thread(prefill.finish,
                                                   NEVER_PULLED_BUDGET_S + 30)
        finally:
            await watch.stop()

    assert report is not None, f"exit code {code}, no exit report\n{tail(prefill)}"
    assert code == 3, report
    assert report["drained"] is False and report["outcome"] == "forced", report
    drain = stage(report, "drain")
    assert drain["outcome"] == "timed_out", report
    assert "kv_sends_held=1" in drain["detail"], report
    # it waited for the KV until its budget's end (less the cleanup reserve)
    assert drain["elapsed_s"] >= NEVER_PULLED_BUDGET_S - NEVER_PULLED_RESERVE_S - 0.5, report
    assert not [line for line in prefill.lines if LEASE_EXPIRED in line], tail(prefill)
    states = {s["state"] for s in watch.seen}
    assert "drained" not in states, states
    assert any(held(s) == 1 for s in watch.seen if s["state"] == "draining"), watch.seen[-1:]
