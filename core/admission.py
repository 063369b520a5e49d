"""Admission: one object that holds "accepting", the in-flight count and how every
admitted request ended.

Because all of it lives in one :class:`AdmissionGate` and every change happens in one
synchronous step on the event loop, there is no window in which a request slips in
after the drain decided to close: a request is either counted or refused with
:class:`~quiesce.errors.WorkerDraining` (typed, retryable).

Every admitted request ends in exactly one :class:`Outcome`, recorded when its
admission is released:

- ``completed``: the engine finished it (stop, length);
- ``lost``: it was ended by the engine or by the worker stopping (engine abort, engine
  dead, cancelled by the shutdown or the forced path) — the outcome a drain exists to
  prevent;
- ``client_gone``: the client disconnected before the end;
- ``rejected``: its own bad input, found after admission but before any work.

Use::

    async with gate.admit(request_id) as admission:   # or a plain `with`
        async for piece in engine.generate(...):
            yield piece
        admission.finish(Outcome.COMPLETED)           # the engine said stop/length

A block left without :meth:`Admission.finish` gets the outcome its exit implies
(:func:`outcome_of`): cancellation or a closed generator is ``client_gone`` — or
``lost`` once the gate is closed for stopping, when cancellation comes from the worker
itself; :class:`~quiesce.errors.RequestRejected` is ``rejected``; any other exception,
and a normal exit that never said how the request ended, is ``lost``. Fail closed: a
request nobody vouched for is never counted as completed.

The gate is not thread-safe: use it from the event loop that owns the worker.
Cost: well under a microsecond per admit+finish pair (``make bench``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from enum import Enum
from types import TracebackType

from quiesce.errors import RequestRejected, WorkerDraining


class Outcome(str, Enum):
    """How an admitted request ended. See the module docstring."""

    COMPLETED = "completed"
    LOST = "lost"
    CLIENT_GONE = "client_gone"
    REJECTED = "rejected"


_SLOT = {outcome: slot for slot, outcome in enumerate(Outcome)}


@dataclasses.dataclass(frozen=True)
class OutcomeCounts:
    """How many admitted requests ended in each outcome (since start, or since a mark)."""

    completed: int = 0
    lost: int = 0
    client_gone: int = 0
    rejected: int = 0

    def __sub__(self, earlier: OutcomeCounts) -> OutcomeCounts:
        return OutcomeCounts(*(mine - theirs for mine, theirs in
                               zip(dataclasses.astuple(self), dataclasses.astuple(earlier),
                                   strict=True)))

    @property
    def ended(self) -> int:
        return self.completed + self.lost + self.client_gone + self.rejected

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def outcome_of(exc: BaseException | None, stopping: bool) -> Outcome:
    """The outcome of a request whose handler exited with ``exc`` without reporting one.

    ``stopping``: the gate was closed for the worker's shutdown, so a cancellation came
    from the worker (its servers closing), not from the client.
    """
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return Outcome.LOST if stopping else Outcome.CLIENT_GONE
    if isinstance(exc, RequestRejected):
        return Outcome.REJECTED
    return Outcome.LOST


class Admission:
    """One admitted request. Ends exactly once: the first outcome recorded counts."""

    __slots__ = ("_gate", "outcome", "request_id")

    def __init__(self, gate: AdmissionGate, request_id: str | None) -> None:
        self._gate: AdmissionGate | None = gate
        self.request_id = request_id
        self.outcome: Outcome | None = None

    def finish(self, outcome: Outcome) -> None:
        """Record how the request ended and release it. Later calls change nothing."""
        # The hot path: kept to attribute reads and writes (see `make bench`, admission).
        gate = self._gate
        if gate is not None:
            self._gate = None
            self.outcome = outcome
            gate._ended[_SLOT[outcome]] += 1
            gate._inflight -= 1
            if gate._inflight == 0 and gate._idle_waiters:
                gate._wake_idle()

    def end_by(self, exc: BaseException | None) -> None:
        """Release after the handler exited with ``exc``: the outcome it implies
        (:func:`outcome_of`) unless one was recorded already."""
        gate = self._gate
        if gate is not None:
            self.finish(outcome_of(exc, stopping=gate._closed_as == "stopping"
                                   and not gate._accepting))

    @property
    def released(self) -> bool:
        return self._gate is None

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._gate is not None:
            self.end_by(exc)

    async def __aenter__(self) -> Admission:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._gate is not None:
            self.end_by(exc)


class AdmissionGate:
    """Counts admitted requests, refuses new ones once closed, and counts outcomes.

    Waiters of :meth:`wait_idle` are woken the moment the count reaches zero.
    ``refused_total`` counts requests refused at the gate (never admitted; not an
    outcome).
    """

    __slots__ = ("_accepting", "_closed_as", "_ended", "_idle_waiters", "_inflight",
                 "admitted_total", "refused_total")

    def __init__(self, accepting: bool = True) -> None:
        self._accepting = accepting
        self._closed_as = "draining"
        self._inflight = 0
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._ended = [0] * len(_SLOT)
        self.admitted_total = 0
        self.refused_total = 0

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def inflight(self) -> int:
        return self._inflight

    def outcomes(self) -> OutcomeCounts:
        """How every admitted request that has ended so far ended (totals since start)."""
        return OutcomeCounts(*self._ended)

    def admit(self, request_id: str | None = None) -> Admission:
        """Count a request in, or raise :class:`WorkerDraining` (and count a refusal)."""
        if not self._accepting:
            self.refused_total += 1
            raise WorkerDraining(request_id, state=self._closed_as)
        self._inflight += 1
        self.admitted_total += 1
        return Admission(self, request_id)

    def close(self, state: str = "draining") -> None:
        """Refuse new requests from now on; ``state`` is named in the refusal message.

        ``"stopping"`` also tells :meth:`Admission.end_by` that a cancellation now comes
        from the worker, so it counts as ``lost``.
        """
        self._accepting = False
        self._closed_as = state

    def open(self) -> None:
        self._accepting = True

    async def wait_idle(self) -> None:
        """Return once nothing is admitted. Does not close the gate by itself."""
        if self._inflight == 0:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._idle_waiters:
                self._idle_waiters.remove(waiter)

    def _wake_idle(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
