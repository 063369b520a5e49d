"""Fixtures shared by the unit tests: ``workers`` for the lifecycle tests
(``test_lifecycle_*.py``, helpers in :mod:`tests.unit.lifecycle_harness`); ``owner``, a
claimed :class:`~quiesce.signal_guard.SignalOwnership` released after the test, for the
signal guard tests."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest

from quiesce.signal_guard import OWNER_ENV, SignalOwnership

pytest.register_assert_rewrite("tests.unit.lifecycle_harness")

from tests.unit.lifecycle_harness import Workers  # noqa: E402


@pytest.fixture
async def workers() -> AsyncIterator[Workers]:
    made = Workers()
    yield made
    await made.close()


@pytest.fixture
def owner() -> Iterator[SignalOwnership]:
    ownership = SignalOwnership()
    ownership.claim()
    try:
        yield ownership
    finally:
        ownership.release()
    assert OWNER_ENV not in os.environ
