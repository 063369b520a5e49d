"""One signalled ``vllm serve`` of either arm (:mod:`bench.vllm_serve`): aggregated under
streaming load, or the prefill worker of a NIXL pair; what its clients got and when its
processes were gone."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from bench.watch import ProcessWatch, proc_name
from tests.integration.vllm.disagg_proxy import DecodeStream, DisaggProxy, completion
from tests.integration.vllm.nixl_workers import nixl_worker
from tests.integration.vllm.serve_process import deliver, exit_events, paced, vllm_serve
from tests.integration.worker_process import (
    StreamResult,
    Worker,
    stream_completion,
    worker_processes,
)

ARMS = ("vllm_own", "quiesce")
STREAMS = 16
TOKENS = 150
STEP_S = 0.02
"""150 tokens at 20 ms a step: each stream runs ~3 s, so the signal lands mid-stream."""
OWN_SHUTDOWN_TIMEOUT_S = 60
QUIESCE_SETTINGS = "--budget 60 --router-grace 0.2"
PAIR_REQUESTS = 4
PULL_DELAY_S = 1.0
"""How long after the signal the decoder starts pulling (a decoder slow to pull)."""
EXIT_S = 120.0


@dataclasses.dataclass
class Run:
    """What one signalled server did; times are wall clock (``time.time()``)."""

    arm: str
    delivery: str
    ok: list[bool] = dataclasses.field(default_factory=list)
    """Per stream: read to its end with every token and no error."""
    errors: list[str] = dataclasses.field(default_factory=list)
    signal_at: float = 0.0
    last_stream_end: float = 0.0
    gone: dict[str, float] = dataclasses.field(default_factory=dict)
    exit_code: int | None = None
    report: dict[str, object] | None = None
    error: str | None = None

    @property
    def lost(self) -> int:
        return self.ok.count(False)

    @property
    def exit_after_signal_s(self) -> float | None:
        main = self.gone.get("main")
        return None if main is None else round(main - self.signal_at, 3)

    @property
    def drained_at(self) -> float | None:
        """quiesce's drained moment: the signal plus its drain stage (the budget starts
        when the signal is handled); None for vLLM's own (it reports no drained moment)
        and for a drain that did not complete."""
        for stage in (self.report or {}).get("stages") or []:  # type: ignore[attr-defined]
            if stage.get("stage") == "drain" and stage.get("outcome") == "completed":
                return self.signal_at + float(stage["elapsed_s"])
        return None

    @property
    def engine_shutdown_s(self) -> float | None:
        """quiesce's engine-shutdown stage: vLLM's ``AsyncLLM.shutdown`` (EngineCore and
        its model runner ending), the bulk of the time from drained to exit."""
        for stage in (self.report or {}).get("stages") or []:  # type: ignore[attr-defined]
            if stage.get("stage") == "engine_shutdown":
                return float(stage["elapsed_s"])
        return None

    @property
    def exit_after_drained_s(self) -> float | None:
        main, drained = self.gone.get("main"), self.drained_at
        return None if main is None or drained is None else round(main - drained, 3)

    def to_dict(self) -> dict[str, object]:
        return {"arm": self.arm, "delivery": self.delivery, "streams": len(self.ok),
                "lost": self.lost, "exit_code": self.exit_code,
                "exit_after_signal_s": self.exit_after_signal_s,
                "exit_after_drained_s": self.exit_after_drained_s,
                "engine_shutdown_s": self.engine_shutdown_s,
                "exit_after_last_stream_s": (None if "main" not in self.gone else
                                             round(self.gone["main"] - self.last_stream_end, 3)),
                "outcome": (self.report or {}).get("outcome"), "errors": self.errors[:5],
                "error": self.error}


def _serve_options(arm: str) -> tuple[tuple[str, ...], str | None, bool]:
    """vLLM arguments, quiesce settings and whether the middleware is on, per arm."""
    if arm == "vllm_own":
        return ("--shutdown-timeout", str(OWN_SHUTDOWN_TIMEOUT_S)), None, False
    return (), QUIESCE_SETTINGS, True


def _watch(worker: Worker) -> ProcessWatch:
    pid = worker.process.pid
    watch = ProcessWatch({p: "main" if p == pid else f"{proc_name(p)}-{p}"
                          for p in worker_processes(pid)})
    watch.start()
    return watch


def _finish(run: Run, worker: Worker, watch: ProcessWatch) -> None:
    watch.wait(EXIT_S)
    run.gone = {watch.names[pid]: at for pid, at in watch.gone.items()}
    run.exit_code, _ = worker.finish(EXIT_S)
    exits = exit_events(worker.lines)
    run.report = exits[-1] if exits else None


async def aggregated(model: Path, arm: str, delivery: str) -> Run:
    """A fresh server of ``arm``, :data:`STREAMS` streams, ``delivery`` once every stream
    has its first token, every stream read to its end, every process watched until gone."""
    run = Run(arm, delivery)
    args, settings, middleware = _serve_options(arm)
    with vllm_serve(model, "--kv-transfer-config", paced(STEP_S), *args,
                    quiesce_args=settings, middleware=middleware) as worker:
        watch = _watch(worker)
        started = [asyncio.Event() for _ in range(STREAMS)]
        streams = [asyncio.create_task(stream_completion(
            worker.url, TOKENS, started=event, ignore_eos=True, prompt=f"stream {n} hello",
            timeout_s=90)) for n, event in enumerate(started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 90)
        run.signal_at = time.time()
        deliver(worker.process.pid, delivery)
        results: list[StreamResult] = list(await asyncio.gather(*streams))
        run.last_stream_end = time.time()
        run.ok = [r.complete for r in results]
        run.errors = [r.error for r in results if r.error is not None]
        await asyncio.to_thread(_finish, run, worker, watch)
    return run


async def prefill(model: Path, arm: str, delivery: str, decoder: Worker) -> Run:
    """A fresh prefill worker of ``arm`` paired with ``decoder``: :data:`PAIR_REQUESTS`
    prefills answered (KV held for the decoder), ``delivery``, the decoder pulls
    :data:`PULL_DELAY_S` later; every decode stream read to its end."""
    run = Run(arm, f"prefill_{delivery}")
    args, settings, _ = _serve_options(arm)
    face = "vllm_own" if arm == "vllm_own" else "vllm"
    quiesce_args = tuple((settings or "").split())
    with nixl_worker(model, "prefill", *quiesce_args, face=face, vllm_args=args) as worker:
        proxy = DisaggProxy(worker.url, decoder.url)
        pull = asyncio.Event()
        tasks = [asyncio.create_task(proxy.complete(completion(), hold=pull))
                 for _ in range(PAIR_REQUESTS)]
        deadline = time.monotonic() + 90
        while proxy.waiting_to_decode < PAIR_REQUESTS:
            failed = [t for t in tasks if t.done()]
            if failed:
                failed[0].result()  # a prefill that failed raises here
            if time.monotonic() > deadline:
                raise TimeoutError("prefills did not finish")
            await asyncio.sleep(0.02)
        watch = _watch(worker)
        run.signal_at = time.time()
        deliver(worker.process.pid, delivery)
        await asyncio.sleep(PULL_DELAY_S)
        pull.set()
        results: list[DecodeStream] = list(await asyncio.gather(*tasks))
        run.last_stream_end = time.time()
        run.ok = [r.complete and r.completion_tokens == completion()["max_tokens"]
                  for r in results]
        run.errors = [r.error for r in results if r.error is not None]
        await asyncio.to_thread(_finish, run, worker, watch)
    return run
