"""The worker's layout, as SGLang 0.5.23 resolves it, against the probe's rank accounting.

Each test builds a real ``ServerArgs`` and runs SGLang's own resolution
(``resolve_once``, on the tiny random-weight Llama of the vLLM tests), then drives the
probe through the real TokenizerManager/communicator path of :mod:`.shells`, with the
fan-out SGLang uses for that layout (one answer per DP rank, from pipeline stage 0 only).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.sglang import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

from sglang.srt.managers.load_snapshot import (
    DisaggregationMetrics,
    LoadSnapshot,
    QueueMetrics,
    ShmLoadSnapshotReader,
    ShmLoadSnapshotWriter,
)
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.runtime_context import get_parallel
from sglang.srt.server_args import ServerArgs

from quiesce.adapters.sglang import SglangProbe
from quiesce.adapters.sglang.topology import dp_ranks_of
from quiesce.probe import Role, Verdict
from tests.integration.sglang import shells

pytestmark = pytest.mark.usefixtures("hooked")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.integration.vllm.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def resolved(model: Path, **args: Any) -> ServerArgs:
    """A real ``ServerArgs`` after SGLang's own resolution (as ``Engine`` runs it)."""
    server_args = ServerArgs(model_path=str(model), device="cpu", **args)
    server_args.resolve_once()
    return server_args


@pytest.fixture
def writers(tmp_path: Path) -> Iterator[tuple[Path, list[Any]]]:
    path = tmp_path / "sglang_loads_topology.shm"
    made: list[Any] = []
    yield path, made
    for writer in made:
        writer.close()


def publish(path: Path, made: list[Any], ranks: int, mode: str) -> ShmLoadSnapshotReader:
    """Every DP rank's leader publishes an idle snapshot, sized as SGLang sizes it
    (``get_parallel().num_dp_ranks``); the reader the TokenizerManager holds."""
    for rank in range(ranks):
        made.append(ShmLoadSnapshotWriter(str(path), ranks, rank))
        made[-1].write(LoadSnapshot(
            timestamp=time.time(), dp_rank=rank,
            disaggregation=DisaggregationMetrics(mode=mode),
            queues=QueueMetrics(waiting=0, grammar=0, paused=0, retracted=0,
                                prealloc_ready=0)))
    return ShmLoadSnapshotReader(str(path), ranks)


@pytest.mark.parametrize("args", [
    {"attn_dp_size": 2, "tp_size": 2},
    {"dp_size": 2, "enable_dp_attention": True, "tp_size": 2},  # the deprecated spelling
])
async def test_attention_dp_expects_every_group_leader(
        tiny_model: Path, writers: tuple[Path, list[Any]], args: dict[str, Any]) -> None:
    server_args = resolved(tiny_model, **args)
    # SGLang's resolver declares the layout; the raw fields keep the user's input
    assert (server_args.dp_size, server_args.attn_dp_size) == (
        args.get("dp_size", 1), args.get("attn_dp_size", 1))
    path, made = writers
    reader = publish(path, made, 2, "null")
    tm = shells.tokenizer_manager([shells.scheduler("null"), shells.scheduler("null")],
                                  server_args=server_args, reader=reader)
    assert dp_ranks_of(tm) == 2
    work = await SglangProbe(tm, Role.AGGREGATED).pending_work()
    assert work.verdict is Verdict.QUIESCENT, work.summary()


async def test_pipeline_parallel_prefill_is_unknown_while_a_later_stage_owes_decode(
        tiny_model: Path) -> None:
    server_args = resolved(tiny_model, pp_size=2, disaggregation_mode="prefill")
    stage0, stage1 = shells.scheduler("prefill"), shells.scheduler("prefill")
    for stage in (stage0, stage1):
        stage.running_mbs, stage.mbs = [], []
    # stage 1 still holds a request whose KV it has not finished sending; stage 0 is done
    stage1.disagg_prefill_inflight_queue.append(shells.req())
    with get_parallel().override(pp_size=2, pp_rank=1):
        assert stage1.is_fully_idle() is False
    with get_parallel().override(pp_size=2, pp_rank=0):
        assert stage0.is_fully_idle() is True
    # SGLang's fan-out reaches pipeline stage 0 only
    tm = shells.tokenizer_manager([stage0], server_args=server_args, pp_size=2)
    work = await SglangProbe(tm, Role.PREFILL).pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("pipeline parallelism (pp_size=2)" in r for r in work.reasons), work.reasons
    # the scheduler's own answer says so too, whatever the main process believes
    tm = shells.tokenizer_manager([stage0], pp_size=2)
    work = await SglangProbe(tm, Role.PREFILL).pending_work()
    assert any("only pipeline stage 0 answers" in r for r in work.reasons), work.reasons


async def test_pipeline_parallel_aggregated_reads_stage_0(tiny_model: Path) -> None:
    # aggregated PP: stage 0 tracks every microbatch in flight (is_fully_idle's
    # _pp_microbatches_drained), and no remote reader holds KV
    s = shells.scheduler("null")
    s.running_mbs, s.mbs = [], []
    tm = shells.tokenizer_manager([s], server_args=resolved(tiny_model, pp_size=2), pp_size=2)
    assert (await SglangProbe(tm, Role.AGGREGATED).pending_work()).verdict is Verdict.QUIESCENT
    s.mbs = [ScheduleBatch(reqs=[shells.req()], batch_is_full=False)]
    assert (await SglangProbe(tm, Role.AGGREGATED).pending_work()).verdict is Verdict.BUSY


async def test_a_late_answer_cannot_stand_in_for_a_missing_rank() -> None:
    idle, busy = shells.scheduler("null"), shells.scheduler("null")
    busy.waiting_queue.append(shells.req())
    held: list[tuple[int, Any]] = []
    tm = shells.tokenizer_manager([idle, busy])
    comm = tm.get_internal_state_communicator

    def send(recv_req: Any) -> None:  # both ranks are mid-step: nothing answers yet
        held.extend((rank, recv_req) for rank in (0, 1))

    def answer(rank: int) -> None:
        position = next(i for i, (r, _) in enumerate(held) if r == rank)
        _, recv_req = held.pop(position)
        with get_parallel().override(dp_rank=rank):
            comm.handle_recv((idle, busy)[rank].get_internal_state(recv_req))

    comm._send = send
    # another caller (say an operator's /server_info) gives up before any rank answered
    other = asyncio.ensure_future(tm.get_internal_state())
    await asyncio.sleep(0)
    other.cancel()
    probe = SglangProbe(tm, Role.AGGREGATED, scheduler_timeout_s=5.0)
    reading = asyncio.ensure_future(probe.pending_work())
    for _ in range(100):  # until the probe's request went out too
        if len(held) == 4:
            break
        await asyncio.sleep(0)
    assert len(held) == 4
    answer(0)  # rank 0's late answer to the other caller lands in the probe's call...
    answer(0)  # ...then its answer to the probe: two answers, rank 1 still mid-step
    work = await reading
    assert work.verdict is Verdict.UNKNOWN, work.summary()
    assert any("DP rank(s) [1] did not answer" in r for r in work.reasons), work.reasons
