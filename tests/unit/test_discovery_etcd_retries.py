"""The etcd adapter's bounded retries and its failure states, without a server (the real
etcd is in tests/integration/test_etcd_discovery.py)."""

from __future__ import annotations

import asyncio

import pytest

from quiesce.budget import Deadline
from quiesce.discovery import registration_state, retry_within

aetcd = pytest.importorskip("aetcd", reason="aetcd is not installed: pip install "
                                            "'quiesce[etcd]'")

from quiesce.adapters.etcd import (  # noqa: E402
    DiscoveryUnavailable,
    EtcdConfig,
    EtcdDiscovery,
)
from quiesce.adapters.etcd.client import retryable  # noqa: E402


async def test_retries_double_and_stop_at_the_deadline() -> None:
    calls: list[float] = []

    async def refused() -> None:
        calls.append(asyncio.get_running_loop().time())
        raise aetcd.ConnectionFailedError("connection refused")

    with pytest.raises(DiscoveryUnavailable) as info:
        await asyncio.wait_for(retry_within("etcd", "probe", refused, Deadline.after(0.3), 0.1,
                                            retryable=retryable), 5.0)
    assert info.value.attempts == len(calls) >= 3
    assert "connection refused" in str(info.value)


async def test_a_hanging_attempt_is_cut_by_the_rpc_timeout_and_retried() -> None:
    calls = 0

    async def hangs_once() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.Event().wait()
        return "ok"

    assert await retry_within("etcd", "probe", hangs_once, Deadline.after(5.0), 0.05,
                              retryable=retryable) == "ok"
    assert calls == 2


async def test_errors_that_retrying_cannot_fix_fail_at_once() -> None:
    calls = 0

    async def bad() -> None:
        nonlocal calls
        calls += 1
        raise aetcd.InvalidArgumentError("bad key")

    with pytest.raises(DiscoveryUnavailable) as info:
        await retry_within("etcd", "probe", bad, Deadline.after(5.0), 1.0, retryable=retryable)
    assert calls == 1 and info.value.attempts == 1
    assert isinstance(info.value.__cause__, aetcd.InvalidArgumentError)


async def test_unregister_of_a_never_registered_worker_makes_no_call() -> None:
    # port 9 (discard) is never an etcd: any RPC would fail
    backend = EtcdDiscovery(EtcdConfig("w", "http://x", port=9, retry_budget_s=0.2))
    await backend.unregister()
    assert not backend.registered and registration_state(backend) == (False, None)
    await backend.close()


async def test_register_with_etcd_unreachable_raises_and_leaves_the_state_unknown() -> None:
    backend = EtcdDiscovery(EtcdConfig("w", "http://x", port=9, retry_budget_s=0.2,
                                       rpc_timeout_s=0.1))
    try:
        with pytest.raises(DiscoveryUnavailable):
            await asyncio.wait_for(backend.register(), 5.0)
        registered, error = registration_state(backend)
        assert registered is None and error is not None and "register" in error
        assert backend.registered  # fail closed: a put may have landed
    finally:
        await backend.close()
