"""The board: EngineCore's per-step counts in shared memory, and the probe that reads them.

The EngineCore here is a fake living in this process (vLLM is not installed in the core
environment); the plugin's publisher, the board files, the FIFO and the probe are the
real ones. The real engine is covered by tests/integration/vllm/test_vllm_probe.py on
the CPU (board signal, held KV, wake-up on release) and tests/gpu/test_vllm.py on an H200.
"""

from __future__ import annotations

import asyncio
import os
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quiesce import Role, Verdict
from quiesce.adapters.vllm import VllmProbe
from quiesce.adapters.vllm import probe as vllm_probe
from quiesce.adapters.vllm import utilities as vllm_utilities
from quiesce.adapters.vllm.board import (
    CHECKSUM_AT,
    SEQ_AT,
    SEQUENCE,
    BoardError,
    BoardFlags,
    BoardReader,
    BoardWriter,
    ChangeFifo,
)
from quiesce.adapters.vllm.publisher import MAX_BOARDS

IDLE = (0, 0, 0, 0, 0, 0, 0)


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[ChangeFifo]:
    changes = ChangeFifo(str(tmp_path / "changes.fifo"))
    yield changes
    changes.close()


def writer(tmp_path: Path, name: str = "a.board") -> BoardWriter:
    return BoardWriter(str(tmp_path / name), str(tmp_path / "changes.fifo"), dp_rank=0)


# -- the board itself ---------------------------------------------------------------------


def test_a_publication_reads_back_and_only_a_change_publishes(tmp_path: Path,
                                                               fifo: ChangeFifo) -> None:
    board = writer(tmp_path)
    reader = BoardReader(str(tmp_path / "a.board"))
    assert reader.read() is None  # never published: no answer, not "idle"
    board.publish((1, 2, 3, 4, 0, 1, int(BoardFlags.HAS_WORK)))
    first = reader.read()
    assert first is not None
    assert (first.waiting, first.running, first.kv_sends_held, first.kv_recvs_awaited) == (
        1, 2, 3, 4)
    assert first.has_work and reader.pid == os.getpid()
    board.publish((1, 2, 3, 4, 0, 1, int(BoardFlags.HAS_WORK)))
    again = reader.read()
    assert again is not None and again.sequence == first.sequence
    board.publish(IDLE)
    last = reader.read()
    assert last is not None and last.sequence > first.sequence and not last.has_work
    board.close()
    closed = reader.read()
    assert closed is not None and BoardFlags.CLOSED in closed.flags


def test_a_write_in_progress_or_a_torn_copy_is_never_read(tmp_path: Path,
                                                          fifo: ChangeFifo) -> None:
    board = writer(tmp_path)
    board.publish((0, 5, 0, 0, 0, 0, 1))
    path = tmp_path / "a.board"
    reader = BoardReader(str(path))
    raw = bytearray(path.read_bytes())
    (sequence,) = SEQUENCE.unpack_from(raw, SEQ_AT)
    with path.open("r+b") as f:  # odd sequence: a writer is mid-way
        f.seek(SEQ_AT)
        f.write(SEQUENCE.pack(sequence + 1))
    assert reader.read() is None
    with path.open("r+b") as f:  # even sequence, counts that do not match the checksum
        f.seek(SEQ_AT)
        f.write(SEQUENCE.pack(sequence))
        f.seek(CHECKSUM_AT - 4)
        f.write(b"\x07\x00\x00\x00")
    assert reader.read() is None
    board.close()


def test_a_file_that_is_not_a_board_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BoardError, match="cannot open"):
        BoardReader(str(tmp_path / "missing.board"))
    (tmp_path / "short.board").write_bytes(b"QSCB")
    with pytest.raises(BoardError, match="smaller"):
        BoardReader(str(tmp_path / "short.board"))
    (tmp_path / "other.board").write_bytes(b"XXXX" + bytes(60))
    with pytest.raises(BoardError, match="layout"):
        BoardReader(str(tmp_path / "other.board"))


async def test_the_fifo_wakes_a_waiter_on_a_change_and_not_otherwise(
        tmp_path: Path, fifo: ChangeFifo) -> None:
    board = writer(tmp_path)
    await fifo.wait(0.01)  # nothing published: returns at the timeout
    waiting = asyncio.create_task(fifo.wait(3600))
    await asyncio.sleep(0)
    assert not waiting.done()
    board.publish((0, 1, 0, 0, 0, 0, 1))
    await asyncio.wait_for(waiting, 60)
    fifo.drain()
    board.close()


async def test_a_signal_one_reader_consumed_still_wakes_every_waiter(
        tmp_path: Path, fifo: ChangeFifo) -> None:
    board = writer(tmp_path)
    waiting = asyncio.create_task(fifo.wait(3600))
    await asyncio.sleep(0)
    board.publish((0, 1, 0, 0, 0, 0, 1))
    fifo.drain()  # another caller consumed the byte before the loop saw it
    await asyncio.wait_for(waiting, 60)
    board.close()


def test_a_board_whose_reader_went_away_is_abandoned(tmp_path: Path) -> None:
    changes = ChangeFifo(str(tmp_path / "changes.fifo"))
    board = writer(tmp_path)
    board.publish((0, 1, 0, 0, 0, 0, 1))
    assert not board.abandoned
    changes.close()
    board.publish(IDLE)  # EPIPE, never an exception into the engine loop
    assert board.abandoned
    board.close()


# -- the plugin's publisher inside a fake EngineCore ----------------------------------------


class FakeScheduler:
    def __init__(self) -> None:
        self.waiting: list[Any] = []
        self.kv_holding_waiting: list[Any] = []
        self.running: list[Any] = []
        self.requests: dict[str, Any] = {}
        self.finished_req_ids: set[str] = set()
        self.connector = None

    def has_requests(self) -> bool:
        return bool(self.requests or self.finished_req_ids)

    def add(self, request_id: str, queue: str = "running") -> None:
        self.requests[request_id] = request_id
        getattr(self, queue).append(request_id)

    def finish(self, request_id: str, hold: bool) -> None:
        self.running.remove(request_id)
        if not hold:
            del self.requests[request_id]


class FakeEngineCore:
    """The attributes the plugin reads of a vLLM 0.32 EngineCoreProc, nothing more."""

    def __init__(self, rank: int = 0) -> None:
        self.scheduler = FakeScheduler()
        self.batch_queue = None
        self.vllm_config = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(data_parallel_rank=rank))
        self.steps = 0
        self.stopped = False
        self.step_fn = self.step

    def step(self) -> tuple[dict[int, Any], bool]:
        self.steps += 1
        return {}, False

    def _handle_client_request(self, request_type: str, request: Any) -> Any:
        """What vLLM's input loop calls: here a utility call or an added request."""
        if request_type == "add":
            self.scheduler.add(request, "waiting")
            return None
        method, args = request
        return getattr(vllm_utilities, method)(self, *args)

    def shutdown(self) -> None:
        self.stopped = True


class InProcessClient:
    """Answers utility calls by calling the plugin on fake EngineCores in this process."""

    def __init__(self, cores: list[FakeEngineCore]) -> None:
        self.cores = cores
        self.calls: list[str] = []

    async def call_utility_all_async(self, method: str, *args: Any) -> list[Any]:
        self.calls.append(method)
        return [core._handle_client_request("utility", (method, args)) for core in self.cores]


def engine_over(cores: list[FakeEngineCore], unfinished: int = 0) -> Any:
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
        data_parallel_size_local=len(cores), data_parallel_size=len(cores)))
    frontend = types.SimpleNamespace(get_num_unfinished_requests=lambda: unfinished)
    return types.SimpleNamespace(engine_core=InProcessClient(cores), output_processor=frontend,
                                 vllm_config=config, errored=False)


@pytest.fixture(autouse=True)
def tested_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_probe, "installed_vllm_version", lambda: "0.32.0")


def signal_of(work: Any) -> set[Any]:
    return {v for k, v in work.details.items() if k.endswith("signal")}


async def test_the_probe_reads_every_dp_engines_board_without_a_call() -> None:
    cores = [FakeEngineCore(0), FakeEngineCore(1)]
    engine = engine_over(cores)
    probe = VllmProbe(engine, Role.PREFILL)
    assert (await probe.pending_work()).is_quiescent
    assert engine.engine_core.calls == ["quiesce_subscribe"]
    cores[1].scheduler.add("r1")
    cores[1].step_fn()  # a step publishes what it leaves behind
    busy = await probe.pending_work()
    assert busy.verdict is Verdict.BUSY and busy.running == 1
    assert signal_of(busy) == {"board"}
    cores[1].scheduler.finish("r1", hold=True)
    cores[1].step_fn()
    held = await probe.pending_work()
    assert (held.running, held.kv_sends_held) == (0, 1)
    del cores[1].scheduler.requests["r1"]
    cores[1].step_fn()
    assert (await probe.pending_work()).is_quiescent
    assert engine.engine_core.calls == ["quiesce_subscribe"]  # every read came off the board
    assert cores[1].steps == 3


async def test_a_request_taken_without_a_step_is_on_the_board_at_once() -> None:
    """An idle (or paused) EngineCore takes requests without stepping; another frontend's
    request must not wait for a step to show."""
    core = FakeEngineCore()
    probe = VllmProbe(engine_over([core]), Role.AGGREGATED)
    assert (await probe.pending_work()).is_quiescent
    core._handle_client_request("add", "from-another-frontend")
    work = await probe.pending_work()
    assert work.verdict is Verdict.BUSY and work.waiting == 1
    assert core.steps == 0


async def test_added_dp_engines_are_subscribed_before_the_board_is_trusted() -> None:
    cores = [FakeEngineCore(0)]
    engine = engine_over(cores)
    probe = VllmProbe(engine, Role.PREFILL)
    assert (await probe.pending_work()).is_quiescent
    cores.append(FakeEngineCore(1))  # elastic scale-up: one more engine, holding KV
    cores[1].scheduler.requests["held"] = "held"
    engine.vllm_config.parallel_config.data_parallel_size_local = 2
    work = await probe.pending_work()  # this read asks by utility call
    assert work.verdict is Verdict.BUSY and work.kv_sends_held == 1
    work = await probe.pending_work()  # and this one reads both boards
    assert signal_of(work) == {"board"} and work.kv_sends_held == 1


async def test_a_waiting_drain_wakes_on_the_step_that_changed_the_counts() -> None:
    core = FakeEngineCore()
    core.scheduler.add("r1")
    probe = VllmProbe(engine_over([core]), Role.AGGREGATED)
    work = await probe.pending_work()
    assert work.verdict is Verdict.BUSY
    unchanged = asyncio.create_task(probe.wait_for_change(work, 3600))
    core.step_fn()  # same counts: publishes nothing
    await asyncio.sleep(0.01)
    assert not unchanged.done()
    core.scheduler.finish("r1", hold=False)
    core.step_fn()
    await asyncio.wait_for(unchanged, 60)
    assert (await probe.pending_work()).is_quiescent


async def test_a_failing_count_is_unknown_with_the_reason_from_the_snapshot() -> None:
    core = FakeEngineCore()
    engine = engine_over([core])
    probe = VllmProbe(engine, Role.PREFILL)
    assert (await probe.pending_work()).is_quiescent
    del core.scheduler.kv_holding_waiting  # drift: the queue is gone in some vLLM version
    core.step_fn()
    work = await probe.pending_work()
    assert work.verdict is Verdict.UNKNOWN
    assert any("kv_holding_waiting" in r for r in work.reasons), work.reasons
    assert engine.engine_core.calls[-1] == "quiesce_snapshot"


async def test_an_engine_the_frontend_reports_dead_is_asked_not_trusted() -> None:
    core = FakeEngineCore()
    engine = engine_over([core])
    probe = VllmProbe(engine, Role.PREFILL)
    assert (await probe.pending_work()).is_quiescent
    engine.errored = True
    await probe.pending_work()
    assert engine.engine_core.calls[-1] == "quiesce_snapshot"


async def test_a_board_closed_by_shutdown_turns_the_board_off_for_good() -> None:
    core = FakeEngineCore()
    engine = engine_over([core])
    probe = VllmProbe(engine, Role.PREFILL)
    assert (await probe.pending_work()).is_quiescent
    core.shutdown()
    assert core.stopped
    await probe.pending_work()
    assert probe.board_off is not None and "closed" in probe.board_off
    assert engine.engine_core.calls[-1] == "quiesce_snapshot"


async def test_without_a_liveness_signal_the_board_is_not_used() -> None:
    engine = engine_over([FakeEngineCore()])
    del engine.errored
    probe = VllmProbe(engine, Role.PREFILL)
    assert (await probe.pending_work()).is_quiescent
    assert probe.board_off is not None and "alive" in probe.board_off
    assert engine.engine_core.calls == ["quiesce_snapshot"]
    work = await probe.pending_work()  # and status says why
    assert any(k.endswith("board_off") and "alive" in str(v) for k, v in work.details.items())


async def test_closing_stops_the_engines_counting_and_a_read_subscribes_again() -> None:
    core = FakeEngineCore()
    engine = engine_over([core])
    probe = VllmProbe(engine, Role.PREFILL)
    sharing = VllmProbe(engine, Role.PREFILL)
    assert (await probe.pending_work()).is_quiescent
    assert (await sharing.pending_work()).is_quiescent
    assert engine.engine_core.calls == ["quiesce_subscribe"]  # one board per process
    publisher = core._quiesce_publisher  # type: ignore[attr-defined]
    probe.close()
    core.scheduler.add("r1")
    core.step_fn()  # the first change meets the closed FIFO: the board is dropped
    assert not publisher.boards
    work = await sharing.pending_work()
    assert work.verdict is Verdict.BUSY and signal_of(work) == {"board"}
    assert engine.engine_core.calls == ["quiesce_subscribe", "quiesce_subscribe"]


def test_an_engine_keeps_a_bounded_number_of_boards(tmp_path: Path) -> None:
    core = FakeEngineCore()
    fifos = []
    for i in range(MAX_BOARDS + 2):
        directory = tmp_path / str(i)
        directory.mkdir()
        fifos.append(ChangeFifo(str(directory / "changes.fifo")))
        answer = vllm_utilities.quiesce_subscribe(core, str(directory), "changes.fifo")
        assert "board" in answer, answer
    first = BoardReader(str(tmp_path / "0" / answer["board"]))
    snapshot = first.read()
    assert snapshot is not None and BoardFlags.CLOSED in snapshot.flags
    assert len(core._quiesce_publisher.boards) == MAX_BOARDS  # type: ignore[attr-defined]
    for changes in fifos:
        changes.close()


def test_a_directory_the_engine_cannot_see_is_an_answer_not_an_error(tmp_path: Path) -> None:
    answer = vllm_utilities.quiesce_subscribe(FakeEngineCore(), str(tmp_path / "elsewhere"),
                                           "changes.fifo")
    assert "error" in answer and "board" not in answer
