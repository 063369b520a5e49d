"""Confirming a zero reading of the executor across a pass of its loop.

One all-zero reading of :func:`~.executor_reader.read_py_executor` can be transient (the
loop holds a request between two places, or rebuilds a list); :class:`ZeroConfirmation`
accepts a zero only once confirmed, and :func:`read_confirmed` (the probe's, on the event
loop) / :func:`read_confirmed_blocking` (a Ray actor's thread) read with it. Costs: a few
microseconds, plus one :data:`CONFIRM_WAIT_S` wait and a second reading only when the
engine reads zero and the zero is not confirmed yet. Never mutates the engine.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

from .executor_reader import all_zero, read_py_executor


class ZeroConfirmation:
    """Accepts an all-zero reading only when it is confirmed (fail closed otherwise).

    One instance per executor, kept across reads (the probe's, or the Ray worker's).
    An all-zero reading is **confirmed** when

    - the counter moved between an earlier all-zero reading's end and this reading's
      start (``previous.iter_after < current.iter_before``): a pass boundary lies
      between the two (2026 builds bump ``iter_counter`` at the end of a pass), so a
      request the loop held between two places at the first reading was put down
      before the second (requests parked behind a control sentinel are counted on
      their own, since they stay put across that boundary); or
    - the loop was **parked** after this reading (blocked in the request queue's
      ``get()``, the counter unchanged since before the reading): it held nothing in
      hand during the reading and had nothing to schedule. This is how an idle loop that
      blocks on its request queue (1.2-era) is confirmed without its counter moving.

    Without a readable counter, a second all-zero reading taken after a short wait
    (:data:`CONFIRM_WAIT_S`, during which the executor thread takes the GIL) confirms it:
    a weaker guarantee, since it assumes the loop puts down what it holds within that
    wait (true of the Python steps between two places; not if the loop is stuck there).
    """

    def __init__(self) -> None:
        self._last_zero_end: int | None = None

    def check(self, reading: dict[str, Any], *, previous_without_counter: bool = False
              ) -> str | None:
        """None when ``reading`` is confirmed (or not all zero); else why it is not.
        ``previous_without_counter``: an all-zero reading without a counter was taken just
        before this one, after the wait (the weaker confirmation)."""
        if not all_zero(reading):
            self._last_zero_end = None
            return None
        before, after = reading.get("iter_before"), reading.get("iter_after")
        if before is None or after is None:
            if previous_without_counter:
                return None
            return ("an all-zero reading is not confirmed yet: no executor iteration "
                    "counter is readable, a second reading must agree")
        last, self._last_zero_end = self._last_zero_end, after
        if reading.get("parked") is True:
            return None
        if last is not None and last < before:
            return None
        return ("an all-zero reading is not confirmed yet: the executor loop has not "
                "gone round since the last all-zero reading (a request it holds between "
                "two queues is in none of them)")


CONFIRM_WAIT_S: Final = 0.002
"""The awaited wait before a second reading where no iteration counter is readable."""


def _second_reading(executor: Any, first: dict[str, Any], confirm: ZeroConfirmation
                    ) -> dict[str, Any]:
    second = read_py_executor(executor)
    weak = first.get("iter_before") is None and second.get("iter_before") is None
    second["unconfirmed"] = confirm.check(second, previous_without_counter=weak)
    return second


async def read_confirmed(executor: Any, confirm: ZeroConfirmation) -> dict[str, Any]:
    """:func:`read_py_executor`, with ``unconfirmed`` set (None, or why a zero is not
    confirmed). An unconfirmed zero is read once more after an awaited
    :data:`CONFIRM_WAIT_S` (the event loop is never blocked); the cost is a few
    microseconds, plus that wait only when the engine reads zero."""
    first = read_py_executor(executor)
    first["unconfirmed"] = confirm.check(first)
    if first["unconfirmed"] is None:
        return first
    await asyncio.sleep(CONFIRM_WAIT_S)
    return _second_reading(executor, first, confirm)


def read_confirmed_blocking(executor: Any, confirm: ZeroConfirmation) -> dict[str, Any]:
    """:func:`read_confirmed` for a thread that may block briefly (a Ray actor's)."""
    first = read_py_executor(executor)
    first["unconfirmed"] = confirm.check(first)
    if first["unconfirmed"] is None:
        return first
    time.sleep(CONFIRM_WAIT_S)
    return _second_reading(executor, first, confirm)
