"""TensorRT-LLM probes: pending work of the executor that owns the engine, per layout.

Which probe :func:`probe_for_llm` builds depends on where TensorRT-LLM put the
``PyExecutor`` (``type(llm._executor).__name__``, compared by name):

- ``GenerationExecutorWorker`` — the **in-process** (single-process) worker, chosen by
  TensorRT-LLM when ``TLLM_WORKER_USE_SINGLE_PROCESS=1`` (TP=1), as Dynamo and
  ``quiesce serve --engine trtllm`` run it. :class:`InProcessProbe` reads
  ``llm._executor.engine`` directly, on the event loop, in microseconds
  (:mod:`.executor_reader`), in flow order. Authoritative: request queue + requests
  parked behind a control sentinel + control actions in flight + waiting + active +
  context requests in transfer; a zero counts only once confirmed across an executor
  iteration (:class:`~.zero_confirmation.ZeroConfirmation`). Missing attributes, or a
  KV connector on the older (``ctx_in_transmission_requests``) layout → UNKNOWN.
- ``RayExecutor`` — the **Ray** orchestrator. :class:`RayProbe` runs the same reading in
  every Ray worker through :mod:`.ray_extension` (``llm._collective_rpc``, a prototype
  API of TensorRT-LLM, run on a daemon thread of its own, at most one at a time) and
  ANDs the ranks; fewer answers than ranks → UNKNOWN. Costs a Ray round trip.
- ``GenerationExecutorProxy`` / ``GenerationExecutorRpcProxy`` — the **multi-process**
  default (MPI workers, even for TP=1). The owner cannot reach the ``PyExecutor``;
  :class:`ProxyStatsProbe` reads the proxy's unfinished results (``_results``, a ``len()``)
  and, only when that is zero, one record of the iteration statistics stream
  (``llm.get_stats_async``). A **weak** signal, labelled so
  (``details["confidence"] = "low"``): statistics stop while the loop is idle, are
  consumed by whoever reads them first (so the probe takes as few as it can), need
  ``enable_iter_perf_stats``, and never count context requests whose KV is in transfer
  — so a **prefill** snapshot is always UNKNOWN on this path, and so is any snapshot
  with a KV connector configured (its saves are invisible here).
- anything else (another executor class, no ``_executor``): :class:`UnknownLayoutProbe`,
  always UNKNOWN with the reason.

Every probe fails closed (missing attribute, drifted layout, exception, timeout →
``PendingWork.unknown`` with an operator-readable reason) and never mutates the engine.

Methods (all called by the drain or the status page, through
:func:`quiesce.probe.observe`, which bounds each call and turns a raise or a hang into
UNKNOWN):

- ``InProcessProbe.pending_work()`` — runs in the worker's process, on its event loop;
  reads ``llm._executor.engine`` there (the executor loop is a thread of the same
  process). Cost: a few microseconds, no lock, no round trip; when it reads zero and the
  zero is not confirmed yet, one awaited wait of
  :data:`~.zero_confirmation.CONFIRM_WAIT_S` (2 ms) and a second reading; still
  unconfirmed → UNKNOWN until a later read confirms it. Missing: ``_executor``,
  ``engine`` (None after shutdown) or any counted attribute → UNKNOWN naming it.
- ``RayProbe.pending_work()`` — runs in the worker's process; the blocking
  ``llm._collective_rpc(METHOD)`` goes to a daemon thread of the probe's own (never the
  default executor, which ``shutdown`` needs), with at most one call outstanding: while
  one hangs, every read answers UNKNOWN at once saying so, and nothing waits on that
  thread. The reading itself runs in every Ray worker process (:mod:`.ray_extension`).
  Cost: one Ray round trip (milliseconds).
  Missing: the extension (the RPC fails; the reason says to pass
  ``ray_worker_extension_cls``), the world size, or any rank's answer → UNKNOWN.
- ``ProxyStatsProbe.pending_work()`` — runs in the worker's process; reads the proxy's
  ``_results`` (a ``len()``) and, only when that is zero, takes at most
  ``stats_per_read`` (default 1) records of the statistics queue that TensorRT-LLM's
  proxy fills from the MPI worker (each wait bounded by ``stats_poll_s``). Cost: up to
  ``stats_poll_s`` when no statistic is new. Missing: ``_results`` or ``llm.args`` →
  UNKNOWN; no new statistic → the results count alone (the loop emits none while idle);
  always UNKNOWN for prefill and with a KV connector (``kv_connector_config``).
- ``UnknownLayoutProbe.pending_work()`` — no read at all: UNKNOWN with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import threading
import time
from typing import Any, Final

from quiesce.errors import ConfigError, EngineNotInstalled
from quiesce.probe import UNKNOWN, Count, PendingWork, Probe, Role

from .executor_reader import to_pending_work
from .ray_extension import EXTENSION, METHOD
from .zero_confirmation import ZeroConfirmation, read_confirmed

DISTRIBUTION: Final = "tensorrt_llm"
IN_PROCESS_SOURCE: Final = "trtllm.py_executor"
RAY_SOURCE: Final = "trtllm.ray_workers"
PROXY_SOURCE: Final = "trtllm.proxy_stats"
IN_PROCESS_EXECUTORS: Final = frozenset({"GenerationExecutorWorker"})
RAY_EXECUTORS: Final = frozenset({"RayExecutor"})
PROXY_EXECUTORS: Final = frozenset({"GenerationExecutorProxy", "GenerationExecutorRpcProxy"})
MAX_STATS_PER_READ: Final = 256
"""The most iteration statistics one proxy read may take (``stats_per_read``)."""


def installed_trtllm_version() -> str | None:
    """The installed TensorRT-LLM distribution's version, or None (nothing is imported)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


class InProcessProbe(Probe):
    """The ``PyExecutor`` in this process: ``llm._executor.engine``, resolved on every read
    (it is gone after shutdown), or a ``PyExecutor`` given directly (``executor=``)."""

    def __init__(self, llm: Any, role: Role | str = Role.AGGREGATED, *,
                 executor: Any = None) -> None:
        super().__init__(role, IN_PROCESS_SOURCE)
        self.llm = llm
        self._executor = executor
        self._confirm = ZeroConfirmation()
        self._confirming: int | None = None  # id() of the executor the state belongs to

    def _py_executor(self) -> Any:
        if self._executor is not None:
            return self._executor
        engine = self.llm._executor.engine
        if engine is None:
            raise LookupError("the single-process worker holds no PyExecutor (shut down)")
        return engine

    async def pending_work(self) -> PendingWork:
        try:
            executor = self._py_executor()
        except Exception as exc:
            return PendingWork.unknown(self.role, self.source,
                                       f"cannot reach the PyExecutor (llm._executor.engine): "
                                       f"{type(exc).__name__}: {exc}")
        if id(executor) != self._confirming:
            self._confirm, self._confirming = ZeroConfirmation(), id(executor)
        reading = await read_confirmed(executor, self._confirm)
        return to_pending_work(self.role, self.source, [reading])


def _world_size(llm: Any) -> int | None:
    """How many ranks the Ray executor runs; None where the arguments cannot be read."""
    args = getattr(llm, "args", None)
    parallel = getattr(args, "parallel_config", None)
    size = getattr(parallel, "world_size", None)
    if isinstance(size, int) and size >= 1:
        return size
    tp = getattr(args, "tensor_parallel_size", None)
    pp = getattr(args, "pipeline_parallel_size", 1)
    if isinstance(tp, int) and isinstance(pp, int) and tp >= 1 and pp >= 1:
        return tp * pp
    return None


class RayProbe(Probe):
    """Every Ray worker's ``PyExecutor``, read in that worker (:mod:`.ray_extension`).

    ``ranks``: how many answers to expect (default: the LLM's world size). Ranks add up
    with attention DP (``llm.args.enable_attention_dp``), else the largest count is taken.
    """

    def __init__(self, llm: Any, role: Role | str = Role.AGGREGATED, *,
                 ranks: int | None = None) -> None:
        super().__init__(role, RAY_SOURCE)
        if ranks is not None and (isinstance(ranks, bool) or ranks < 1):
            raise ConfigError("ranks", f"must be a positive int, got {ranks!r}")
        self.llm = llm
        self.ranks = ranks
        self._reading_since: float | None = None
        """When the read now outstanding started (None: none is)."""

    def _start_read(self) -> asyncio.Future[Any]:
        """Run the blocking ``llm._collective_rpc(METHOD)`` on a thread of its own (a
        daemon: a hung Ray call never holds up the default executor, the worker's
        shutdown or the interpreter's exit); the returned future settles on the loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(answer: Any, error: BaseException | None) -> None:
            if future.done():  # the caller stopped waiting (observe's timeout)
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(answer)

        def run() -> None:
            answer: Any = None
            error: BaseException | None = None
            try:
                answer = self.llm._collective_rpc(METHOD)
            except BaseException as exc:  # handed to the loop, never lost on this thread
                error = exc
            finally:
                self._reading_since = None
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits now
                loop.call_soon_threadsafe(settle, answer, error)

        self._reading_since = time.monotonic()
        threading.Thread(target=run, name="quiesce-trtllm-ray-read", daemon=True).start()
        return future

    async def pending_work(self) -> PendingWork:
        expected = self.ranks or _world_size(self.llm)
        if expected is None:
            return PendingWork.unknown(self.role, self.source, "cannot read how many Ray "
                                       "ranks there are (llm.args.parallel_config)")
        since = self._reading_since
        if since is not None:  # at most one read outstanding: a hung one is not stacked
            return PendingWork.unknown(
                self.role, self.source,
                f"the previous Ray read ({METHOD}) has not returned after "
                f"{time.monotonic() - since:.1f}s (Ray workers not answering); no other "
                f"read is started while it is outstanding")
        try:  # observe() bounds how long we wait; the read's thread is ours alone
            answers = await self._start_read()
        except Exception as exc:
            hint = (f" (was the LLM built with ray_worker_extension_cls={EXTENSION!r}?)"
                    if METHOD in str(exc) else "")
            return PendingWork.unknown(self.role, self.source, f"the Ray workers did not "
                                       f"answer {METHOD}: {type(exc).__name__}: {exc}{hint}")
        if not isinstance(answers, (list, tuple)):
            return PendingWork.unknown(self.role, self.source,
                                       f"collective RPC answered {type(answers).__name__}")
        if len(answers) < expected:
            return PendingWork.unknown(self.role, self.source,
                                       f"only {len(answers)} of {expected} Ray ranks answered")
        adp = getattr(getattr(self.llm, "args", None), "enable_attention_dp", False) is True
        return to_pending_work(self.role, self.source, list(answers), sum_ranks=adp)


def _stat_dict(item: object) -> dict[str, Any] | None:
    """One iteration-statistics record as a dict (TensorRT-LLM hands out dicts or JSON)."""
    if isinstance(item, str):
        try:
            item = json.loads(item)
        except ValueError:
            return None
    return item if isinstance(item, dict) else None


def _stat_count(stat: dict[str, Any], key: str) -> int | None:
    value = stat.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


class ProxyStatsProbe(Probe):
    """The weak path of the multi-process default (see the module docstring).

    ``running`` is the proxy's unfinished results: every request this worker's executor
    holds (queued, waiting, active, awaiting KV) has one until its final response, so it
    counts all of them; ``waiting`` and ``kv_recvs_awaited`` are counted in it.
    ``kv_sends_held`` is unknowable here.

    The iteration statistics are a queue shared with every other reader of
    ``get_stats_async`` (Dynamo's metrics, for one): each record read here is taken from
    them. So they are read only when they could change the verdict, i.e. when the
    proxy holds no unfinished result, and at most ``stats_per_read`` records per read
    (default 1, the newest available; 0 never reads them), each wait bounded by
    ``stats_poll_s``. A statistic read can only raise the counts.

    With a KV connector (``llm.args.kv_connector_config`` set), connector saves run after
    a request's result finished and neither the results nor the statistics count them:
    always UNKNOWN, with that reason (fail closed).
    """

    def __init__(self, llm: Any, role: Role | str = Role.AGGREGATED, *,
                 stats_poll_s: float = 0.05, stats_per_read: int = 1) -> None:
        super().__init__(role, PROXY_SOURCE)
        if stats_poll_s <= 0:
            raise ConfigError("stats_poll_s", f"must be positive, got {stats_poll_s!r}")
        if isinstance(stats_per_read, bool) or not 0 <= stats_per_read <= MAX_STATS_PER_READ:
            raise ConfigError("stats_per_read", f"must be in [0, {MAX_STATS_PER_READ}], "
                                                f"got {stats_per_read!r}")
        self.llm = llm
        self.stats_poll_s = stats_poll_s
        self.stats_per_read = stats_per_read

    async def _newest_stat(self) -> tuple[dict[str, Any] | None, str | None]:
        """The newest of up to ``stats_per_read`` statistics available now, and why none
        could be read (or None)."""
        try:
            stream = self.llm.get_stats_async(timeout=self.stats_poll_s)
            iterator = stream.__aiter__()
        except Exception as exc:
            return None, f"get_stats_async failed: {type(exc).__name__}: {exc}"
        newest = None
        for _ in range(self.stats_per_read):
            try:
                item = await asyncio.wait_for(iterator.__anext__(), self.stats_poll_s)
            except (StopAsyncIteration, asyncio.TimeoutError, TimeoutError):
                break
            except Exception as exc:
                return newest, f"get_stats_async raised {type(exc).__name__}: {exc}"
            newest = _stat_dict(item) or newest
        return newest, None

    def _kv_connector(self) -> str | None:
        """Why a configured KV connector makes this path blind, or None."""
        args = getattr(self.llm, "args", None)
        if args is None:
            return "cannot read llm.args to tell whether a KV connector is configured"
        if getattr(args, "kv_connector_config", None) is not None:
            return ("a KV connector is configured (llm.args.kv_connector_config): its saves "
                    "in flight outlive the requests' results and the iteration statistics "
                    "do not count them, so this layout cannot tell when they are done")
        return None

    async def pending_work(self) -> PendingWork:
        try:
            unfinished = len(self.llm._executor._results)
        except Exception as exc:
            return PendingWork.unknown(self.role, self.source,
                                       f"cannot read the proxy's unfinished results "
                                       f"(llm._executor._results): {type(exc).__name__}: {exc}")
        stat, problem = None, None
        if unfinished == 0 and self.stats_per_read:  # only when it could change the verdict
            stat, problem = await self._newest_stat()
        running: Count = unfinished
        waiting: Count = 0
        details: dict[str, str | int | bool] = {
            "confidence": "low", "signal": "proxy results + iteration stats",
            "counted_in_running": "queued, waiting and KV-awaiting requests"}
        if stat is not None:
            active = _stat_count(stat, "numActiveRequests")
            queued = _stat_count(stat, "numQueuedRequests")
            running = max(unfinished, active) if active is not None else UNKNOWN
            waiting = queued if queued is not None else UNKNOWN
            details["stats_iter"] = str(stat.get("iter", "?"))
        errors: list[str] = [problem] if problem else []
        connector = self._kv_connector()
        if connector is not None:
            errors.append(connector)
        if self.role is Role.PREFILL:
            errors.append("the multi-process (proxy) layout cannot see context requests "
                          "whose KV is in transfer: the iteration statistics do not count "
                          "them; run the single-process worker or Ray for a prefill worker")
        if running is UNKNOWN or waiting is UNKNOWN:
            errors.append(f"iteration statistic without counts: {stat!r}")
        return PendingWork(role=self.role, source=self.source, waiting=waiting,
                           running=running, kv_recvs_awaited=0, errors=tuple(errors),
                           details=details)


class UnknownLayoutProbe(Probe):
    """A layout this adapter does not know: always UNKNOWN, with the reason."""

    def __init__(self, role: Role | str, reason: str) -> None:
        super().__init__(role, "trtllm")
        self.reason = reason

    async def pending_work(self) -> PendingWork:
        return PendingWork.unknown(self.role, self.source, self.reason)


def probe_for_llm(llm: Any, role: Role | str = Role.AGGREGATED, **options: Any) -> Probe:
    """The probe for this ``LLM``'s layout (module docstring); never raises for drift.

    ``llm`` may also be a ``PyExecutor`` itself (it has ``active_requests``): the
    in-process probe then reads it directly. ``options`` go to the chosen probe
    (``ranks`` for Ray, ``stats_poll_s`` for the proxy).
    """
    if hasattr(llm, "active_requests") and not hasattr(llm, "_executor"):
        return InProcessProbe(None, role, executor=llm)
    executor = getattr(llm, "_executor", None)
    if executor is None:
        return UnknownLayoutProbe(role, "the LLM has no executor (llm._executor is unset: "
                                        "not built, or shut down)")
    kind = type(executor).__name__
    if kind in IN_PROCESS_EXECUTORS:
        return InProcessProbe(llm, role)
    if kind in RAY_EXECUTORS:
        return RayProbe(llm, role, **options)
    if kind in PROXY_EXECUTORS:
        return ProxyStatsProbe(llm, role, **options)
    known = sorted(IN_PROCESS_EXECUTORS | RAY_EXECUTORS | PROXY_EXECUTORS)
    return UnknownLayoutProbe(role, f"unknown TensorRT-LLM executor {kind!r}; known: {known}")


def probe_factory(engine: object, *, role: Role | str = Role.AGGREGATED,
                  **options: Any) -> Probe:
    """Registry entry point ``trtllm``: :func:`probe_for_llm` for a ``tensorrt_llm.LLM``."""
    if installed_trtllm_version() is None:
        raise EngineNotInstalled("trtllm", "tensorrt_llm", "trtllm")
    return probe_for_llm(engine, role, **options)
