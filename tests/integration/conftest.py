"""Fixtures of the admin HTTP API tests (``test_admin_api_*.py``): a running ``worker``
and an in-process ``client`` of its app (see :mod:`tests.integration.admin_api_harness`).
A test module that defines its own ``worker`` fixture overrides this one. ``etcd``: a
real etcd on loopback for the discovery tests (they skip without the binary)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from quiesce.adapters.etcd.local import LocalEtcd

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


@pytest.fixture
async def etcd() -> AsyncIterator[LocalEtcd]:
    """A single-member etcd on free loopback ports with a temporary data directory,
    stopped (and its directory removed) at the end of the test."""
    server = LocalEtcd()
    try:
        await server.start(timeout_s=15)
        yield server
    finally:
        server.close()
