"""``quiesce serve`` signalled before it serves (:func:`quiesce.serve.worker.run_worker`), in
process, with FAKES where the outside world would be: discovery (a scripted in-memory
discovery standing in for the etcd client, whose registration and unregistration the
test holds), the GPU reader (a stand-in with ``aclose``), the signal (the test calls
``Shutdown.request`` instead of sending SIGTERM to itself) and, for ``--dynamo``, the
Dynamo modules (tests/unit/dynamo_fakes.py). The engine is the real simulated one.

The real processes: tests/integration/test_sigterm_at_start.py (etcd stalled during the
registration, SIGTERM) and, for ``--dynamo``,
tests/integration/dynamo/test_reference_backend.py::test_sigterm_while_the_card_registers_never_serves
(Dynamo's real runtime and frontend, in .venv-dynamo).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quiesce.admin import server
from quiesce.serve import worker
from quiesce.serve.options import WorkerOptions, add_serve_arguments, options_from_args
from quiesce.shutdown import Shutdown
from tests.unit.dynamo_fakes import FakeDynamo
from tests.unit.lifecycle_harness import ScriptedDiscovery

WAIT_S = 10.0


def options(*argv: str) -> WorkerOptions:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return options_from_args(parser.parse_args(
        ["--port", "0", "--admin-port", "0", "--router-grace", "0", "--budget", "10",
         "--reserve", "2", *argv]))


class HeldDiscovery(ScriptedDiscovery):
    """FAKE of the etcd client (:class:`~quiesce.adapters.etcd.EtcdDiscovery`): its
    registration and unregistration wait for the test; ``close`` is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.registering, self.unregistering = asyncio.Event(), asyncio.Event()
        """Set to let a held registration / unregistration go on."""
        self.register_gate, self.unregister_gate = self.registering, self.unregistering
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class GpuReader:
    """FAKE of the ``--require-gpu-quiet`` reader: ``aclose`` is recorded."""

    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


class World:
    """What the worker was handed and what it did: its shutdown, its sockets."""

    def __init__(self) -> None:
        self.shutdown: Shutdown | None = None
        self.sockets: list[socket.socket] = []
        self.gpu = GpuReader()


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """The worker's signal handlers are not installed (the test requests the shutdown),
    its bound sockets are recorded, its GPU reader is a fake."""
    seen = World()
    bind = server.bind_socket

    def recorded_bind(*args: Any, **kwargs: Any) -> socket.socket:
        sock = bind(*args, **kwargs)
        seen.sockets.append(sock)
        return sock

    def install(shutdown: Shutdown, loop: Any = None) -> None:
        seen.shutdown = shutdown

    async def probe(options: WorkerOptions, serving: Any, timeout_s: float) -> Any:
        return serving.probe, seen.gpu

    monkeypatch.setattr(worker, "bind_socket", recorded_bind)
    monkeypatch.setattr(Shutdown, "install_signal_handlers", install)
    monkeypatch.setattr(worker, "_probe", probe)
    yield seen
    for sock in seen.sockets:
        sock.close()


async def refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


def exit_line(out: str) -> dict[str, Any]:
    (line,) = [json.loads(text) for text in out.splitlines() if '"event": "exit"' in text]
    return dict(line)


async def test_a_serve_signalled_while_it_registers_refuses_connections_during_the_drain(
        world: World, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """SIGTERM while the worker registers (its ports listen, what connects waits in the
    backlog): it never serves, and its ports are closed before the drain runs, so a
    client is refused at once instead of waiting through the drain (before: both ports
    listened until the drain ended). The discovery client and the GPU reader are closed
    as on the normal path (before: neither)."""
    discovery = HeldDiscovery()
    monkeypatch.setattr(worker, "build_discovery", lambda options, port: discovery)
    monkeypatch.setattr(worker, "EtcdDiscovery", HeldDiscovery)
    run = asyncio.create_task(worker.run_worker(options("--engine", "sim")))
    await asyncio.wait_for(discovery.register_entered.wait(), WAIT_S)
    ports = [sock.getsockname()[1] for sock in world.sockets]
    assert world.shutdown is not None and len(ports) == 2
    world.shutdown.request("SIGTERM")
    discovery.registering.set()
    await asyncio.wait_for(discovery.unregister_entered.wait(), WAIT_S)  # the drain runs
    assert [await refused(port) for port in ports] == [True, True]
    discovery.unregistering.set()
    code = await asyncio.wait_for(run, WAIT_S)
    out = capsys.readouterr().out
    assert code == 0 and exit_line(out)["outcome"] == "drained", out
    assert '"event": "ready"' not in out
    assert discovery.closed and world.gpu.closed


async def test_a_serve_signalled_as_it_starts_closes_its_clients_too(
        world: World, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Signalled before it registers: never registered, its sockets closed, the
    discovery client and the GPU reader closed (before: neither)."""
    discovery = HeldDiscovery()
    discovery.unregistering.set()  # not held here
    monkeypatch.setattr(worker, "build_discovery", lambda options, port: discovery)
    monkeypatch.setattr(worker, "EtcdDiscovery", HeldDiscovery)

    def install(shutdown: Shutdown, loop: Any = None) -> None:
        shutdown.request("SIGTERM")  # the signal came while the engine started

    monkeypatch.setattr(Shutdown, "install_signal_handlers", install)
    code = await asyncio.wait_for(worker.run_worker(options("--engine", "sim")), WAIT_S)
    out = capsys.readouterr().out
    assert code == 0 and exit_line(out)["outcome"] == "drained", out
    assert discovery.register_calls == 0 and all(s.fileno() == -1 for s in world.sockets)
    assert discovery.closed and world.gpu.closed


# -- --dynamo ---------------------------------------------------------------------------

def fake_dynamo_backend(dynamo: FakeDynamo) -> asyncio.Event:
    """What ``quiesce serve --dynamo`` needs of ai-dynamo, faked: ``dynamo.runtime``'s
    ``DistributedRuntime`` (:class:`~tests.unit.dynamo_fakes.FakeRuntime`), the model
    card's names in ``dynamo.llm``, and a ``register_model`` that waits for the event
    returned (recorded as ``dynamo.calls`` does)."""
    release = asyncio.Event()
    llm = sys.modules["dynamo.llm"]
    record = llm.register_model

    class ModelType:
        Completions, Chat = 1, 2

    async def held_register_model(*args: Any, **kwargs: Any) -> None:
        await record(*args, **kwargs)
        await release.wait()

    llm.register_model = held_register_model  # type: ignore[attr-defined]
    llm.ModelType = ModelType  # type: ignore[attr-defined]
    llm.ModelInput = type("ModelInput", (), {"Tokens": "tokens"})  # type: ignore[attr-defined]
    errors = sys.modules["dynamo.llm.exceptions"]
    errors.EngineShutdown = type("EngineShutdown", (Exception,), {})  # type: ignore[attr-defined]
    errors.InvalidArgument = type("InvalidArgument", (Exception,), {})  # type: ignore[attr-defined]
    dynamo.module("dynamo.runtime",
                  DistributedRuntime=lambda loop, discovery, plane: dynamo.runtime)
    return release


def tiny_model(directory: Path) -> Path:
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [], "model": {"vocab": {"a": 0, "b": 1}}}))
    return directory


async def test_a_dynamo_serve_signalled_while_its_card_registers_never_serves(
        world: World, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--dynamo``, SIGTERM while Dynamo registers the model card: the endpoint is never
    served (no ``serve_endpoint``, no ready line), the drain takes the card off, exit 0
    drained (before: it served and printed ready, then drained)."""
    for name in ("DYN_NAMESPACE", "DYN_DISCOVERY_BACKEND", "DYN_REQUEST_PLANE"):
        monkeypatch.delenv(name, raising=False)
    dynamo = FakeDynamo(monkeypatch)
    release = fake_dynamo_backend(dynamo)
    model = tiny_model(tmp_path / "m")
    run = asyncio.create_task(worker.run_worker(options(
        "--dynamo", "--model", str(model), "--router-quiet", "0")))
    for _ in range(int(WAIT_S / 0.005)):
        if any(call[0] == "register_model" for call in dynamo.calls):
            break
        await asyncio.sleep(0.005)
    assert world.shutdown is not None, dynamo.calls
    world.shutdown.request("SIGTERM")
    release.set()
    code = await asyncio.wait_for(run, WAIT_S)
    out = capsys.readouterr().out
    assert code == 0 and exit_line(out)["outcome"] == "drained", out
    assert '"event": "ready"' not in out
    assert all(endpoint.handler is None for endpoint in dynamo.runtime.endpoints.values())
    assert [c[0] for c in dynamo.calls] == ["register_model", "unregister_model"]
    assert world.gpu.closed
