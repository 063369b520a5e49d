"""The truth matrix: what each engine's probe can answer in each topology, and the test
that shows it (``python -m bench truth_matrix`` writes ``bench/results/truth_matrix.json``).

One row per engine × topology: the verdict the probe can reach — ``exact`` (it can say
quiescent, and only when nothing is owed), ``busy`` (it cannot say quiescent while the
named work exists), ``unknown`` (never quiescent; the reason is in the row) or ``not
supported`` — the evidence level of the test (unit against a fake that follows the
engine's source, contract against the engine's real code, real engine on CPU, GPU) and
the test's node id. Building the file checks that every test named exists (parsed with
``ast``, nothing imported), so a renamed or deleted test fails the benchmark instead of
leaving a claim without its proof. The rows state what the tests assert; the tests
themselves run in ``make test`` (the GPU ones on an H200 machine: not run here).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from bench.results_format import Result

NAME = "truth_matrix"
HEADLINE = ("rows", "exact", "unknown", "busy", "not_supported")
ROOT = Path(__file__).resolve().parents[1]
VERDICTS = ("exact", "busy", "unknown", "not supported")
LEVELS = ("unit (fake following the source)", "contract (real engine code)",
          "real engine on CPU", "GPU (written, not run)")


@dataclasses.dataclass(frozen=True)
class Row:
    engine: str
    topology: str
    verdict: str
    detail: str
    level: str
    test: str
    """``path::name`` (a ``[param]`` suffix is allowed and not checked)."""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"{self.engine} × {self.topology}: verdict {self.verdict!r}")
        if self.level not in LEVELS:
            raise ValueError(f"{self.engine} × {self.topology}: level {self.level!r}")


UNIT, CONTRACT, CPU, GPU = LEVELS
V = "tests/integration/vllm/"
S = "tests/integration/sglang/"
T = "tests/unit/"
ROWS: tuple[Row, ...] = (
    # -- vLLM (0.31 and 0.32 on CPU) ----------------------------------------------------
    Row("vllm", "aggregated, TP=1", "exact", "frontend unfinished AND EngineCore's counts "
        "(board or utility call)", CPU,
        V + "test_vllm_probe.py::test_idle_engine_is_quiescent_on_the_board_and_by_utility_call"),
    Row("vllm", "aggregated, busy", "busy", "running requests", CPU,
        V + "test_vllm_probe.py::test_busy_engine_is_not_quiescent"),
    Row("vllm", "prefill, KV held for a reader", "busy", "finished requests whose KV "
        "blocks are held until the decoder pulled them", CPU,
        V + "test_vllm_probe.py::test_held_kv_keeps_a_prefill_worker_busy_until_released"),
    Row("vllm", "prefill/decode pair over NIXL", "exact", "drained only after the "
        "decoder's notified pull", CPU,
        V + "test_nixl_pair.py::test_prefill_drain_completes_only_after_the_decoder_pulled_the_kv"),
    Row("vllm", "prefill, decoder never pulls", "busy", "forced at the budget, never "
        "drained", CPU,
        V + "test_nixl_pair.py::"
        "test_prefill_drain_whose_decoder_never_pulls_is_forced_never_drained"),
    Row("vllm", "DP=2", "exact", "every rank's counts (KV held on rank 1 keeps it busy)",
        CPU, V + "test_vllm_dp.py::test_kv_held_on_the_second_rank_keeps_the_worker_busy"),
    Row("vllm", "DP=2 on a client without call_utility_all_async (0.31)", "exact",
        "each engine asked on its own", CPU,
        V + "test_vllm_dp.py::test_without_call_utility_all_every_rank_is_asked"),
    Row("vllm", "DP, fewer answers than ranks", "unknown", "only N of M DP engines "
        "answered", UNIT, T + "test_vllm_adapter.py::test_missing_dp_answers_are_unknown"),
    Row("vllm", "engine shut down or dead", "unknown", "the reason EngineCore gave", CPU,
        V + "test_vllm_probe.py::test_probe_after_engine_shutdown_is_unknown_with_the_reason"),
    Row("vllm", "untested release", "unknown", "outside TESTED_VERSIONS unless allowed",
        UNIT, T + "test_vllm_adapter.py::test_untested_version_fails_closed_unless_allowed"),
    # -- SGLang 0.5.23 ---------------------------------------------------------------------
    Row("sglang", "TP (dp=1)", "exact", "is_fully_idle plus the queues it misses", CPU,
        S + "test_engine_cpu.py"),
    Row("sglang", "DP=N", "exact", "AND over N ranks keyed by rank", CONTRACT,
        S + "test_probe.py::test_idle_prefill_pair_of_dp_ranks_is_quiescent"),
    Row("sglang", "DP, a rank missing or answering twice", "unknown", "DP rank(s) [k] "
        "did not answer", CONTRACT,
        S + "test_topology.py::test_a_late_answer_cannot_stand_in_for_a_missing_rank"),
    Row("sglang", "attention DP", "exact", "every group leader (dp_size × attn_dp_size, "
        "as SGLang resolves it)", CONTRACT,
        S + "test_topology.py::test_attention_dp_expects_every_group_leader"),
    Row("sglang", "PP > 1, aggregated", "exact", "stage 0 tracks every microbatch",
        CONTRACT, S + "test_topology.py::test_pipeline_parallel_aggregated_reads_stage_0"),
    Row("sglang", "PP > 1, prefill or decode", "unknown", "only pipeline stage 0 answers; "
        "a later stage may still owe decode", CONTRACT,
        S + "test_topology.py::"
        "test_pipeline_parallel_prefill_is_unknown_while_a_later_stage_owes_decode"),
    Row("sglang", "prefill, KV writes after an abort", "busy", "KV manager rooms open, "
        "ABORT_ACKs owed", CONTRACT,
        S + "test_abort_kv.py::test_kv_still_written_after_an_abort_is_busy"),
    Row("sglang", "decode offload to L3", "busy", "ongoing_backup", CONTRACT,
        S + "test_coverage.py::test_a_decode_offload_backup_to_l3_is_busy"),
    Row("sglang", "EPD multimodal, waiting for the encoder", "busy",
        "mm_receiver.waiting_list", CONTRACT,
        S + "test_coverage.py::test_a_request_waiting_for_its_encoder_is_busy"),
    Row("sglang", "a release whose is_fully_idle changed", "unknown", "fingerprint not "
        "accepted", CONTRACT,
        S + "test_coverage.py::test_a_changed_is_fully_idle_is_unknown_until_accepted"),
    Row("sglang", "real KV transfer (Mooncake/NIXL)", "not supported", "needs RDMA or a "
        "GPU; the GPU suite covers it", GPU, "tests/gpu/test_sglang.py"),
    # -- TensorRT-LLM (cannot be installed here: fakes follow the cited source) -------------
    Row("trtllm", "single process, TP=1", "exact", "zero confirmed across a loop pass",
        UNIT, T + "test_trtllm_probe.py::test_a_zero_needs_the_loop_to_go_round"),
    Row("trtllm", "TP>1 (Ray)", "exact", "ranks ANDed; fewer answers → unknown", UNIT,
        T + "test_trtllm_ray_proxy.py::test_a_short_rank_list_is_unknown"),
    Row("trtllm", "attention DP (Ray)", "exact", "rank counts added", UNIT,
        T + "test_trtllm_ray_proxy.py::test_ray_rank_counts_add_up_only_with_attention_dp"),
    Row("trtllm", "prefill, transfer in flight", "busy", "kv_sends_held", UNIT,
        T + "test_trtllm_probe.py::test_context_transfers_hold_a_prefill_worker"),
    Row("trtllm", "prefill, idle loop, transfer done but not reaped", "busy", "the KV is "
        "still held until reaped; ends at the budget unless wake_idle_loop is called",
        UNIT, T + "test_trtllm_findings.py::test_the_idle_gap_is_busy_and_a_wake_up_reaps_it"),
    Row("trtllm", "decode, awaiting KV", "busy", "kv_recvs_awaited, by state name", UNIT,
        T + "test_trtllm_probe.py::test_decode_requests_awaiting_kv_are_told_by_state_name"),
    Row("trtllm", "KV connector, older layout", "unknown", "a connector save is in no "
        "list the probe can read", UNIT,
        T + "test_trtllm_findings.py::test_a_kv_connector_on_the_older_layout_is_unknown"),
    Row("trtllm", "control action in flight, requests parked behind it", "busy",
        "request_accumulated and control_requests counted", UNIT,
        T + "test_trtllm_findings.py::test_a_request_parked_behind_a_control_sentinel_is_work"),
    Row("trtllm", "executor shut down", "unknown", "says whether shutdown was requested or "
        "a fatal error stopped it", UNIT,
        T + "test_trtllm_findings.py::test_a_shut_down_executor_says_whether_it_was_asked_to"),
    Row("trtllm", "MPI proxy, prefill", "unknown", "the proxy cannot see KV sends", UNIT,
        T + "test_trtllm_ray_proxy.py::test_proxy_prefill_is_always_unknown"),
)


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test")}


def check(rows: tuple[Row, ...] = ROWS, root: Path = ROOT) -> list[str]:
    """The rows whose test does not exist (file, or function in it)."""
    problems = []
    for row in rows:
        path, _, name = row.test.partition("::")
        file = root / path
        if not file.is_file():
            problems.append(f"{row.engine} × {row.topology}: no file {path}")
        elif name and name.split("[")[0] not in _tests_in(file):
            problems.append(f"{row.engine} × {row.topology}: no test {name} in {path}")
    return problems


def run() -> Result:
    problems = check()
    if problems:
        raise RuntimeError("the truth matrix names tests that do not exist: "
                           + "; ".join(problems))
    counts = {verdict: sum(r.verdict == verdict for r in ROWS) for verdict in VERDICTS}
    metrics: dict[str, float] = {"rows": len(ROWS),
                                 **{v.replace(" ", "_"): n for v, n in counts.items()}}
    return Result(name=NAME, metrics=metrics, units=dict.fromkeys(metrics, "rows"),
                  parameters={"rows": [dataclasses.asdict(row) for row in ROWS]},
                  notes=["Each row's test was checked to exist when this file was written; "
                         "the tests run in make test (GPU rows: written, not run here).",
                         "Verdicts: exact = can say quiescent, only when nothing is owed; "
                         "busy = cannot say quiescent while the named work exists; "
                         "unknown = never quiescent, with the reason; not supported."])
