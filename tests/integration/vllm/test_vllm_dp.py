"""Data parallelism with a real vLLM on the CPU: two EngineCores behind one AsyncLLM.

Every engine rank must be idle, not just the first: a request sent to rank 1 whose KV
is held for a decoder keeps the worker busy on both signal paths (the board and the
utility call), and the probe becomes quiescent only after the release; also through the
fan-out vLLM 0.31 needs (no ``call_utility_all_async``). The engine runs under a signal
owner (this test process, as a quiesce worker would be): every engine process and the DP
coordinator must be guarded, and SIGTERM/SIGINT to the coordinator must lose nothing.
The GPU suite (tests/gpu/test_vllm.py) collects this module too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from quiesce import Role, StageOutcome, Verdict
from quiesce.budget import Deadline
from quiesce.drain import DrainConfig, wait_quiescent
from quiesce.signal_guard import SignalOwnership
from tests.integration.vllm.conftest import SKIP_REASON

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)

from quiesce.adapters.vllm import VllmProbe  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

DP = 2
SPAWN_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
FAST = DrainConfig(router_grace_s=0, poll_base_s=0.001, poll_cap_s=0.01, probe_timeout_s=5)


@pytest.fixture(scope="module")
def dp_release_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dp-release")


@pytest.fixture(scope="module")
def dp_owner() -> Iterator[SignalOwnership]:
    """This process owns the engine's signals, as ``quiesce serve`` does."""
    owner = SignalOwnership()
    owner.claim()
    try:
        yield owner
    finally:
        owner.release()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dp_engine(tiny_model: Path, dp_release_dir: Path,
                    dp_owner: SignalOwnership) -> AsyncIterator[Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.integration.vllm.tiny_model import engine_kwargs, holding_connector

    args = AsyncEngineArgs(
        model=str(tiny_model), tokenizer=str(tiny_model), disable_log_stats=True,
        data_parallel_size=DP, kv_transfer_config=holding_connector(dp_release_dir),
        **engine_kwargs())
    # spawned, as quiesce serve starts them: a forked EngineCore would never load the
    # plugin (vLLM's "plugins loaded" flag is inherited) and stay unguarded
    method = os.environ.get(SPAWN_ENV)
    os.environ[SPAWN_ENV] = "spawn"
    try:
        llm = AsyncLLM.from_engine_args(args)
    finally:
        if method is None:
            os.environ.pop(SPAWN_ENV, None)
        else:
            os.environ[SPAWN_ENV] = method
    try:
        yield llm
    finally:
        dp_owner.permit_shutdown()  # the engine's own shutdown signals its processes
        llm.shutdown()


async def generate_on(llm: Any, rank: int, max_tokens: int) -> int:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
    produced = 0
    async for output in llm.generate("hello world", params, request_id=uuid.uuid4().hex,
                                     data_parallel_rank=rank):
        produced = len(output.outputs[0].token_ids)
    return produced


async def test_kv_held_on_the_second_rank_keeps_the_worker_busy(dp_engine: Any,
                                                                 dp_release_dir: Path) -> None:
    (dp_release_dir / "release").unlink(missing_ok=True)
    board = VllmProbe(dp_engine, Role.PREFILL)
    by_call = VllmProbe(dp_engine, Role.PREFILL, board=False)
    assert (await board.pending_work()).is_quiescent, board.board_off
    assert await generate_on(dp_engine, 1, 8) == 8
    assert dp_engine.output_processor.get_num_unfinished_requests() == 0
    for probe in (board, by_call):
        work = await probe.pending_work()
        assert work.verdict is Verdict.BUSY, work.summary()
        assert work.kv_sends_held == 1
        assert {v for k, v in work.details.items() if k.endswith("dp_engines")} == {DP}
    # what a probe of the first engine alone would have said
    first_only = await dp_engine.engine_core.call_utility_async("quiesce_snapshot")
    assert first_only["kv_sends_held"] == 0
    (dp_release_dir / "release").touch()
    report, last = await wait_quiescent(board, Deadline.after(60), FAST)
    assert report.outcome is StageOutcome.COMPLETED, last.summary()
    assert {v for k, v in last.details.items() if k.endswith("signal")} == {"board"}
    assert (await by_call.pending_work()).is_quiescent


async def test_work_on_both_ranks_is_summed(dp_engine: Any, dp_release_dir: Path) -> None:
    (dp_release_dir / "release").touch()
    probe = VllmProbe(dp_engine, Role.PREFILL)
    streams = [asyncio.create_task(generate_on(dp_engine, rank, 200)) for rank in (0, 1)]
    busy = None
    for _ in range(2000):  # until both ranks run their request
        work = await probe.pending_work()
        if work.running == DP:
            busy = work
            break
        await asyncio.sleep(0.005)
    assert busy is not None, "the two requests never ran at the same time"
    assert busy.verdict is Verdict.BUSY
    assert await asyncio.gather(*streams) == [200, 200]
    report, last = await wait_quiescent(probe, Deadline.after(60), FAST)
    assert report.outcome is StageOutcome.COMPLETED, last.summary()


class WithoutCallAll:
    """The engine's client as vLLM 0.31 has it: without ``call_utility_all_async``."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        if name == "call_utility_all_async":
            raise AttributeError(name)
        return getattr(self._client, name)


async def test_without_call_utility_all_every_rank_is_asked(dp_engine: Any,
                                                             dp_release_dir: Path) -> None:
    (dp_release_dir / "release").unlink(missing_ok=True)
    view = WithoutCallAll(dp_engine.engine_core)
    assert getattr(view, "call_utility_all_async", None) is None
    engine = type("Engine", (), {"engine_core": view, "vllm_config": dp_engine.vllm_config,
                                 "output_processor": dp_engine.output_processor,
                                 "errored": False})()
    probe = VllmProbe(engine, Role.PREFILL, board=False)
    assert (await probe.pending_work()).is_quiescent
    assert await generate_on(dp_engine, 1, 8) == 8
    work = await probe.pending_work()
    assert work.verdict is Verdict.BUSY, work.summary()
    assert work.kv_sends_held == 1
    assert {v for k, v in work.details.items() if k.endswith("dp_engines")} == {DP}
    (dp_release_dir / "release").touch()
    report, last = await wait_quiescent(probe, Deadline.after(60), FAST)
    assert report.outcome is StageOutcome.COMPLETED, last.summary()


async def test_the_dp_coordinator_is_guarded_and_its_signals_lose_nothing(
        dp_engine: Any, dp_owner: SignalOwnership, dp_release_dir: Path) -> None:
    (dp_release_dir / "release").touch()
    coordinator = dp_engine.engine_core.resources.coordinator.proc
    report = dp_owner.report()
    assert report.protected is True, report.summary()
    (mine,) = [p for p in report.processes if p.pid == coordinator.pid]
    assert mine.protected and mine.how.startswith("guarded (wraps "), mine
    streams = [asyncio.create_task(generate_on(dp_engine, rank, 200)) for rank in (0, 1)]
    probe = VllmProbe(dp_engine, Role.PREFILL)
    for _ in range(2000):  # until both ranks run their request
        if (await probe.pending_work()).running == DP:
            break
        await asyncio.sleep(0.005)
    for sig in (signal.SIGTERM, signal.SIGINT):
        os.kill(coordinator.pid, sig)
    assert await asyncio.gather(*streams) == [200, 200]  # nothing lost
    assert coordinator.is_alive()  # both signals were held back
    assert await generate_on(dp_engine, 0, 8) == 8  # and it still coordinates
    after = dp_owner.report()
    assert after.protected is True, after.summary()
