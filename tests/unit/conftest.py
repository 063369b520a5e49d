"""Fixtures shared by the unit tests: ``workers`` for the lifecycle tests
(``test_lifecycle_*.py``, helpers in :mod:`tests.unit.lifecycle_harness`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

pytest.register_assert_rewrite("tests.unit.lifecycle_harness")

from tests.unit.lifecycle_harness import Workers  # noqa: E402


@pytest.fixture
async def workers() -> AsyncIterator[Workers]:
    made = Workers()
    yield made
    await made.close()
