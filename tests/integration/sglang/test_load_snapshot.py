"""The main-process load-snapshot signal against SGLang's real shared-memory writer/reader.

SGLang's ``ShmLoadSnapshotWriter`` (one per DP rank, as each DP leader's scheduler
creates it) writes real ``LoadSnapshot`` structs into a file; SGLang's
``ShmLoadSnapshotReader`` (as the TokenizerManager holds it) reads them; quiesce's
:func:`read_load_snapshot` judges them. The file lives in the test's temporary directory
instead of ``/dev/shm`` (the writer takes any path).
"""

from __future__ import annotations

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

from quiesce.adapters.sglang.frontend import read_load_snapshot, read_requests
from quiesce.probe import Role, Verdict
from tests.integration.sglang import shells


def snapshot(rank: int, mode: str = "prefill", *, age_s: float = 0.0, inflight: int = 0,
             running: int = 0, disagg: bool = True) -> Any:
    return LoadSnapshot(
        timestamp=time.time() - age_s, dp_rank=rank, num_running_reqs=running,
        disaggregation=DisaggregationMetrics(mode=mode, prefill_inflight_queue_reqs=inflight)
        if disagg else None,
        queues=QueueMetrics(waiting=0, grammar=0, paused=0, retracted=0, prealloc_ready=0))


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[tuple[Path, list[Any]]]:
    path = tmp_path / "sglang_loads_test.shm"
    writers: list[Any] = []
    yield path, writers
    for writer in writers:
        writer.close()


def read(path: Path, dp_size: int, role: Role = Role.PREFILL, max_age_s: float = 5.0) -> Any:
    tm = shells.tokenizer_manager([], dp_size=dp_size,
                                  reader=ShmLoadSnapshotReader(str(path), dp_size))
    return read_load_snapshot(tm, role, expected_ranks=dp_size, max_age_s=max_age_s)


def test_every_rank_fresh_and_empty_is_quiescent(shm: tuple[Path, list[Any]]) -> None:
    path, writers = shm
    for rank in (0, 1):
        writers.append(ShmLoadSnapshotWriter(str(path), 2, rank))
        writers[-1].write(snapshot(rank))
    work = read(path, 2)
    assert work.verdict is Verdict.QUIESCENT and work.details["dp_ranks"] == 2


def test_a_kv_send_in_flight_on_any_rank_is_busy(shm: tuple[Path, list[Any]]) -> None:
    path, writers = shm
    for rank in (0, 1):
        writers.append(ShmLoadSnapshotWriter(str(path), 2, rank))
        writers[-1].write(snapshot(rank, inflight=rank))
    work = read(path, 2)
    assert work.verdict is Verdict.BUSY and work.kv_sends_held == 1


def test_a_rank_that_never_published_is_unknown(shm: tuple[Path, list[Any]]) -> None:
    path, writers = shm
    for rank in (0, 1):  # SGLang's writer fills its slot with timestamp 0.0 at creation
        writers.append(ShmLoadSnapshotWriter(str(path), 2, rank))
    writers[0].write(snapshot(0))
    work = read(path, 2)
    assert work.verdict is Verdict.UNKNOWN and "DP rank 1 has not published" in work.reasons[0]


def test_a_missing_rank_is_unknown(shm: tuple[Path, list[Any]]) -> None:
    path, writers = shm
    writers.append(ShmLoadSnapshotWriter(str(path), 2, 0))
    writers[0].write(snapshot(0))  # no writer for rank 1: its slot is empty, read_all skips it
    work = read(path, 2)
    assert work.verdict is Verdict.UNKNOWN and "1 of 2 DP ranks" in work.reasons[0]


def test_no_file_is_unknown(tmp_path: Path) -> None:
    work = read(tmp_path / "absent.shm", 1)
    assert work.verdict is Verdict.UNKNOWN and "0 of 1" in work.reasons[0]


def test_a_stale_snapshot_is_unknown(shm: tuple[Path, list[Any]]) -> None:
    path, writers = shm
    writers.append(ShmLoadSnapshotWriter(str(path), 1, 0))
    writers[0].write(snapshot(0, age_s=60.0))
    work = read(path, 1)
    assert work.verdict is Verdict.UNKNOWN and "stale" in work.reasons[0]


def test_no_disaggregation_section_or_another_mode_is_unknown(
        shm: tuple[Path, list[Any]]) -> None:
    path, writers = shm
    writers.append(ShmLoadSnapshotWriter(str(path), 1, 0))
    writers[0].write(snapshot(0, disagg=False))
    assert "no disaggregation section" in read(path, 1).reasons[0]
    writers[0].write(snapshot(0, mode="decode"))
    assert "mode 'decode'" in read(path, 1).reasons[0]
    writers[0].write(snapshot(0, mode="null"))
    assert read(path, 1, Role.AGGREGATED).verdict is Verdict.QUIESCENT


def test_a_reader_absent_is_unknown() -> None:
    tm = shells.tokenizer_manager([], dp_size=1, reader=None)
    work = read_load_snapshot(tm, Role.AGGREGATED, expected_ranks=1)
    assert work.verdict is Verdict.UNKNOWN and "load_snapshot_reader" in work.reasons[0]


def test_rid_to_state_counts_and_fails_closed_with_several_tokenizer_workers() -> None:
    tm = shells.tokenizer_manager([])
    assert read_requests(tm, Role.AGGREGATED).queues["tokenizer_requests"] == 0
    tm.rid_to_state["r1"] = object()
    assert read_requests(tm, Role.AGGREGATED).verdict is Verdict.BUSY
    tm = shells.tokenizer_manager([], tokenizer_worker_num=2)
    work = read_requests(tm, Role.AGGREGATED)
    assert work.verdict is Verdict.UNKNOWN and "tokenizer_worker_num" in work.reasons[0]
    del tm.rid_to_state
    tm.server_args.tokenizer_worker_num = 1
    assert read_requests(tm, Role.AGGREGATED).verdict is Verdict.UNKNOWN
