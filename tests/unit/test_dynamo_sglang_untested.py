"""``quiesce dynamo sglang --accept-untested-engine VERSION``, against a FAKE
``dynamo.sglang`` and a FAKE engine (tests/unit/dynamo_fakes.py; no Dynamo, no SGLang).

The installed SGLang's version and its ``is_fully_idle`` fingerprint are stood in for
(this environment has no SGLang); the fake scheduler answers as quiesce's plugin would.
Refusals are exit 2 before Dynamo is imported; an accepted release is trusted, and the
log, the ready line and ``GET /engine/status`` say so.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import sys
import time
from typing import Any

import httpx
import pytest

from quiesce.adapters.dynamo import sglang_component
from quiesce.adapters.dynamo.components import SglangComponent, component_for
from quiesce.adapters.sglang import SglangProbe
from quiesce.adapters.sglang import probe as sglang_probe
from quiesce.adapters.sglang.scheduler_state import STATE_KEY
from quiesce.admission import AdmissionGate
from quiesce.errors import ConfigError
from quiesce.ops import cli
from quiesce.ops.status_format import format_status
from quiesce.probe import Verdict
from quiesce.serve import dynamo_worker
from tests.unit.dynamo_fakes import FakeDynamo, until
from tests.unit.test_dynamo_components_sglang import FakeSglangEngine, fake_sglang, start
from tests.unit.test_sglang_adapter import state

FIND_SPEC = importlib.util.find_spec
RUNNING = "0123456789abcdef"
"""The stand-in installed release's ``is_fully_idle`` fingerprint."""


def installed(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """SGLang ``version`` "installed", with :data:`RUNNING` as its fingerprint, and
    ai-dynamo findable (the fake modules)."""
    monkeypatch.setattr(sglang_component, "installed_sglang_version", lambda: version)
    monkeypatch.setattr(sglang_probe, "installed_sglang_version", lambda: version)
    monkeypatch.setattr(sglang_probe, "installed_idle_fingerprint", lambda: RUNNING)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        object() if name == "dynamo" else FIND_SPEC(name, *a)))
    monkeypatch.delenv("QUIESCE_ADMIN_TOKEN", raising=False)


def parsed(argv: list[str]) -> argparse.Namespace:
    seen: list[argparse.Namespace] = []

    def record(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "_dynamo", record)
        assert cli.main(argv) == 0
    return seen[0]


def scheduler_answers(engine: FakeSglangEngine, fingerprint: str) -> None:
    """The fake scheduler answers ``get_internal_state`` as quiesce's plugin would: idle,
    running an ``is_fully_idle`` with ``fingerprint``."""
    async def internal_state() -> list[dict[str, Any]]:
        return [{STATE_KEY: state(0, idle_fingerprint=fingerprint, answered_at=time.time())}]

    engine.tokenizer_manager.get_internal_state = internal_state


@pytest.mark.parametrize("version,accepted,message", [
    ("0.5.21", "0.5.21", "SGLang 0.5.21 cannot be accepted: checked against its source"),
    ("0.5.23", "0.5.23", "SGLang 0.5.23 is a tested release: drop the option"),
    ("0.5.24", "0.5.21", "names SGLang '0.5.21', but SGLang 0.5.24 is installed"),
])
def test_a_bad_acceptance_exits_2_before_dynamo_starts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], version: str,
        accepted: str, message: str) -> None:
    installed(monkeypatch, version)
    code = cli.main(["dynamo", "sglang", "--admin-port", "0", "--accept-untested-engine",
                     accepted, "--", "--model-path", "m"])
    assert code == 2
    assert f"quiesce dynamo sglang: accept_untested_engine: {message}" in \
        capsys.readouterr().err
    assert "dynamo.sglang.main" not in sys.modules


def test_only_the_sglang_component_takes_the_option(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    installed(monkeypatch, "0.5.24")
    for name in ("vllm", "trtllm"):
        with pytest.raises(ConfigError) as info:
            component_for(name, AdmissionGate(), accept_untested_engine="0.5.24")
        assert info.value.field == "accept_untested_engine"
    assert cli.main(["dynamo", "vllm", "--admin-port", "0", "--accept-untested-engine",
                     "0.33.9", "--", "--model", "m"]) == 2
    assert "quiesce dynamo sglang only" in capsys.readouterr().err


async def test_without_the_option_an_untested_release_is_unknown_naming_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    dynamo = FakeDynamo(monkeypatch)
    engine = FakeSglangEngine()
    scheduler_answers(engine, RUNNING)
    fake_sglang(dynamo, engine)
    installed(monkeypatch, "0.5.24")
    running = await start()
    assert running.component.warnings == []
    work = await running.component.probe.pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("SGLang 0.5.24 is outside the versions" in r for r in work.reasons)
    assert any(f"(fingerprint '{RUNNING}') is not one" in r for r in work.reasons)
    assert any("--accept-untested-engine" in r for r in work.reasons)
    await running.stop()


async def test_with_the_option_the_installed_release_is_trusted_and_flagged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    dynamo = FakeDynamo(monkeypatch)
    engine = FakeSglangEngine()
    scheduler_answers(engine, RUNNING)
    fake_sglang(dynamo, engine)
    installed(monkeypatch, "0.5.24")
    caplog.set_level(logging.WARNING)
    component = component_for("sglang", AdmissionGate(accepting=False),
                              accept_untested_engine="0.5.24")
    assert isinstance(component, SglangComponent)
    running = await start(component)
    probe = component._probe.engine_probe
    assert isinstance(probe, SglangProbe) and probe.scheduler is not None
    assert RUNNING in probe.scheduler.fingerprints
    assert (await component.probe.pending_work()).verdict is Verdict.QUIESCENT
    scheduler_answers(engine, "f" * 16)  # a scheduler running other code than installed
    work = await component.probe.pending_work()
    assert work.verdict is Verdict.UNKNOWN and "'ffffffffffffffff'" in work.reasons[0]
    assert [w.split(":")[0] for w in component.warnings] == ["UNTESTED ENGINE"] * 2
    assert "SGLang 0.5.24 is not a release" in component.warnings[0]
    assert f"fingerprint {RUNNING} accepted" in component.warnings[1]
    assert [r.getMessage() for r in caplog.records if r.name == sglang_component.log.name
            and r.getMessage().startswith("UNTESTED")] == component.warnings
    await running.stop()


async def test_the_ready_line_and_status_carry_the_warning_and_the_worker_drains(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole ``quiesce dynamo sglang`` worker (core/dynamo_worker.py) over the fake
    Dynamo: ready, status, then SIGTERM → drained, exit 0."""
    dynamo = FakeDynamo(monkeypatch)
    engine = FakeSglangEngine()
    scheduler_answers(engine, RUNNING)
    fake_sglang(dynamo, engine)
    installed(monkeypatch, "0.5.24")
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(dynamo_worker, "_emit", events.append)
    args = parsed(["dynamo", "sglang", "--admin-port", "0", "--budget", "10",
                   "--router-grace", "0", "--router-quiet", "0",
                   "--accept-untested-engine", "0.5.24", "--", "--model-path", "m"])
    assert args.accept_untested_engine == "0.5.24"
    loop = asyncio.get_running_loop()
    worker = asyncio.create_task(dynamo_worker.run_dynamo_worker(args, args.args))
    try:
        await until(lambda: any(e["event"] == "ready" for e in events) or worker.done())
        (ready,) = [e for e in events if e["event"] == "ready"]
        assert len(ready["warnings"]) == 2
        assert all(w.startswith("UNTESTED ENGINE") for w in ready["warnings"])
        async with httpx.AsyncClient() as client:
            response = await client.get(
                f"http://127.0.0.1:{ready['admin_port']}/engine/status")
        status = response.json()
        assert status["warnings"] == ready["warnings"]
        assert status["pending_work"]["verdict"] == "quiescent"
        summary = format_status(status)
        assert summary.count("WARNING:") == 2 and "SGLang 0.5.24 is not a release" in summary
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(worker, 10) == 0
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        if not worker.done():
            worker.cancel()
    assert events[-1]["event"] == "exit" and events[-1]["outcome"] == "drained"
