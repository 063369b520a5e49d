"""EtcdDiscovery against a real etcd (Debian's etcd-server, ``ci/setup_etcd.sh``).

Each test starts its own single-member etcd on loopback (free ports, a temporary data
directory) and stops it at the end; the fault tests stop and restart it. Without the
``etcd`` binary the tests skip with the reason. Every wait is bounded and woken by what
it waits for (a watch event, or a short backoff on a condition); latencies are printed,
never asserted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from quiesce.adapters.etcd.local import LocalEtcd
from tests.integration.real_parts import require_etcd

pytestmark = pytest.mark.slow

require_etcd()
import aetcd  # type: ignore[import-untyped, unused-ignore]  # noqa: E402

from quiesce.adapters.etcd import (  # noqa: E402
    DiscoveryUnavailable,
    EtcdConfig,
    EtcdDiscovery,
    EtcdWatcher,
)
from quiesce.admission import AdmissionGate, Outcome  # noqa: E402
from quiesce.budget import Deadline  # noqa: E402
from quiesce.discovery import Discovery, registration_state  # noqa: E402
from quiesce.drain import DrainConfig, StageOutcome  # noqa: E402
from quiesce.errors import ConfigError, ResumeFailed  # noqa: E402
from quiesce.lifecycle import Lifecycle, State  # noqa: E402
from tests.unit.test_probe import FakeProbe  # noqa: E402

PREFIX = "/quiesce/instances"


@pytest.fixture
async def watcher(etcd: LocalEtcd) -> AsyncIterator[EtcdWatcher]:
    follower = EtcdWatcher(etcd.host, etcd.port, PREFIX)
    await follower.start()
    yield follower
    await follower.close()


@pytest.fixture
async def inspect(etcd: LocalEtcd) -> AsyncIterator[Any]:
    """A separate etcd client, to look at the store the way an operator would."""
    async with aetcd.Client(etcd.host, etcd.port) as client:
        yield client


def config(etcd: LocalEtcd, worker: str = "w1", **overrides: Any) -> EtcdConfig:
    values: dict[str, Any] = {"address": f"http://127.0.0.1:9/{worker}", "role": "decode",
                              "port": etcd.port, "ttl_s": 5, "keepalive_s": 0.5,
                              "rpc_timeout_s": 0.5, "retry_budget_s": 2.0}
    values.update(overrides)
    return EtcdConfig(worker, **values)


@pytest.fixture
async def discovery(etcd: LocalEtcd) -> AsyncIterator[EtcdDiscovery]:
    backend = EtcdDiscovery(config(etcd))
    yield backend
    await backend.close()


async def until(condition: Callable[[], bool | Awaitable[bool]], timeout_s: float,
                what: str) -> None:
    """Poll ``condition`` with a doubling backoff (1 ms to 100 ms) until true; fail after
    ``timeout_s`` naming ``what``."""
    deadline = Deadline.after(timeout_s)
    delay = 0.001
    while True:
        value = condition()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if deadline.expired():
            pytest.fail(f"{what}: not within {timeout_s:g}s")
        await asyncio.sleep(min(delay, deadline.remaining()))
        delay = min(delay * 2, 0.1)


async def lease_ttl(client: Any, lease_id: int) -> int:
    """Remaining TTL of a lease; -1 when etcd does not know it (revoked or expired)."""
    return int((await client.get_lease_info(lease_id, keys=False)).TTL)


async def test_register_puts_the_key_under_a_lease_that_is_kept_alive(
        discovery: EtcdDiscovery, watcher: EtcdWatcher, inspect: Any) -> None:
    assert isinstance(discovery, Discovery)
    assert not discovery.registered
    await discovery.register()
    assert discovery.registered and registration_state(discovery) == (True, None)
    lease = discovery.lease_id
    assert lease is not None
    got = await inspect.get(b"/quiesce/instances/w1")
    assert got is not None and int(got.lease) == lease
    value = json.loads(got.value)
    assert value == {"worker": "w1", "address": "http://127.0.0.1:9/w1", "role": "decode",
                     "generation": 1, "lease": lease}
    info = await inspect.get_lease_info(lease, keys=True)
    assert info.grantedTTL == 5 and list(info.keys) == [b"/quiesce/instances/w1"]
    assert await watcher.wait_for("w1", True, 5.0)
    assert watcher.instances["w1"]["generation"] == 1

    await discovery.register()  # idempotent: same lease, nothing re-put
    assert discovery.lease_id == lease and discovery.generation == 1

    # the keep-alive keeps refreshing the lease: its remaining TTL comes back up
    before = discovery.keepalives
    await until(lambda: discovery.keepalives >= before + 3, 10.0, "three keep-alives")
    assert await lease_ttl(inspect, lease) >= 4
    assert (await inspect.get(b"/quiesce/instances/w1")) is not None


def test_bad_configuration_is_a_config_error_naming_the_field() -> None:
    cases: list[tuple[str, dict[str, Any]]] = [
        ("worker", {"worker": "a/b"}), ("worker", {"worker": ""}),
        ("address", {"address": ""}), ("role", {"role": "leader"}),
        ("port", {"port": 0}), ("port", {"port": True}), ("prefix", {"prefix": "x"}),
        ("prefix", {"prefix": "/x/"}), ("ttl_s", {"ttl_s": 0}), ("ttl_s", {"ttl_s": 1.5}),
        ("keepalive_s", {"keepalive_s": 0}), ("keepalive_s", {"keepalive_s": 10}),
        ("rpc_timeout_s", {"rpc_timeout_s": -1}), ("retry_budget_s", {"retry_budget_s": 0}),
    ]
    for field, bad in cases:
        values: dict[str, Any] = {"worker": "w", "address": "http://x", **bad}
        with pytest.raises(ConfigError) as info:
            EtcdConfig(**values)
        assert info.value.field == field, bad
    with pytest.raises(ConfigError):
        EtcdDiscovery("127.0.0.1:2379")  # type: ignore[arg-type]


async def test_unregister_deletes_the_key_revokes_the_lease_and_a_watcher_sees_it(
        discovery: EtcdDiscovery, watcher: EtcdWatcher, inspect: Any) -> None:
    seen: dict[str, float] = {}

    def note(name: str, registered: bool) -> None:
        seen.setdefault(f"{name}:{registered}", time.perf_counter())

    watcher.watch(note)
    await discovery.register()
    assert await watcher.wait_for("w1", True, 5.0)
    lease = discovery.lease_id
    assert lease is not None

    started = time.perf_counter()
    await discovery.unregister()
    returned = time.perf_counter()
    assert await watcher.wait_for("w1", False, 5.0)
    print(f"\nunregister call {1e3 * (returned - started):.2f} ms; watcher saw the DELETE "
          f"{1e3 * (seen['w1:False'] - started):.2f} ms after the call started")
    assert not discovery.registered and registration_state(discovery) == (False, None)
    assert discovery.lease_id is None
    assert (await inspect.get(b"/quiesce/instances/w1")) is None
    assert await lease_ttl(inspect, lease) == -1  # revoked
    await discovery.unregister()  # idempotent
    assert not discovery.registered

    await discovery.register()  # and back, under a new lease and generation
    assert await watcher.wait_for("w1", True, 5.0)
    assert discovery.lease_id not in (None, lease)
    assert watcher.instances["w1"]["generation"] == 2


async def test_etcd_down_at_unregister_gives_up_within_the_deadline_and_reports_it(
        etcd: LocalEtcd, watcher: EtcdWatcher) -> None:
    backend = EtcdDiscovery(config(etcd, retry_budget_s=30.0))
    try:
        await backend.register()
        assert await watcher.wait_for("w1", True, 5.0)
        etcd.stop()
        started = time.monotonic()
        with pytest.raises(DiscoveryUnavailable) as info:
            # the caller's deadline (0.4 s) is earlier than the adapter's budget (30 s)
            await asyncio.wait_for(backend.unregister(Deadline.after(0.4)), 20.0)
        print(f"\nunregister gave up after {time.monotonic() - started:.3f}s, "
              f"{info.value.attempts} attempts: {info.value}")
        assert info.value.attempts >= 2  # retried, not a single try
        assert "not confirmed" in str(info.value)
        registered, error = registration_state(backend)
        assert registered is None and error == str(info.value)  # unknown, with the error
        assert backend.registered  # fail closed: routers may still list it

        # etcd back: the background cleanup deletes the key; the state becomes known
        await etcd.start(timeout_s=15)
        assert await watcher.wait_for("w1", False, 10.0)
        await until(lambda: registration_state(backend) == (False, None), 10.0,
                    "state known again after the cleanup")
    finally:
        await backend.close()


async def test_keep_alive_recovers_when_etcd_restarts(
        discovery: EtcdDiscovery, etcd: LocalEtcd, watcher: EtcdWatcher,
        inspect: Any) -> None:
    await discovery.register()
    lease = discovery.lease_id
    assert await watcher.wait_for("w1", True, 5.0)

    etcd.stop()
    await until(lambda: registration_state(discovery)[0] is None, 10.0,
                "keep-alive notices that etcd is down")
    error = registration_state(discovery)[1]
    assert error is not None and "keep-alive failed" in error
    assert discovery.registered  # unknown is not "gone"

    await etcd.start(timeout_s=15)
    await until(lambda: registration_state(discovery) == (True, None), 15.0,
                "keep-alive recovers after the restart")
    assert discovery.keepalive_failures >= 1
    assert discovery.lease_id == lease  # etcd kept the lease across the restart
    got = await inspect.get(b"/quiesce/instances/w1")
    assert got is not None and int(got.lease) == lease
    assert await lease_ttl(inspect, lease) > 0
    assert await watcher.wait_for("w1", True, 10.0)


async def test_lease_expiry_while_serving_registers_again(
        etcd: LocalEtcd, watcher: EtcdWatcher, inspect: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    backend = EtcdDiscovery(config(etcd, ttl_s=2, keepalive_s=0.3, rpc_timeout_s=0.3))
    try:
        await backend.register()
        old = backend.lease_id
        assert old is not None and await watcher.wait_for("w1", True, 5.0)

        # pause the keep-alive (a stalled worker): etcd expires the lease, deletes the key
        resumed = asyncio.Event()
        refresh = backend._refresh

        async def paused(lease_id: int) -> int:
            await resumed.wait()
            return await refresh(lease_id)

        monkeypatch.setattr(backend, "_refresh", paused)
        started = time.monotonic()
        assert await watcher.wait_for("w1", False, 15.0)
        print(f"\nlease expired {time.monotonic() - started:.2f}s after the keep-alive paused")
        assert await lease_ttl(inspect, old) == -1

        resumed.set()
        assert await watcher.wait_for("w1", True, 10.0)
        await until(lambda: registration_state(backend) == (True, None), 10.0,
                    "registered again")
        assert backend.reregistrations == 1
        assert backend.lease_id not in (None, old)
        assert watcher.instances["w1"]["generation"] == 2
        assert watcher.instances["w1"]["lease"] == backend.lease_id
    finally:
        await backend.close()


async def test_lifecycle_drain_and_resume_with_etcd_discovery(
        discovery: EtcdDiscovery, watcher: EtcdWatcher, inspect: Any) -> None:
    gate = AdmissionGate()
    lifecycle = Lifecycle(gate=gate, probe=FakeProbe(), discovery=discovery,
                          config=DrainConfig(router_grace_s=0.2, registration_timeout_s=5.0))
    await lifecycle.start()
    assert await watcher.wait_for("w1", True, 5.0)
    assert lifecycle.status().discovery_registered is True

    release = asyncio.Event()

    async def request() -> None:
        with gate.admit("r1") as admission:
            await release.wait()
            admission.finish(Outcome.COMPLETED)

    stream = asyncio.get_running_loop().create_task(request())
    await asyncio.sleep(0)  # admitted
    assert gate.inflight == 1
    run = await lifecycle.drain(budget_s=30.0)
    # routers see the worker go while its request is still in flight
    assert await watcher.wait_for("w1", False, 5.0)
    assert gate.inflight == 1 and lifecycle.state is State.DRAINING
    assert (await inspect.get(b"/quiesce/instances/w1")) is None
    release.set()
    report = await run.wait(20.0)
    await stream
    assert report is not None and report.drained, report
    assert report.stages[0].stage == "unregister"
    assert report.stages[0].outcome is StageOutcome.COMPLETED
    status = lifecycle.status()
    assert status.state is State.DRAINED and status.discovery_registered is False

    await lifecycle.resume()
    assert lifecycle.state is State.SERVING and gate.accepting
    assert await watcher.wait_for("w1", True, 5.0)
    assert lifecycle.status().discovery_registered is True
    assert watcher.instances["w1"]["generation"] == 2


async def test_lifecycle_drains_when_etcd_is_down_and_reports_the_unknown_registration(
        etcd: LocalEtcd, watcher: EtcdWatcher) -> None:
    backend = EtcdDiscovery(config(etcd, retry_budget_s=0.5))
    lifecycle = Lifecycle(gate=AdmissionGate(), probe=FakeProbe(), discovery=backend,
                          config=DrainConfig(router_grace_s=0.05, registration_timeout_s=1.0))
    try:
        await lifecycle.start()
        assert await watcher.wait_for("w1", True, 5.0)
        etcd.stop()
        run = await lifecycle.drain(budget_s=10.0)
        report = await run.wait(20.0)
        # the drain went on: admission closed, nothing in flight, drained
        assert report is not None and report.drained, report
        unregister = report.stages[0]
        assert unregister.stage == "unregister"
        assert unregister.outcome is StageOutcome.FAILED
        assert "DiscoveryUnavailable" in unregister.detail
        status = lifecycle.status()
        assert status.state is State.DRAINED
        assert status.to_dict()["last_drain"] is not None
        assert "not confirmed" in json.dumps(status.to_dict()["last_drain"])
        registered, error = registration_state(backend)
        assert registered is None and error is not None and "not confirmed" in error
        # unknown (routers may still list it) until etcd confirms
        assert status.discovery_registered is None
        assert status.discovery_error is not None and "not confirmed" in status.discovery_error

        # resume while etcd is still down: rolled back within registration_timeout_s
        with pytest.raises(ResumeFailed):
            await lifecycle.resume()
        assert not lifecycle.gate.accepting
        assert lifecycle.state is State.DRAINING
    finally:
        await lifecycle.stop()
        await backend.close()
