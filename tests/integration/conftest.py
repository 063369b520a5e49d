"""Fixtures of the admin HTTP API tests (``test_admin_api_*.py``): a running ``worker``
and an in-process ``client`` of its app (see :mod:`tests.integration.admin_api_harness`).
A test module that defines its own ``worker`` fixture overrides this one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

pytest.register_assert_rewrite("tests.integration.admin_api_harness")

from tests.integration.admin_api_harness import Worker, asgi_client, running_worker  # noqa: E402


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    async with running_worker() as started:
        yield started


@pytest.fixture
async def client(worker: Worker) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(worker.app) as opened:
        yield opened
