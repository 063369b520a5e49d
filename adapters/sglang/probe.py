"""The SGLang probe: pending work of an SGLang worker, every signal ANDed.

A backend holds SGLang's ``Engine`` (or just its ``TokenizerManager``) in its main
process; roles aggregated, prefill and decode; every data-parallel rank. Signals, where
each is read, its cost, and what its absence means:

- **scheduler** (:mod:`.scheduler_rpc`, the strongest): each DP leader's own
  ``Scheduler.is_fully_idle()`` with its default arguments plus the queues it does not
  cover, exported by quiesce's plugin hook and asked with ``get_internal_state``; one
  round trip, bounded by ``scheduler_timeout_s``. Needs quiesce's ``sglang.srt.plugins``
  entry point loaded in the scheduler processes. Missing state, a short rank list, a
  timeout → UNKNOWN.
- **requests** (:func:`.frontend.read_requests`, main process, no RPC):
  ``len(tokenizer_manager.rid_to_state)``; on prefill non-empty until the KV transfer
  finished. Read first: a request on its way to the scheduler is seen here only.
- **load snapshot** (:func:`.frontend.read_load_snapshot`, main process, no RPC, 0.5.21+):
  the shared-memory per-rank counts; all ranks present, fresh, disaggregation section
  present. Used when the TokenizerManager has a ``load_snapshot_reader`` (or when asked
  for with ``snapshot=True``, which makes its absence UNKNOWN).

The parts are combined with :meth:`PendingWork.merge`: quiescent only when every part
knows and agrees. ``scheduler=False`` drops the strongest signal (for an SGLang without
quiesce's plugin); the remaining two miss the decode side's deferred KV releases and
HiCache operations, which the status then cannot show: use it knowingly. ``rid_to_state``
alone never proves quiescence (it counts requests, not the counters a role needs): without
the scheduler the load snapshot must be there too.

Layout (:mod:`.topology`, resolved by SGLang's own resolver): the DP ranks expected are
``dp_size * attn_dp_size`` (every attention-DP group leader answers and publishes); a
prefill or decode worker with ``pp_size > 1`` is UNKNOWN (only pipeline stage 0 answers,
a later stage can still owe decode its KV). Answers are keyed by the DP rank each names.

What the probe never does, and why:

- never pauses the engine (``pause_generation``): in mode ``abort`` it aborts every
  request, and in ``in_place``/``retract`` a prefill scheduler skips
  ``process_disagg_prefill_inflight_queue``, so a finished KV transfer is never observed
  and the drain never converges (0.5.23, the prefill event loops ``continue`` while
  ``_engine_paused``); a paused scheduler also stops publishing the load snapshot;
- never uses ``is_fully_idle(for_health_check=True)`` (skips the grammar queue and every
  disaggregation queue: a prefill worker with KV in flight reads idle) nor
  ``ignore_waiting=True`` (ignores waiting requests that hold no KV);
- never polls a KV sender or receiver (a poll advances their state machines).

Versions outside :data:`TESTED_VERSIONS` still answer, but UNKNOWN with the reason,
unless the operator passed ``allow_untested_version=True`` (after checking the release:
:func:`accept_untested`). A release in :data:`UNSUPPORTED_VERSIONS` was checked against
its source and does not fit the adapter: UNKNOWN, allowed or not.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from quiesce.errors import ConfigError, EngineNotInstalled
from quiesce.probe import PendingWork, Probe, Role

from .frontend import (
    DEFAULT_SNAPSHOT_MAX_AGE_S,
    REQUESTS_SOURCE,
    SNAPSHOT_SOURCE,
    main_process_work,
    read_requests,
)
from .idle_fingerprint import (
    REFUSED_IDLE_FINGERPRINTS,
    accepted_fingerprints,
    installed_idle_fingerprint,
)
from .scheduler_rpc import DEFAULT_SCHEDULER_TIMEOUT_S, SCHEDULER_SOURCE, SchedulerStateReader
from .topology import dp_ranks_of, topology_problem

TESTED_VERSIONS = ("0.5.23",)
"""SGLang releases this adapter was contract-tested against (tests/integration/sglang)."""
UNSUPPORTED_VERSIONS: dict[str, str] = {
    "0.5.21": "checked against its source, not run: its scheduler lacks what the adapter "
              "reads (Scheduler._deferred_input_requests; on prefill the KV manager's "
              "defer_decode_allocation and _deferred_ack_poisoned_rooms; on decode "
              "num_pending_deferred_releases), so every scheduler read is UNKNOWN; and its "
              "is_fully_idle (fingerprint 3b00b244f84bc11a) does not count decode's "
              "deferred KV releases (docs/sglang.md, \"Other SGLang releases\")",
}
"""SGLang releases checked against their source and found not to fit this adapter:
release → why. UNKNOWN even with ``allow_untested_version``; never accepted."""
ACCEPT_FIELD = "accept_untested_engine"
VERSION_SOURCE = "sglang.version"
TOPOLOGY_SOURCE = "sglang.topology"


def installed_sglang_version() -> str | None:
    """The installed SGLang distribution's version, or None."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_problem(version: str | None) -> str | None:
    """Why ``version`` is not one this adapter was tested on, or None if it is."""
    if version is None:
        return "SGLang is not installed in this environment"
    unsupported = UNSUPPORTED_VERSIONS.get(version.split("+")[0])
    if unsupported is not None:
        return f"SGLang {version} does not fit this adapter: {unsupported}"
    if version.split("+")[0] not in TESTED_VERSIONS:
        return (f"SGLang {version} is outside the versions this adapter was tested on "
                f"({', '.join(TESTED_VERSIONS)}); pass allow_untested_version=True "
                "(quiesce dynamo sglang: --accept-untested-engine VERSION) after checking it")
    return None


def accept_untested(accepted: str, installed: str | None) -> str:
    """An operator's explicit acceptance of the installed SGLang, a release this adapter
    was not tested on (``quiesce dynamo sglang --accept-untested-engine VERSION``): the
    warning to show wherever the worker reports. :class:`ConfigError` (before anything
    starts) unless ``accepted`` names exactly the installed release, and that release is
    neither tested (nothing to accept) nor in :data:`UNSUPPORTED_VERSIONS`.

    The probe then takes ``allow_untested_version=True`` and the installed release's own
    ``is_fully_idle`` fingerprint (:func:`.idle_fingerprint.installed_idle_fingerprint`).
    """
    if installed is None:
        raise ConfigError(ACCEPT_FIELD, "SGLang is not installed in this environment")
    release = installed.split("+")[0]
    if accepted.strip() not in (installed, release):
        raise ConfigError(ACCEPT_FIELD, f"names SGLang {accepted!r}, but SGLang {installed} "
                          "is installed: name the release you checked")
    if release in TESTED_VERSIONS:
        raise ConfigError(ACCEPT_FIELD, f"SGLang {installed} is a tested release: drop "
                          "the option")
    if release in UNSUPPORTED_VERSIONS:
        raise ConfigError(ACCEPT_FIELD, f"SGLang {installed} cannot be accepted: "
                          f"{UNSUPPORTED_VERSIONS[release]}")
    return (f"UNTESTED ENGINE: SGLang {installed} is not a release quiesce's SGLang adapter "
            f"was tested on ({', '.join(TESTED_VERSIONS)}); accepted by the operator "
            f"(--accept-untested-engine {accepted.strip()}): a `drained` verdict trusts "
            "this release's is_fully_idle and scheduler unchecked")


def untested_fingerprints() -> tuple[tuple[str, ...], str]:
    """After :func:`accept_untested`: the installed release's own ``is_fully_idle``
    fingerprint to accept (none if it cannot be read, or is a refused one: the scheduler's
    answers then stay UNKNOWN, naming it) and a line saying which, for the log and status.
    Call where SGLang is loaded (:func:`.idle_fingerprint.installed_idle_fingerprint`)."""
    try:
        fingerprint = installed_idle_fingerprint()
    except Exception as exc:
        return (), (f"the installed SGLang's Scheduler.is_fully_idle cannot be fingerprinted "
                    f"({type(exc).__name__}: {exc}): the scheduler's answers stay UNKNOWN")
    if fingerprint in REFUSED_IDLE_FINGERPRINTS.values():
        return (), (f"the installed SGLang's Scheduler.is_fully_idle (fingerprint "
                    f"{fingerprint}) is one quiesce refuses: the scheduler's answers stay "
                    "UNKNOWN")
    return (fingerprint,), (f"UNTESTED ENGINE: Scheduler.is_fully_idle fingerprint "
                            f"{fingerprint} accepted unreviewed (the installed release's)")


def tokenizer_manager_of(engine: Any) -> Any:
    """The ``TokenizerManager`` of an ``Engine``, or ``engine`` itself if it is one."""
    manager = getattr(engine, "tokenizer_manager", None)
    return manager if manager is not None else engine


class SglangProbe(Probe):
    """Pending work of an SGLang worker. See the module docstring for the signals.

    ``snapshot``: None reads the load snapshot where the TokenizerManager has one;
    True requires it; False skips it. Timeouts and ages must be positive
    (:class:`ConfigError` otherwise, before anything is read). ``idle_fingerprints``:
    fingerprints of ``Scheduler.is_fully_idle`` to accept besides the tested ones
    (:mod:`.idle_fingerprint`; the UNKNOWN reason names the one a scheduler runs).
    The layout (DP ranks, pipeline stages: :mod:`.topology`) is read once, here.
    """

    def __init__(self, engine: Any, role: Role | str = Role.AGGREGATED, *,
                 scheduler: bool = True, snapshot: bool | None = None,
                 scheduler_timeout_s: float = DEFAULT_SCHEDULER_TIMEOUT_S,
                 snapshot_max_age_s: float = DEFAULT_SNAPSHOT_MAX_AGE_S,
                 allow_untested_version: bool = False,
                 idle_fingerprints: tuple[str, ...] = ()) -> None:
        for field, value in (("scheduler_timeout_s", scheduler_timeout_s),
                             ("snapshot_max_age_s", snapshot_max_age_s)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(field, f"must be a positive number of seconds, got {value!r}")
        if engine is None:
            raise ConfigError("engine", "an SGLang Engine or TokenizerManager is required")
        parts = [REQUESTS_SOURCE] + ([SCHEDULER_SOURCE] if scheduler else []) \
            + ([SNAPSHOT_SOURCE] if snapshot is not False else [])
        super().__init__(role, "+".join(parts))
        self.engine = engine
        self.tokenizer_manager = tokenizer_manager_of(engine)
        self._snapshot = snapshot
        self.snapshot_max_age_s = float(snapshot_max_age_s)
        fingerprints = accepted_fingerprints(tuple(idle_fingerprints))
        self.scheduler = (SchedulerStateReader(self.tokenizer_manager, scheduler_timeout_s,
                                               fingerprints=fingerprints)
                          if scheduler else None)
        self.dp_ranks = dp_ranks_of(self.tokenizer_manager)
        self._topology_problem = topology_problem(self.tokenizer_manager, self.role)
        self.version = installed_sglang_version()
        self._version_problem = version_problem(self.version)
        if allow_untested_version and (self.version is None or self.version.split("+")[0]
                                       not in UNSUPPORTED_VERSIONS):
            self._version_problem = None

    def main_process_work(self) -> PendingWork:
        """The signals read without a round trip (requests, load snapshot), merged; with
        the layout's problem, if any (UNKNOWN).

        Synchronous and cheap (µs): what the benchmark measures as the main-process path.
        """
        manager = self.tokenizer_manager
        has_reader = getattr(manager, "load_snapshot_reader", None) is not None
        if self._snapshot is False or (self._snapshot is None and not has_reader):
            work = read_requests(manager, self.role)
        else:
            work = main_process_work(manager, self.role, expected_ranks=self.dp_ranks,
                                     max_age_s=self.snapshot_max_age_s)
        if self._topology_problem is None:
            return work
        return PendingWork.merge(self.role, [work, PendingWork.unknown(
            self.role, TOPOLOGY_SOURCE, self._topology_problem)])

    async def pending_work(self) -> PendingWork:
        # main process first: a request on its way to the scheduler is seen only there
        parts = [self.main_process_work()]
        if self.scheduler is not None:
            parts.append(await self.scheduler.read(self.role, self.dp_ranks))
        if self._version_problem is not None:
            parts.append(PendingWork.unknown(self.role, VERSION_SOURCE, self._version_problem))
        return parts[0] if len(parts) == 1 else PendingWork.merge(self.role, parts)


def probe_factory(engine: object, *, role: Role | str = Role.AGGREGATED,
                  **options: Any) -> SglangProbe:
    """Registry entry point ``sglang``: a :class:`SglangProbe` for an SGLang ``Engine``."""
    if installed_sglang_version() is None:
        raise EngineNotInstalled("sglang", "sglang", "sglang")
    return SglangProbe(engine, role, **options)
