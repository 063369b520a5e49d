"""The probe contract: does this worker still owe any work?

A probe answers with a :class:`PendingWork` snapshot. Every adapter (vLLM, SGLang,
TensorRT-LLM, the simulator) implements the same small protocol, so the drain, the
lifecycle and the admin API never know which engine they talk to.

Methods of :class:`QuiescenceProbe`, all run on the worker's event loop:

- ``pending_work()`` reads the engine's strongest signal and returns a snapshot.
  It must be side-effect free (no call that reaps a transfer, no pause of the
  engine), must not block the loop for more than a few microseconds, and may await
  a cross-process call. On any failure it should return ``PendingWork.unknown(...)``
  with a reason; if it raises or hangs anyway, :func:`observe` turns that into an
  unknown snapshot, so a broken probe can never make a worker look idle.
- ``is_quiescent()`` is true only when ``pending_work()`` is known and zero.
- ``role`` and ``source`` name what the probe is for and which signal it reads.

Optionally a probe also implements :class:`ChangeNotifier`: ``wait_for_change(after,
timeout)`` returns as soon as the engine's state may differ from the snapshot
``after`` (or at ``timeout``). The drain then wakes on events instead of polling;
a probe without it is polled with a short doubling backoff.

Fail-closed rules, applied by :attr:`PendingWork.verdict`:

- any known positive counter, or the engine's own verdict "has work" → BUSY;
- otherwise any error, any counter the role requires that is unknown, or any
  engine-specific queue that is unknown → UNKNOWN;
- otherwise QUIESCENT.

A prefill snapshot that cannot see KV sends is therefore UNKNOWN, never quiescent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Coroutine, Iterable, Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any, Final, Protocol, TypeVar, Union, runtime_checkable

from quiesce.errors import ConfigError
from quiesce.eta import DrainEta


class Role(str, Enum):
    """What a worker does in the serving topology; decides which counters must be known."""

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def parse(cls, value: Role | str, field: str = "role") -> Role:
        """Return the role for ``value`` or raise :class:`ConfigError` naming ``field``."""
        if isinstance(value, Role):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            allowed = ", ".join(r.value for r in cls)
            raise ConfigError(field, f"unknown role {value!r}; expected one of {allowed}") from None


class _Unknown:
    """The value of a counter that could not be read. Has no truth value on purpose."""

    _instance: _Unknown | None = None

    def __new__(cls) -> _Unknown:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNKNOWN"

    def __bool__(self) -> bool:
        raise TypeError("UNKNOWN has no truth value: compare with `is UNKNOWN` (fail closed)")

    def __reduce__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = _Unknown()
Count = Union[int, _Unknown]  # noqa: UP007 (a runtime alias; `|` needs 3.10 objects on both sides)


class Verdict(str, Enum):
    QUIESCENT = "quiescent"
    BUSY = "busy"
    UNKNOWN = "unknown"


COUNTERS: Final = ("waiting", "running", "kv_sends_held", "kv_recvs_awaited")
"""The counters every snapshot carries, in display order."""

REQUIRED_COUNTERS: Final[Mapping[Role, tuple[str, ...]]] = MappingProxyType(
    {
        Role.AGGREGATED: ("waiting", "running"),
        Role.PREFILL: ("waiting", "running", "kv_sends_held"),
        Role.DECODE: ("waiting", "running", "kv_recvs_awaited"),
    }
)
"""Counters that must be known for a snapshot of this role to be quiescent."""

Detail = Union[str, int, float, bool]  # noqa: UP007


def _check_count(name: str, value: object) -> None:
    if value is UNKNOWN:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(name, f"a count must be a non-negative int or UNKNOWN, got {value!r}")


@dataclasses.dataclass(frozen=True)
class PendingWork:
    """An immutable snapshot of the work a worker still owes, as one signal sees it.

    Counters are a known ``int`` or :data:`UNKNOWN`. ``queues`` holds engine-specific
    work queues by name (grammar, chunked prefill, offload); they count like the
    main counters. ``engine_has_work`` is the engine's own combined verdict where it
    has one (``None`` where it has none). ``errors`` says why something could not be
    read; any error makes the snapshot UNKNOWN unless it is already BUSY.
    ``details`` is informational only and never changes the verdict, and so is
    ``eta`` (:mod:`quiesce.eta`: how long the work will take, where the probe can
    estimate it; ``None`` where it cannot).
    """

    role: Role
    source: str
    waiting: Count = UNKNOWN
    running: Count = UNKNOWN
    kv_sends_held: Count = UNKNOWN
    kv_recvs_awaited: Count = UNKNOWN
    queues: Mapping[str, Count] = dataclasses.field(default_factory=dict)
    engine_has_work: bool | None = None
    errors: tuple[str, ...] = ()
    details: Mapping[str, Detail] = dataclasses.field(default_factory=dict)
    observed_at: float = dataclasses.field(default_factory=time.monotonic)
    parts: tuple[PendingWork, ...] = ()
    eta: DrainEta | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise ConfigError("role", f"expected a Role, got {self.role!r}")
        for name in COUNTERS:
            _check_count(name, getattr(self, name))
        for name, value in self.queues.items():
            _check_count(f"queues[{name!r}]", value)
        object.__setattr__(self, "queues", MappingProxyType(dict(self.queues)))
        object.__setattr__(self, "details", MappingProxyType(dict(self.details)))
        object.__setattr__(self, "errors", tuple(self.errors))

    # -- constructors -------------------------------------------------------------

    @classmethod
    def unknown(cls, role: Role, source: str, reason: str) -> PendingWork:
        """A snapshot that knows nothing, with the reason an operator will read."""
        return cls(role=role, source=source, errors=(reason,))

    @classmethod
    def idle(cls, role: Role, source: str) -> PendingWork:
        """A snapshot in which every counter is known to be zero."""
        return cls(role=role, source=source, waiting=0, running=0, kv_sends_held=0,
                   kv_recvs_awaited=0, engine_has_work=False)

    # -- derived ------------------------------------------------------------------

    def counts(self) -> dict[str, Count]:
        """Every counter and engine queue by name."""
        out: dict[str, Count] = {name: getattr(self, name) for name in COUNTERS}
        out.update(self.queues)
        return out

    @property
    def verdict(self) -> Verdict:
        counts = self.counts()
        if self.engine_has_work is True or any(
            c is not UNKNOWN and c > 0 for c in counts.values()  # type: ignore[operator]
        ):
            return Verdict.BUSY
        if self.reasons:
            return Verdict.UNKNOWN
        return Verdict.QUIESCENT

    @property
    def is_quiescent(self) -> bool:
        return self.verdict is Verdict.QUIESCENT

    @property
    def reasons(self) -> tuple[str, ...]:
        """Why this snapshot is not known: read errors, then counters the role needs but lacks."""
        missing = [
            name for name in REQUIRED_COUNTERS[self.role] if getattr(self, name) is UNKNOWN
        ] + [name for name, value in self.queues.items() if value is UNKNOWN]
        if not missing:
            return self.errors
        return (*self.errors,
                f"{self.source} does not report {', '.join(missing)}, "
                f"which a {self.role.value} worker must know to be quiescent")

    @property
    def total(self) -> int | None:
        """Sum of all counters, or ``None`` when any counter is unknown."""
        values = list(self.counts().values())
        if any(v is UNKNOWN for v in values):
            return None
        return sum(v for v in values if isinstance(v, int))

    def same_work(self, other: PendingWork | None) -> bool:
        """Whether ``other`` reports the same work (ignoring when it was observed and its
        ETA, which moves at every engine step: a drain waits for the work to change)."""
        return (other is not None and self.counts() == other.counts()
                and self.engine_has_work == other.engine_has_work and self.errors == other.errors)

    def summary(self) -> str:
        """One line for logs: verdict, the counters that are not zero, and reasons."""
        shown = ", ".join(f"{k}={v!r}" for k, v in self.counts().items()
                          if v is UNKNOWN or v != 0)
        text = f"{self.verdict.value} [{self.source}]" + (f" {shown}" if shown else "")
        if self.engine_has_work is not None:
            text += f" engine_has_work={self.engine_has_work}"
        if self.verdict is Verdict.UNKNOWN:
            text += " — " + "; ".join(self.reasons)
        return text

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready view: unknown counters become ``null`` and the reasons say why."""

        def plain(value: Count) -> int | None:
            return None if value is UNKNOWN else value  # type: ignore[return-value]

        return {
            "verdict": self.verdict.value,
            "role": self.role.value,
            "source": self.source,
            **{name: plain(getattr(self, name)) for name in COUNTERS},
            "queues": {k: plain(v) for k, v in self.queues.items()},
            "engine_has_work": self.engine_has_work,
            "total": self.total,
            "reasons": list(self.reasons),
            "details": dict(self.details),
            "eta": self.eta.to_dict() if self.eta is not None else None,
            "observed_at": self.observed_at,
        }

    # -- combination --------------------------------------------------------------

    @classmethod
    def merge(cls, role: Role, parts: Iterable[PendingWork]) -> PendingWork:
        """Combine views of the same worker from different signals.

        Each counter is the largest known value among the parts (they are views of
        the same work, not disjoint shares) and unknown only when no part knows it.
        Errors are kept from every part, so one failed signal makes the whole
        UNKNOWN unless another part already shows work. The observation time is
        the oldest part's, the conservative choice.
        """
        parts = tuple(parts)
        if not parts:
            raise ConfigError("parts", "merge needs at least one snapshot")

        def largest(values: Iterable[Count]) -> Count:
            known = [v for v in values if v is not UNKNOWN]
            return max(known) if known else UNKNOWN  # type: ignore[type-var]

        queue_names = sorted({name for p in parts for name in p.queues})
        verdicts = [p.engine_has_work for p in parts if p.engine_has_work is not None]
        return cls(
            role=role,
            source="+".join(p.source for p in parts),
            **{name: largest(getattr(p, name) for p in parts) for name in COUNTERS},
            queues={n: largest(p.queues.get(n, UNKNOWN) for p in parts) for n in queue_names},
            engine_has_work=any(verdicts) if verdicts else None,
            errors=tuple(f"{p.source}: {e}" for p in parts for e in p.errors),
            details={f"{p.source}.{k}": v for p in parts for k, v in p.details.items()},
            observed_at=min(p.observed_at for p in parts),
            parts=parts,
            eta=DrainEta.combine(p.eta for p in parts),
        )


@runtime_checkable
class QuiescenceProbe(Protocol):
    """Reads whether a worker still owes work. See the module docstring for the contract."""

    @property
    def role(self) -> Role: ...

    @property
    def source(self) -> str: ...

    async def pending_work(self) -> PendingWork: ...

    async def is_quiescent(self) -> bool: ...


@runtime_checkable
class ChangeNotifier(Protocol):
    """Optional probe capability: wake the drain when the engine's state changes."""

    async def wait_for_change(self, after: PendingWork, timeout: float) -> None:
        """Return once the state may differ from ``after``, or after ``timeout`` seconds."""


class Probe:
    """Convenience base class: stores role and source and derives ``is_quiescent``."""

    def __init__(self, role: Role | str, source: str) -> None:
        self._role = Role.parse(role)
        self._source = source

    @property
    def role(self) -> Role:
        return self._role

    @property
    def source(self) -> str:
        return self._source

    async def pending_work(self) -> PendingWork:  # pragma: no cover - abstract
        raise NotImplementedError

    async def is_quiescent(self) -> bool:
        return (await observe(self)).is_quiescent


DEFAULT_PROBE_TIMEOUT_S: Final = 1.0

_T = TypeVar("_T")


async def _bounded(awaitable: Coroutine[Any, Any, _T], timeout: float) -> _T:
    """Await with a timeout without an extra task where the runtime allows (3.11+)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout)  # pragma: no cover - Python 3.10


async def observe(probe: QuiescenceProbe, timeout: float = DEFAULT_PROBE_TIMEOUT_S) -> PendingWork:
    """Read ``probe`` once; a raise, a hang past ``timeout`` or a wrong type becomes UNKNOWN.

    Cancellation of the caller still propagates. Never raises otherwise.
    """
    role, source = probe.role, probe.source
    try:
        snapshot: object = await _bounded(probe.pending_work(), max(timeout, 0.0))
    except asyncio.TimeoutError:
        return PendingWork.unknown(role, source, f"probe did not answer within {timeout:.3f}s")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a probe must never make a worker look idle by failing
        return PendingWork.unknown(role, source, f"probe raised {type(exc).__name__}: {exc}")
    if not isinstance(snapshot, PendingWork):
        return PendingWork.unknown(
            role, source, f"probe returned {type(snapshot).__name__}, not PendingWork")
    return snapshot


class AllOf(Probe):
    """Quiescent only when every probe agrees: e.g. the frontend's request count AND the
    engine's own signal (a request can be visible to one and not yet to the other).

    The parts are read concurrently, each bounded by ``timeout``; the snapshot is
    :meth:`PendingWork.merge` of their answers.
    """

    def __init__(self, *probes: QuiescenceProbe, role: Role | str | None = None,
                 timeout: float = DEFAULT_PROBE_TIMEOUT_S) -> None:
        if not probes:
            raise ConfigError("probes", "AllOf needs at least one probe")
        resolved = Role.parse(role) if role is not None else probes[0].role
        mismatched = [p.source for p in probes if p.role is not resolved]
        if mismatched:
            raise ConfigError("probes", f"roles differ from {resolved.value}: {mismatched}")
        if timeout <= 0:
            raise ConfigError("timeout", f"must be positive, got {timeout!r}")
        super().__init__(resolved, "+".join(p.source for p in probes))
        self.probes = probes
        self._timeout = timeout

    async def pending_work(self) -> PendingWork:
        parts = await asyncio.gather(*(observe(p, self._timeout) for p in self.probes))
        return PendingWork.merge(self.role, parts)

    async def wait_for_change(self, after: PendingWork, timeout: float) -> None:
        """Wake when any notifying part changes; parts that cannot notify are polled."""
        parts = after.parts or (after,) * len(self.probes)
        waits = [p.wait_for_change(part, timeout)
                 for p, part in zip(self.probes, parts, strict=False)
                 if isinstance(p, ChangeNotifier)]
        if not waits:
            waits.append(asyncio.sleep(timeout))
        tasks = [asyncio.ensure_future(w) for w in waits]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
