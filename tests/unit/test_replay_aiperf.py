"""bench.replay's trace, aiperf and judge modules: the mooncake trace, the aiperf command,
and the judgement of every request from aiperf's raw export.

The records in ``data/aiperf_raw_records.jsonl`` are real ``profile_export_raw.jsonl``
records of aiperf 0.13.0 against ``quiesce serve --engine sim`` (prompts cut to 60
characters, long streams to their first and last 3 events), in this order: a clean
stream (max_tokens 8), a stream the worker aborted on SIGTERM (HTTP 200, then ``data:
{"error": ...}`` and no ``[DONE]``), a stream cut by SIGKILL (aiperf: ClientPayloadError),
a 503 ``worker_draining``, a refused connection. ``data/aiperf_summary_errors.json`` is
the summary of the SIGTERM run (cut to the counts and two error kinds). Cases aiperf
cannot be made to produce against the worker (a short answer, a missing ``[DONE]``...)
are edits of the clean record.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import random
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from bench.replay import aiperf
from bench.replay.aiperf import AiperfNotInstalled, read_aiperf_summary
from bench.replay.judge import NO_MAX_TOKENS, judge_record, read_outcomes, summarize
from bench.replay.trace import (
    DEFAULT_OUTPUT_LENGTHS,
    LogNormalLengths,
    Phase,
    UniformLengths,
    write_trace,
)
from bench.watch import proc_state

DATA = Path(__file__).parent / "data"
RAW = DATA / "aiperf_raw_records.jsonl"
CASES = ("clean", "error_event", "cut", "http_503", "refused")


def records() -> dict[str, dict[str, Any]]:
    lines = [json.loads(line) for line in RAW.read_text().splitlines() if line.strip()]
    assert len(lines) == len(CASES)
    return dict(zip(CASES, lines, strict=True))


def data_event(value: str, perf_ns: int) -> dict[str, Any]:
    return {"perf_ns": perf_ns, "packets": [{"name": "data", "value": value}]}


def is_text_chunk(response: dict[str, Any]) -> bool:
    value = response["packets"][0]["value"]
    return value != "[DONE]" and bool(json.loads(value).get("choices"))


# --- write_trace -------------------------------------------------------------------------


def test_trace_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    phases = [Phase(8.0, 5.0), Phase(0.5, 5.0)]
    first = write_trace(tmp_path / "a.jsonl", phases, seed=3)
    second = write_trace(tmp_path / "b.jsonl", phases, seed=3)
    other = write_trace(tmp_path / "c.jsonl", phases, seed=4)
    assert first == second
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert first != other


def test_trace_file_is_mooncake_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "trace.jsonl"
    returned = write_trace(path, [Phase(10.0, 10.0)], seed=1, block_size=64)
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == returned
    assert len(returned) > 50
    seen: set[int] = set()
    previous = -1
    for record in returned:
        assert set(record) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert isinstance(record["timestamp"], int)
        assert previous <= record["timestamp"] < 10_000
        previous = record["timestamp"]
        assert 64 <= record["input_length"] <= 512
        assert len(record["hash_ids"]) == math.ceil(record["input_length"] / 64)
        assert not seen & set(record["hash_ids"]), "hash ids shared between prompts"
        seen |= set(record["hash_ids"])
        assert 8 <= record["output_length"] <= 600


def test_trace_block_size_sets_the_hash_ids(tmp_path: Path) -> None:
    records_ = write_trace(tmp_path / "t.jsonl", [Phase(20.0, 2.0)], seed=5, block_size=16,
                           input_lengths=UniformLengths(33, 33))
    assert records_
    assert all(len(r["hash_ids"]) == 3 for r in records_)


def test_phase_rates_are_roughly_right(tmp_path: Path) -> None:
    records_ = write_trace(tmp_path / "t.jsonl",
                           [Phase(20.0, 10.0), Phase(0.0, 5.0), Phase(2.0, 10.0)], seed=11)
    busy = [r for r in records_ if r["timestamp"] < 10_000]
    idle = [r for r in records_ if 10_000 <= r["timestamp"] < 15_000]
    quiet = [r for r in records_ if r["timestamp"] >= 15_000]
    # Poisson counts: 200 +- 4 sigma (~57), 20 +- 4 sigma (~18); nothing in the idle phase.
    assert 143 <= len(busy) <= 257
    assert idle == []
    assert 2 <= len(quiet) <= 38
    assert max(r["timestamp"] for r in records_) < 25_000


def test_default_output_lengths_have_a_long_tail() -> None:
    rng = random.Random(0)
    lengths = [DEFAULT_OUTPUT_LENGTHS.sample(rng) for _ in range(4000)]
    long_share = sum(n > 250 for n in lengths) / len(lengths)
    assert 0.03 <= long_share <= 0.15
    assert sorted(lengths)[len(lengths) // 2] in range(50, 71)
    assert max(lengths) == 600
    assert min(lengths) >= 8


def test_output_length_distribution_is_a_parameter(tmp_path: Path) -> None:
    records_ = write_trace(tmp_path / "t.jsonl", [Phase(5.0, 4.0)], seed=2,
                           output_lengths=UniformLengths(250, 250))
    assert records_
    assert {r["output_length"] for r in records_} == {250}


@pytest.mark.parametrize(("rate", "duration"), [(-1.0, 1.0), (1.0, 0.0), (math.nan, 1.0),
                                                (1.0, math.inf)])
def test_phase_validates(rate: float, duration: float) -> None:
    with pytest.raises(ValueError, match="Phase"):
        Phase(rate, duration)


def test_write_trace_validates(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one Phase"):
        write_trace(tmp_path / "t.jsonl", [], seed=1)
    with pytest.raises(ValueError, match="block_size"):
        write_trace(tmp_path / "t.jsonl", [Phase(1.0, 1.0)], seed=1, block_size=0)
    with pytest.raises(ValueError, match="low <= high"):
        UniformLengths(10, 5)
    with pytest.raises(ValueError, match="minimum"):
        LogNormalLengths(minimum=0)

    class Zero:
        def sample(self, rng: random.Random) -> int:
            return 0

    with pytest.raises(ValueError, match="output_lengths drew 0"):
        write_trace(tmp_path / "t.jsonl", [Phase(50.0, 1.0)], seed=1, output_lengths=Zero())
    assert not (tmp_path / "t.jsonl").exists()


# --- judging the raw export --------------------------------------------------------------


def test_clean_stream_completes() -> None:
    outcome = judge_record(records()["clean"])
    assert outcome.completed
    assert outcome.reasons == ()
    assert outcome.status == 200
    assert (outcome.max_tokens, outcome.completion_tokens, outcome.token_source) == (8, 8, "usage")
    assert outcome.finish_reason == "length"
    assert outcome.done
    assert outcome.events == 10
    assert outcome.aiperf_error is None
    assert outcome.start_ns is not None and outcome.end_ns is not None
    assert outcome.last_event_ns is not None
    assert outcome.start_ns < outcome.last_event_ns <= outcome.end_ns + 1_000_000
    assert outcome.request_id == records()["clean"]["metadata"]["x_request_id"]
    assert outcome.phase == "profiling"


def test_error_event_in_a_200_stream_is_lost_though_aiperf_took_it_for_a_success() -> None:
    record = records()["error_event"]
    assert record["status"] == 200 and "error" not in record  # aiperf's verdict: success
    outcome = judge_record(record)
    assert outcome.lost
    assert outcome.reason == "error_event"
    assert {"no_finish_reason", "short_output", "no_done"} <= set(outcome.reasons)
    assert "request_aborted" in outcome.detail
    assert outcome.aiperf_error is None
    assert outcome.missed_by_aiperf


def test_error_event_counts_even_after_a_finish_reason_and_done() -> None:
    record = copy.deepcopy(records()["clean"])
    error = json.dumps({"error": {"type": "request_aborted", "message": "x",
                                  "retryable": False, "outcome": "lost"}})
    record["responses"].insert(-1, data_event(error, record["responses"][-1]["perf_ns"]))
    outcome = judge_record(record)
    assert outcome.reasons == ("error_event",)


def test_cut_stream_is_lost() -> None:
    outcome = judge_record(records()["cut"])
    assert outcome.reason == "no_finish_reason"
    assert set(outcome.reasons) == {"no_finish_reason", "short_output", "no_done"}
    assert outcome.token_source == "chunks"
    assert outcome.completion_tokens == 6  # the 6 events kept in the fixture
    assert outcome.aiperf_error == "ClientPayloadError"
    assert not outcome.missed_by_aiperf
    assert "transfer length" in outcome.detail


def test_http_503_and_refused_connection_are_lost() -> None:
    draining = judge_record(records()["http_503"])
    assert draining.reasons == ("http_503",)
    assert draining.status == 503
    assert "worker_draining" in draining.detail
    refused = judge_record(records()["refused"])
    assert refused.reasons == ("no_response",)
    assert refused.status is None
    assert refused.aiperf_error == "ClientConnectorError"
    assert refused.completion_tokens is None and refused.token_source == "none"


def test_fewer_tokens_than_max_tokens_is_lost() -> None:
    record = copy.deepcopy(records()["clean"])
    responses = record["responses"]
    text = [i for i, r in enumerate(responses) if is_text_chunk(r)]
    del responses[text[0]:text[2]]  # two tokens never arrived
    usage_at = next(i for i, r in enumerate(responses) if '"usage"' in r["packets"][0]["value"])
    usage = json.loads(responses[usage_at]["packets"][0]["value"])
    usage["usage"]["completion_tokens"] = 6
    responses[usage_at]["packets"][0]["value"] = json.dumps(usage)
    outcome = judge_record(record)
    assert outcome.reasons == ("short_output",)
    assert (outcome.completion_tokens, outcome.token_source) == (6, "usage")
    assert judge_record(record, expect_max_tokens=False).completed


def test_tokens_are_counted_from_chunks_without_a_usage_chunk() -> None:
    record = copy.deepcopy(records()["clean"])
    record["responses"] = [r for r in record["responses"]
                           if '"usage"' not in r["packets"][0]["value"]]
    outcome = judge_record(record)
    assert outcome.completed
    assert (outcome.completion_tokens, outcome.token_source) == (8, "chunks")
    record["responses"].pop(0)
    short = judge_record(record)
    assert short.reasons == ("short_output",)
    assert (short.completion_tokens, short.token_source) == (7, "chunks")


def test_missing_done_is_lost() -> None:
    record = copy.deepcopy(records()["clean"])
    assert record["responses"][-1]["packets"][0]["value"] == "[DONE]"
    record["responses"].pop()
    assert judge_record(record).reasons == ("no_done",)


def test_a_request_without_max_tokens_cannot_be_judged_complete() -> None:
    record = copy.deepcopy(records()["clean"])
    del record["payload"]["max_tokens"]
    outcome = judge_record(record)
    assert outcome.lost and outcome.reason == NO_MAX_TOKENS, outcome


def test_malformed_event_is_lost() -> None:
    record = copy.deepcopy(records()["clean"])
    record["responses"].insert(2, data_event("{not json", record["responses"][2]["perf_ns"]))
    outcome = judge_record(record)
    assert outcome.reasons == ("malformed_event",)
    assert "not JSON" in outcome.detail


def test_aiperf_error_alone_is_a_client_error() -> None:
    record = copy.deepcopy(records()["clean"])
    record["error"] = {"type": "TimeoutError", "message": "late"}
    outcome = judge_record(record)
    assert outcome.reasons == ("client_error",)
    assert outcome.aiperf_error == "TimeoutError"


def test_read_outcomes_and_summarize() -> None:
    outcomes = read_outcomes(RAW)
    assert [o.reason for o in outcomes] == [None, "error_event", "no_finish_reason",
                                            "http_503", "no_response"]
    assert summarize(outcomes) == {
        "sent": 5, "completed": 1, "failed": 4,
        "failures": {"error_event": 1, "no_finish_reason": 1, "http_503": 1,
                     "no_response": 1},
        "aiperf_failed": 3, "missed_by_aiperf": 1,
    }


def test_read_outcomes_skips_warmup_unless_asked(tmp_path: Path) -> None:
    record = records()["clean"]
    warm = copy.deepcopy(record)
    warm["metadata"]["benchmark_phase"] = "warmup"
    path = tmp_path / "raw.jsonl"
    path.write_text(json.dumps(warm) + "\n\n" + json.dumps(record) + "\n")
    assert len(read_outcomes(path)) == 1
    assert len(read_outcomes(path, include_warmup=True)) == 2


def test_read_outcomes_from_an_artifact_dir_and_unmerged_records(tmp_path: Path) -> None:
    lines = RAW.read_text()
    (tmp_path / "raw_records").mkdir()
    (tmp_path / "raw_records" / "raw_records_record_processor_a.jsonl").write_text(lines)
    assert len(read_outcomes(tmp_path)) == 5  # aiperf exported nothing: all requests failed
    (tmp_path / aiperf.RAW_EXPORT).write_text(lines.splitlines()[0] + "\n")
    assert len(read_outcomes(tmp_path)) == 1  # the merged export wins
    with pytest.raises(FileNotFoundError):
        read_outcomes(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"aiperf\.log"):
        read_outcomes(tmp_path / "empty")


def test_read_outcomes_names_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "raw.jsonl"
    path.write_text(RAW.read_text().splitlines()[0] + "\n" + '{"metadata": {"x_req\n')
    with pytest.raises(ValueError, match=r"raw.jsonl:2: not JSON"):
        read_outcomes(path)


# --- aiperf's own numbers ----------------------------------------------------------------


def test_read_aiperf_summary() -> None:
    summary = read_aiperf_summary(DATA / "aiperf_summary_errors.json")
    assert (summary.request_count, summary.error_request_count, summary.sent) == (20, 25, 45)
    assert not summary.was_cancelled
    assert summary.error_summary[0][1] == 1
    assert summary.error_summary[0][0].startswith("503 Service Unavailable")
    assert summary.error_summary[1] == (summary.error_summary[1][0], 9)
    assert "ClientConnectorError" in summary.error_summary[1][0]


@pytest.mark.parametrize("errors", [None, "absent"])
def test_aiperf_summary_without_errors_counts_zero(tmp_path: Path, errors: str | None) -> None:
    data: dict[str, Any] = {"request_count": {"unit": "requests", "avg": 22.0},
                            "was_cancelled": False, "error_summary": []}
    if errors is None:
        data["error_request_count"] = None  # what aiperf 0.13.0 writes for no errors
    (tmp_path / aiperf.SUMMARY_EXPORT).write_text(json.dumps(data))
    summary = read_aiperf_summary(tmp_path)
    assert (summary.request_count, summary.error_request_count) == (22, 0)


# --- the command and the run -------------------------------------------------------------


def test_aiperf_command_line(tmp_path: Path) -> None:
    command = aiperf.aiperf_command("http://127.0.0.1:8000", "quiesce", tmp_path / "t.jsonl",
                                    tmp_path / "out", failed_request_threshold=0.5,
                                    block_size=32, venv=tmp_path / "venv")
    assert command[:2] == [str(tmp_path / "venv" / "bin" / "aiperf"), "profile"]

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--url") == "http://127.0.0.1:8000"
    assert value("--model") == "quiesce"
    assert value("--custom-dataset-type") == "mooncake_trace"
    assert value("--input-file") == str(tmp_path / "t.jsonl")
    assert value("--tokenizer") == "local/quiesce-bpe"
    assert value("--isl-block-size") == "32"
    assert value("--export-level") == "raw"
    assert value("--failed-request-threshold") == "0.5"
    assert json.loads(value("--extra-inputs")) == {"ignore_eos": True}
    for flag in ("--streaming", "--fixed-schedule", "--no-server-metrics",
                 "--no-gpu-telemetry", "--use-server-token-count"):
        assert flag in command
    plain = aiperf.aiperf_command("http://h:1", "m", Path("t"), Path("o"))
    assert "--failed-request-threshold" not in plain
    with pytest.raises(ValueError, match="failed_request_threshold"):
        aiperf.aiperf_command("http://h:1", "m", Path("t"), Path("o"),
                              failed_request_threshold=2.0)


def test_aiperf_env_is_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "secret")
    env = aiperf.aiperf_env(tmp_path, hf_home=tmp_path / "hf")
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["HF_HOME"] == str(tmp_path / "hf")
    assert env["HOME"] == str(tmp_path)
    assert "HF_TOKEN" not in env


def test_run_aiperf_without_the_venv_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(AiperfNotInstalled, match=r"ci/setup_aiperf\.sh"):
        asyncio.run(aiperf.run_aiperf("http://h:1", "m", tmp_path / "t.jsonl",
                                      tmp_path / "out", failed_request_threshold=None,
                                      timeout_s=5, venv=tmp_path / "no-venv",
                                      hf_home=tmp_path / "hf"))
    assert not (tmp_path / "out").exists()


def fake_install(tmp_path: Path, script: str) -> tuple[Path, Path]:
    venv, hf_home = tmp_path / "venv", tmp_path / "hf"
    (venv / "bin").mkdir(parents=True)
    exe = venv / "bin" / "aiperf"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    ref = hf_home / "hub" / "models--local--quiesce-bpe" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    ref.write_text("0" * 40)
    return venv, hf_home


def test_run_aiperf_logs_and_reports_the_exit_code(tmp_path: Path) -> None:
    venv, hf_home = fake_install(tmp_path, 'echo "args: $*"; echo "home: $HOME"; exit 7\n')
    run = asyncio.run(aiperf.run_aiperf("http://h:1", "m", tmp_path / "t.jsonl",
                                        tmp_path / "out", failed_request_threshold=None,
                                        timeout_s=10, venv=venv, hf_home=hf_home))
    assert (run.returncode, run.timed_out, run.ok) == (7, False, False)
    log = run.log.read_text()
    assert "--fixed-schedule" in log
    home = log.split("home: ")[1].strip()
    assert not Path(home).exists()  # the temporary HOME is removed


def test_run_aiperf_kills_its_process_group_on_timeout(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_AIPERF_PIDS", str(pids))
    venv, hf_home = fake_install(
        tmp_path, 'sleep 60 & echo $! >> "$FAKE_AIPERF_PIDS"; echo $$ >> "$FAKE_AIPERF_PIDS"\n'
                  'wait\n')
    run = asyncio.run(aiperf.run_aiperf("http://h:1", "m", tmp_path / "t.jsonl",
                                        tmp_path / "out", failed_request_threshold=None,
                                        timeout_s=3.0, venv=venv, hf_home=hf_home))
    assert run.timed_out and run.returncode is None
    deadline = time.monotonic() + 10
    alive = set(map(int, pids.read_text().split()))
    assert len(alive) == 2
    while alive and time.monotonic() < deadline:  # a zombie (not yet reaped) is dead too
        alive = {pid for pid in alive if proc_state(pid) not in (None, "Z")}
        time.sleep(0.05)
    assert not alive, f"left running: {alive}"



def test_arun_aiperf_times_out_and_kills(tmp_path: Path) -> None:
    venv, hf_home = fake_install(tmp_path, "echo started; exec sleep 60\n")
    run = asyncio.run(asyncio.wait_for(aiperf.run_aiperf(  # bounded: a kill that failed
        "http://h:1", "m", tmp_path / "t.jsonl", tmp_path / "out",  # would wait for sleep
        failed_request_threshold=None, timeout_s=2.0, venv=venv, hf_home=hf_home), 30))
    assert run.timed_out and run.returncode is None
    assert "started" in run.log.read_text()


def test_arun_aiperf_reports_the_exit_code(tmp_path: Path) -> None:
    venv, hf_home = fake_install(tmp_path, "exit 0\n")
    run = asyncio.run(aiperf.run_aiperf(
        "http://h:1", "m", tmp_path / "t.jsonl", tmp_path / "out",
        failed_request_threshold=0.1, timeout_s=10, venv=venv, hf_home=hf_home))
    assert (run.returncode, run.timed_out) == (0, False)
    assert not run.ok  # no raw export was written
    assert "--failed-request-threshold" in run.command
