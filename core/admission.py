"""Admission: one object that holds "accepting" and the in-flight count together.

Because both live in one :class:`AdmissionGate` and every change happens in one
synchronous step on the event loop, there is no window in which a request slips in
after the drain decided to close: a request is either counted or rejected with
:class:`~quiesce.errors.WorkerDraining` (typed, retryable).

Use::

    async with gate.admit(request_id):      # or a plain `with`: both release
        async for token in engine.generate(...):
            yield token

The admission is counted when ``admit()`` returns and released exactly once when
the block ends: normally, by an error, or by cancellation (a client that
disconnects closes the generator, which runs the ``with`` exit). For lifetimes
that are not lexical, call ``admission.release()`` yourself; it is idempotent.

The gate is not thread-safe: use it from the event loop that owns the worker.
Cost: a few hundred nanoseconds per admit+release pair (``make bench``).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from quiesce.errors import WorkerDraining


class Admission:
    """One admitted request. Releasing it is idempotent."""

    __slots__ = ("_gate", "request_id")

    def __init__(self, gate: AdmissionGate, request_id: str | None) -> None:
        self._gate: AdmissionGate | None = gate
        self.request_id = request_id

    def release(self) -> None:
        # The hot path: kept to attribute reads and writes (see `make bench`, admission).
        gate = self._gate
        if gate is not None:
            self._gate = None
            gate._inflight -= 1
            if gate._inflight == 0 and gate._idle_waiters:
                gate._wake_idle()

    @property
    def released(self) -> bool:
        return self._gate is None

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    async def __aenter__(self) -> Admission:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.release()


class AdmissionGate:
    """Counts admitted requests and refuses new ones once closed.

    Waiters of :meth:`wait_idle` are woken the moment the count reaches zero.
    """

    __slots__ = ("_accepting", "_closed_as", "_idle_waiters", "_inflight", "admitted_total",
                 "rejected_total")

    def __init__(self, accepting: bool = True) -> None:
        self._accepting = accepting
        self._closed_as = "draining"
        self._inflight = 0
        self._idle_waiters: list[asyncio.Future[None]] = []
        self.admitted_total = 0
        self.rejected_total = 0

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def inflight(self) -> int:
        return self._inflight

    def admit(self, request_id: str | None = None) -> Admission:
        """Count a request in, or raise :class:`WorkerDraining` (and count a rejection)."""
        if not self._accepting:
            self.rejected_total += 1
            raise WorkerDraining(request_id, state=self._closed_as)
        self._inflight += 1
        self.admitted_total += 1
        return Admission(self, request_id)

    def close(self, state: str = "draining") -> None:
        """Refuse new requests from now on; ``state`` is named in the rejection message."""
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
